"""Makes the GGUF test files (tests/data/gguf/) with llama.cpp's own tools, never a writer of kvserve's: tiny HF
checkpoints (seeded random weights, the offline-trained tokenizer) converted by llama.cpp's `convert_hf_to_gguf.py`
and quantized by its `llama-quantize`, as a user's files are made.

    bash ../shared/peers/llama-cpp.sh /tmp/llama-cpp          # builds the tools (about 10 minutes, once)
    python -P -m kvserve.testing.gguf_fixtures /tmp/llama-cpp tests/data/gguf

The K-quants' blocks hold 256 values, so every row here is 256 wide (llama-quantize would otherwise fall back to
other types); two layers of GQA attention and an MLP are enough for every tensor a decoder has.
"""

import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

_SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CONFIGS = {
    # q/k/v biases, untied head
    "qwen2": lambda vocab: Qwen2Config(
        vocab_size=vocab, rope_parameters=ROPE, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"], **_SHAPES
    ),
    # the converter reorders q/k rows for llama.cpp's rope: the loader puts them back
    "llama": lambda vocab: LlamaConfig(
        vocab_size=vocab, rope_parameters=ROPE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **_SHAPES
    ),
    # q/k norms, tied embeddings (the quantized embedding is also the LM head); heads of 128 as Qwen3's are, wider
    # than hidden / heads (transformers reads no head size from a qwen3 GGUF file and assumes 128)
    "qwen3": lambda vocab: Qwen3Config(
        vocab_size=vocab,
        rope_parameters=ROPE,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        **{**_SHAPES, "head_dim": 128},
    ),
}
# Every tensor type kvserve computes on, one per kind of tensor, over a q8_0 base (norms stay F32).
MIXED_TYPES = {
    "attn_q": "f16",
    "attn_k": "bf16",
    "attn_v": "q4_0",
    "attn_output": "q5_0",
    "ffn_gate": "q4_k",
    "ffn_up": "q6_k",
}
# (checkpoint, file name, llama-quantize type, extra llama-quantize arguments)
FIXTURES = [
    ("qwen2", "qwen2-q8_0.gguf", "Q8_0", []),
    ("qwen2", "qwen2-q4_k_m.gguf", "Q4_K_M", []),
    (
        "qwen2",
        "qwen2-mixed.gguf",
        "Q8_0",
        [
            *(part for name, kind in MIXED_TYPES.items() for part in ("--tensor-type", f"{name}={kind}")),
            "--token-embedding-type",
            "q4_0",
            "--output-tensor-type",
            "bf16",
        ],
    ),
    ("llama", "llama-q4_k_m.gguf", "Q4_K_M", []),
    ("qwen3", "qwen3-q8_0.gguf", "Q8_0", []),
]


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter on an HF checkpoint (tokenizers trained here are pre-tokenized as GPT-2's)."""
    environment = {**os.environ, "LLAMA_CPP_FORCE_PRE": "gpt-2"}
    command = [str(llama_cpp / "venv/bin/python"), str(llama_cpp / "convert/convert_hf_to_gguf.py"), str(hf_dir)]
    subprocess.run([*command, "--outtype", outtype, "--outfile", str(out)], check=True, env=environment)
    return out


def quantize(llama_cpp: Path, source: Path, out: Path, kind: str, arguments: list[str]) -> Path:
    subprocess.run([str(llama_cpp / "build/bin/llama-quantize"), *arguments, str(source), str(out), kind], check=True)
    return out


def main(llama_cpp: Path, out_dir: Path) -> None:
    corpus = resources.files("kvserve.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(corpus, vocab_size=512)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        converted = {}
        for name, make_config in CONFIGS.items():
            # The converter's transformers loads the tokenizer as the family's class, and Qwen2Tokenizer adds a
            # token of its own (id 512): spare rows for it.
            config = make_config(len(tokenizer) + 8)
            hf_dir = write_random_checkpoint(config, tokenizer, Path(scratch) / name, seed=11)
            converted[name] = convert(llama_cpp, hf_dir, Path(scratch) / f"{name}-f32.gguf")
        for checkpoint, file_name, kind, arguments in FIXTURES:
            quantize(llama_cpp, converted[checkpoint], out_dir / file_name, kind, arguments)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
