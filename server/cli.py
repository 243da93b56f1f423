"""The `kvserve` command line.

`kvserve serve [MODEL]` runs the OpenAI-compatible server; `kvserve generate [MODEL]` runs an
offline generation and prints each completion and the throughput. Without MODEL both use the
built-in default model (a toy trained on the KJV). `kvserve bench` load-tests a running server (any
OpenAI-compatible one); it imports neither the engine nor torch, so it starts at once.
"""

import argparse
import dataclasses
import logging
import sys
import time
import types
import typing

from kvserve.server.bench import cli as bench_cli

DEMO_PROMPTS = [
    "Once upon a time there was a small town by a river.",
    "The cache is cut into blocks of sixteen tokens.",
    "What is a token?",
    "def add(a, b):",
]


def model_errors() -> tuple[type[Exception], ...]:
    """A checkpoint kvserve cannot load (or split over the ranks asked for): one line on stderr and exit status 2,
    as for bad settings, not a traceback."""
    from kvserve.engine.compressed_tensors_checkpoint import CompressedTensorsError
    from kvserve.engine.gguf_checkpoint import GgufError
    from kvserve.engine.model_loader import CheckpointError
    from kvserve.engine.models import UnsupportedModelError
    from kvserve.engine.parallel.sharding import TensorParallelError
    from kvserve.engine.pooling import PoolingConfigError

    return (CheckpointError, CompressedTensorsError, GgufError, UnsupportedModelError, TensorParallelError,
            PoolingConfigError)  # fmt: skip


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerSettings field (--max-num-seqs for max_num_seqs); unset flags override nothing."""
    from kvserve.server.settings import ServerSettings  # imports the engine (torch): only for `serve`

    for name, field in ServerSettings.model_fields.items():
        if name == "model":
            continue
        annotation = field.annotation
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:  # X | None
            annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
        flag = "--" + name.replace("_", "-")
        if typing.get_origin(annotation) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(annotation), default=None, help=field.description)
        elif typing.get_origin(annotation) in (list, tuple):
            parser.add_argument(flag, nargs="+", default=None, help=field.description)
        elif annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        elif dataclasses.is_dataclass(annotation):  # a settings group, as JSON (or YAML) text; the settings parse it
            parser.add_argument(flag, default=None, help=f"{annotation.__name__} as JSON, e.g. '{{\"key\": value}}'")
        else:
            parser.add_argument(
                flag, type=annotation, default=None, help=field.description or f"default {field.default}"
            )


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small continuous-batching LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "model", nargs="?", default=None, help="HF checkpoint directory or GGUF file (default: built-in model)"
    )
    serve.add_argument("--config", default=None, help="YAML settings file (flags and KVSERVE_* env override it)")
    if argv[:1] == ["serve"]:  # its flags come from the engine's settings: other commands need not import torch
        _add_settings_flags(serve)

    generate = commands.add_parser("generate", help="generate offline from prompts and print text and tokens/s")
    generate.add_argument(
        "model", nargs="?", default=None, help="HF checkpoint directory or GGUF file (default: built-in model)"
    )
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few demo prompts)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0, help="engine seed: requests draw their generators from it")
    generate.add_argument("--device", default="auto")
    generate.add_argument("--dtype", default="auto")
    generate.add_argument("--max-num-seqs", type=int, default=64)
    generate.add_argument("--kv-cache-memory-bytes", type=int, default=None)

    bench_cli.add_parser(commands)
    return parser.parse_args(argv)


def _serve(args: argparse.Namespace) -> int:
    from kvserve.server.serve import serve  # imports uvicorn and FastAPI only when serving
    from kvserve.server.settings import ServerSettings, SettingsError, load_settings

    overrides = {name: getattr(args, name) for name in ServerSettings.model_fields if hasattr(args, name)}
    try:
        settings = load_settings(args.config, overrides)
    except (SettingsError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        return serve(settings)
    except model_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine import LLM, InvalidRequestError, SamplingParams

    try:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            seed=args.seed,
        )
    except model_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    commands = {"serve": _serve, "generate": _generate, "bench": bench_cli.run}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
