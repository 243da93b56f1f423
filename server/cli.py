"""The `kvserve` command line.

`kvserve generate` runs an offline generation on a checkpoint (the built-in default model when
none is given) and prints each completion and the throughput.
"""

import argparse
import logging
import sys
import time

from engine import LLM, InvalidRequestError, SamplingParams

DEMO_PROMPTS = [
    "Once upon a time there was a small town by a river.",
    "The cache is cut into blocks of sixteen tokens.",
    "What is a token?",
    "def add(a, b):",
]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small continuous-batching LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate offline from prompts and print text and tokens/s")
    generate.add_argument("model", nargs="?", default=None, help="HF checkpoint directory (default: built-in model)")
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few demo prompts)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0, help="engine seed: requests draw their generators from it")
    generate.add_argument("--device", default="auto")
    generate.add_argument("--dtype", default="auto")
    generate.add_argument("--max-num-seqs", type=int, default=64)
    generate.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    return parser.parse_args(argv)


def _generate(args: argparse.Namespace) -> int:
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        seed=args.seed,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = args.prompt or DEMO_PROMPTS
    start_s = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed_s = time.perf_counter() - start_s
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"--- prompt: {prompt!r}\n{output.text!r}  [{len(output.token_ids)} tokens, {output.finish_reason}]")
    num_tokens = sum(len(output.token_ids) for output in outputs)
    print(f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed_s:.2f} s: {num_tokens / elapsed_s:.1f} tokens/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
