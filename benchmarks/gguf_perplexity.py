"""Held-out perplexity of the built-in default model in each GGUF type, beside its own bfloat16 checkpoint.

    .venv/bin/python -m benchmarks.gguf_perplexity --llama-cpp /tmp/llama-cpp [--types Q8_0,Q6_K,Q5_0,Q4_K_M,Q4_0]

llama.cpp's converter writes the checkpoint as a BF16 GGUF (its weights exactly) and llama-quantize makes each type
from it; kvserve scores the held-out KJV chapters (tests/data/default_model/held_out_chapters.txt, the first 512
tokens of each, as the default model's test does) on each, through prompt logprobs. The model's rows are 256 and
640 wide: down_proj's 640 is not a multiple of the K-quants' 256, so in Q4_K_M and Q6_K files llama-quantize writes
it as Q5_0 / Q8_0.
"""

import argparse
import math
import tempfile
from pathlib import Path

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import default_model_dir
from kvserve.engine.gguf_checkpoint import GgufFile
from kvserve.engine.tokenizer import load_tokenizer
from kvserve.testing.gguf_fixtures import convert, quantize

HELD_OUT = Path(__file__).parent.parent / "tests/data/default_model/held_out_chapters.txt"


def held_out_prompts() -> list[list[int]]:
    """The chapters' first 512 tokens by the checkpoint's own tokenizer (the same ids for every type)."""
    tokenizer = load_tokenizer(default_model_dir())
    return [tokenizer.encode(chapter)[:512] for chapter in HELD_OUT.read_text().splitlines()]


def perplexity(model: str, prompts: list[list[int]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the prompts' tokens after the first, and how many."""
    with LLM(model) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    logprobs = [entry.logprob for output in outputs for entry in output.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama-cpp"))
    parser.add_argument("--types", default="Q8_0,Q6_K,Q5_0,Q4_K_M,Q4_0")
    args = parser.parse_args()
    prompts = held_out_prompts()
    reference, tokens = perplexity(str(default_model_dir()), prompts)
    print(f"{'checkpoint':12}{'perplexity':>12}{'vs bf16':>10}{'weight MiB':>12}   tensor types")
    print(f"{'bf16 (HF)':12}{reference:12.3f}{1:10.4f}{'':>12}   ({tokens} tokens scored)")
    with tempfile.TemporaryDirectory() as scratch:
        bf16 = convert(args.llama_cpp, default_model_dir(), Path(scratch) / "default-bf16.gguf", outtype="bf16")
        files = {"BF16": bf16} | {
            kind: quantize(args.llama_cpp, bf16, Path(scratch) / f"default-{kind.lower()}.gguf", kind, [])
            for kind in args.types.split(",")
        }
        for kind, path in files.items():
            value, _ = perplexity(str(path), prompts)
            file = GgufFile(path)
            types = ", ".join(f"{count} {name}" for name, count in sorted(file.type_counts().items()))
            print(f"{kind:12}{value:12.3f}{value / reference:10.4f}{file.tensor_bytes() / 2**20:12.2f}   {types}")


if __name__ == "__main__":
    main()
