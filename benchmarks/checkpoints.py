"""The benchmarks' random-weight checkpoints, each built once under kvserve's model cache from a BPE tokenizer trained
here and seeded random weights (nothing is downloaded): the ones several scripts share, and `random_checkpoint` for a
script's own shape."""

import random
import string
from collections.abc import Callable
from pathlib import Path

from transformers import LlamaConfig, PreTrainedConfig, Qwen3Config

from kvserve.engine.default_model import cache_root
from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

QWEN3_50M_TOKENIZER_VOCAB = 32000


def random_checkpoint(
    name: str, corpus: Callable[[], str], tokenizer_vocab_size: int, config: Callable[[int], PreTrainedConfig]
) -> Path:
    """The checkpoint `name` in kvserve's model cache, built on first use: a byte-level BPE tokenizer of
    `tokenizer_vocab_size` trained on `corpus()` (called only then: some take seconds to make) and seeded random
    weights shaped by `config(len(tokenizer))`."""
    model_dir = cache_root() / name
    if (model_dir / "config.json").exists():
        return model_dir
    tokenizer = train_tokenizer(corpus(), tokenizer_vocab_size)
    return write_random_checkpoint(config(len(tokenizer)), tokenizer, model_dir, seed=0)


def synthetic_corpus() -> str:
    """Enough distinct pseudo-words for a 32k-token BPE vocabulary."""
    rng = random.Random(0)
    syllables = [c + v for c in string.ascii_lowercase for v in "aeiouy"] + list(string.ascii_lowercase)
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 5))) for _ in range(60000)]
    lines = [" ".join(rng.choices(words, k=16)) for _ in range(30000)]
    return "\n".join(lines)


def qwen3_50m_dir() -> Path:
    """offline_throughput.py's model: Qwen3-shaped, ~50M parameters (hidden 512, 8 layers, 8 q / 4 kv heads of 64,
    MLP 2048), a 32k BPE vocabulary, random weights."""
    return random_checkpoint(
        "bench-qwen3-50m-v1", synthetic_corpus, QWEN3_50M_TOKENIZER_VOCAB,
        lambda vocab_size: Qwen3Config(
            vocab_size=vocab_size, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
            tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"],
        ),
    )  # fmt: skip


def llama_45m_dir() -> Path:
    """vs_vllm.py's model, the issue's Llama: hidden 512, 8 layers, 8 q / 2 kv heads of 64, MLP 1536, 16k vocabulary,
    random weights."""
    return random_checkpoint(
        "bench-llama-45m-v1", synthetic_corpus, 16384,
        lambda vocab_size: LlamaConfig(
            vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
            architectures=["LlamaForCausalLM"],
        ),
    )  # fmt: skip


QWEN3_0_6B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
}
SMOKE_SHAPE = {**QWEN3_0_6B_SHAPE, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128}
SMOKE_SHAPE.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def kv_bytes_per_token(shape: dict, element_size: int) -> int:
    """The KV cache bytes one token of a model of `shape` takes (keys and values of every layer)."""
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * element_size


def qwen3_shaped_dir(shape: dict) -> Path:
    """The GPU benchmarks' Qwen3 checkpoint of `shape` (QWEN3_0_6B_SHAPE, or SMOKE_SHAPE to check a script on a CPU):
    random weights and a small trained tokenizer (the model's vocabulary is larger, as real ones often are)."""
    name = "bench-qwen3-0.6b-shaped" if shape is QWEN3_0_6B_SHAPE else "bench-qwen3-smoke"
    return random_checkpoint(
        name,
        lambda: "\n".join(f"sample text line {i} of the benchmark corpus" for i in range(200)),
        300,
        lambda _: Qwen3Config(architectures=["Qwen3ForCausalLM"], **shape),
    )
