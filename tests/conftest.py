"""Shared fixtures: tiny Llama, Mistral, Qwen2 and Qwen3 checkpoints built from scratch for the session."""

import os
from importlib import resources
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

# Wide weights spread the logits, so greedy argmax is not decided by float rounding.
_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
}

TINY_CONFIGS = {
    # Llama 3.1-style rope scaling, untied head, weights in two shards.
    "llama": lambda vocab: LlamaConfig(
        vocab_size=vocab,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        **_COMMON,
    ),
    # Mistral: the Llama decoder under another config class (no sliding window within 512 positions).
    "mistral": lambda vocab: MistralConfig(
        vocab_size=vocab,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=None,
        tie_word_embeddings=False,
        architectures=["MistralForCausalLM"],
        **_COMMON,
    ),
    # Qwen2: q/k/v biases, GQA 4:1.
    "qwen2": lambda vocab: Qwen2Config(
        vocab_size=vocab,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        **_COMMON,
    ),
    # Qwen3: q/k norms, tied embeddings, YaRN rope scaling.
    "qwen3": lambda vocab: Qwen3Config(
        vocab_size=vocab,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        **_COMMON,
    ),
}


@pytest.fixture(scope="session")
def tokenizer():
    corpus = resources.files("kvserve.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    return train_tokenizer(corpus, vocab_size=512)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_random_checkpoint(
            make_config(len(tokenizer)),
            tokenizer,
            root / name,
            seed=7,
            max_shard_size="200KB" if name == "llama" else None,
        )
        for name, make_config in TINY_CONFIGS.items()
    }


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model(request, tiny_checkpoints) -> Path:
    """Each tiny checkpoint in turn."""
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    """A server on the tiny Llama checkpoint (served as "tiny-llama"), shared by a test module."""
    from tests.server_harness import running_server

    with running_server(
        model=str(tiny_checkpoints["llama"]), served_model_name="tiny-llama", kv_cache_memory_bytes=4 << 20
    ) as running:
        yield running
