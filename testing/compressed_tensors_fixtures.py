"""Makes the compressed-tensors test checkpoints (tests/data/compressed_tensors/) with llm-compressor, the tool that
writes them for users, never a writer of kvserve's: tiny HF checkpoints (seeded random weights, the offline-trained
tokenizer) quantized by its `oneshot` with data-free schemes (round to nearest) and saved compressed.

llm-compressor pins its own transformers, so it runs in a virtual environment of its own:

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 gguf
    /tmp/llmc/bin/pip install --no-deps -e .
    /tmp/llmc/bin/python -P -m kvserve.testing.compressed_tensors_fixtures tests/data/compressed_tensors

Rows are 128 or 256 wide, so groups of 32 divide them (and each half of them, for two tensor-parallel ranks).
"""

import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

_SHAPES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": True,
}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CONFIGS = {
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, rope_parameters=ROPE, architectures=["Qwen2ForCausalLM"],
                                       **_SHAPES),
    "llama": lambda vocab: LlamaConfig(vocab_size=vocab, rope_parameters=ROPE, architectures=["LlamaForCausalLM"],
                                       **_SHAPES),
    "qwen3": lambda vocab: Qwen3Config(vocab_size=vocab, rope_parameters=ROPE, architectures=["Qwen3ForCausalLM"],
                                       **_SHAPES),
}  # fmt: skip


def _int4_groups(symmetric: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 32}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


_FP8_PER_TENSOR = {
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
        }
    }
}
# (fixture, checkpoint, dtype, QuantizationModifier arguments beyond targets="Linear")
FIXTURES = [
    # llm-compressor's W8A16 preset: int8, groups of 128, packed four to an int32
    ("qwen2-w8a16", "qwen2", torch.float32, {"scheme": "W8A16"}),
    # int4 in groups of 32, symmetric; a bfloat16 checkpoint, so bfloat16 scales
    ("qwen2-w4a16-bf16", "qwen2", torch.bfloat16, _int4_groups(symmetric=True)),
    # int4 in groups of 32 with zero points (packed along the rows)
    ("llama-w4a16-asym", "llama", torch.float32, _int4_groups(symmetric=False)),
    # float8 weights per channel, inputs quantized to float8 per token
    ("qwen3-fp8-dynamic", "qwen3", torch.float32, {"scheme": "FP8_DYNAMIC"}),
    # float8 weights with one scale a tensor (q, k and v each their own), inputs as they are
    ("qwen2-fp8-tensor", "qwen2", torch.float32, _FP8_PER_TENSOR),
    # int8 weights per channel, inputs quantized to int8 per token; layer 1's MLP left unquantized
    ("qwen2-w8a8", "qwen2", torch.float32, {"scheme": "W8A8", "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]}),
]


def main(out_dir: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    corpus = resources.files("kvserve.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(corpus, vocab_size=512)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        bases = {
            name: write_random_checkpoint(make_config(len(tokenizer)), tokenizer, Path(scratch) / name, seed=11)
            for name, make_config in CONFIGS.items()
        }
        for fixture, checkpoint, dtype, arguments in FIXTURES:
            model = AutoModelForCausalLM.from_pretrained(bases[checkpoint], dtype=dtype)
            arguments = {"ignore": ["lm_head"], **arguments}
            oneshot(model=model, recipe=QuantizationModifier(targets="Linear", **arguments))
            model.save_pretrained(out_dir / fixture, save_compressed=True)
            tokenizer.save_pretrained(out_dir / fixture)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
