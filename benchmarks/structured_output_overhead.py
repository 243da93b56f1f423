"""What structured outputs cost a decode step: 64 requests under a JSON schema against the same 64 unconstrained.

The model is Qwen3-shaped with random weights: hidden 512, 4 layers (8 q / 4 kv heads of 64), MLP 2048 and a 32k
byte-level BPE vocabulary trained with `train_tokenizer` on ~8 MB of the Python standard library's sources (quotes,
braces and colons make JSON tokens like a real vocabulary's). That is offline_throughput.py's 50M shape with half
its layers, so a run fits in ~5 minutes on 2 cores; the vocabulary, which is what the mask costs scale with, is
the real size. The checkpoint is cached under the kvserve cache directory.

Each run queues 64 requests (random 32-token prompts, temperature 1, `max_tokens` = steps + 1) and times every step
in which all 64 decode one token. The constrained run's schema is an array of at least 64 film objects (free
strings, bounded integers, enum arrays, numbers): no output can complete within the run, so all 64 keep decoding
and walk through many grammar states. The free run ignores EOS to keep all 64 going as well (structured outputs
refuse `ignore_eos`; without `min_tokens` it changes no sampling work). Inside constrained runs it also times
`TokenMasks.apply` (bitmask fill of the 64 rows, then the mask of the logits) and the matchers taking their sampled
tokens (`consume_token`), summed per step; that timing wraps
each matcher in a proxy while its token is processed, which adds a few µs a request (~0.2 ms a step) to the
constrained steps.

A cold run first (the schema's first 64 matchers, where a backend that builds its automata lazily pays for it inside
the steps) is reported on its own. Then runs alternate, constrained first in even rounds and last in odd ones; each
figure is the median over the steps of a run, then the median over rounds (the machine is noisy, ±25%).

    .venv/bin/python -m benchmarks.structured_output_overhead                  # 9 rounds of 48 steps
    .venv/bin/python -m benchmarks.structured_output_overhead --rounds 3 --steps 16
"""

import argparse
import json
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import Qwen3Config

from benchmarks.checkpoints import random_checkpoint
from benchmarks.harness import random_tokens
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.sampling_params import GrammarSpec

MODEL_NAME = "bench-structured-qwen3-4l-32k-v1"
VOCAB_SIZE = 32000
CORPUS_BYTES = 8_000_000
NUM_REQUESTS = 64
PROMPT_TOKENS = 32
FILM = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "thriller", "documentary"]}},
        "rating": {"type": "number"},
    },
    "required": ["title", "year", "genres", "rating"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": FILM, "minItems": NUM_REQUESTS}


def model_dir() -> Path:
    return random_checkpoint(
        MODEL_NAME, lambda: stdlib_corpus(CORPUS_BYTES), VOCAB_SIZE,
        lambda vocab_size: Qwen3Config(
            vocab_size=vocab_size, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
            tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"],
        ),
    )  # fmt: skip


def stdlib_corpus(num_bytes: int) -> str:
    """The first 64 KB of the standard library's .py files, in sorted order, up to `num_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts):
        text = path.read_bytes()[:65536].decode("utf-8", errors="ignore")
        parts.append(text)
        size += len(text)
        if size >= num_bytes:
            break
    return "\n".join(parts)


@dataclass
class Timers:
    """Seconds spent in the step's structured-output work, reset before every step."""

    apply_s: float = 0.0  # TokenMasks.apply: fill the constrained rows' bitmasks, then mask their logits
    accept_s: float = 0.0  # the matchers taking the sampled tokens (consume_token)


TIMERS = Timers()


def timed(function, timer: str):
    """`function`, adding the seconds of each call to `TIMERS.<timer>`."""

    def wrapper(*args, **kwargs):
        start_s = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            setattr(TIMERS, timer, getattr(TIMERS, timer) + time.perf_counter() - start_s)

    return wrapper


class TimedGrammar:
    """Stands in for a request's matcher while the engine processes its sampled token: every method call on it
    is timed. (Only there: the batched mask fill needs the grammar backend's own matcher objects.)"""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def __getattr__(self, name: str):
        attribute = getattr(self._matcher, name)
        return timed(attribute, "accept_s") if callable(attribute) else attribute


def instrument(llm: LLM) -> None:
    """Time `TokenMasks.apply` and the matcher calls of `LLMEngine._process_token`."""
    engine = llm.engine
    engine.core._token_masks.apply = timed(engine.core._token_masks.apply, "apply_s")
    process_token = engine._process_token

    def timed_process_token(state, token):
        row = state.sampling_row
        if row.grammar is None:
            return process_token(state, token)
        state.sampling_row = replace(row, grammar=TimedGrammar(row.grammar))
        try:
            return process_token(state, token)
        finally:
            state.sampling_row = row

    engine._process_token = timed_process_token


@dataclass
class Run:
    step_ms: list[float] = field(default_factory=list)
    apply_ms: list[float] = field(default_factory=list)
    accept_ms: list[float] = field(default_factory=list)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    """Time every step in which all requests decode one token."""
    engine, result = llm.engine, Run()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        TIMERS.apply_s = TIMERS.accept_s = 0.0
        start_s = time.perf_counter()
        step = engine.core.step()
        engine.process(step)
        step_s = time.perf_counter() - start_s
        scheduled = step.scheduled.scheduled
        if len(scheduled) == len(prompts) and all(item.num_new_tokens == 1 for item in scheduled):
            result.step_ms.append(step_s * 1e3)
            result.apply_ms.append(TIMERS.apply_s * 1e3)
            result.accept_ms.append(TIMERS.accept_s * 1e3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run")
    args = parser.parse_args()

    build_start_s = time.perf_counter()
    path = model_dir()
    llm = LLM(str(path), max_num_seqs=NUM_REQUESTS, kv_cache_memory_bytes=256 << 20)
    instrument(llm)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compile_start_s = time.perf_counter()
    llm.engine.core.grammars.compile(spec)  # cold: not cached yet
    compile_s = time.perf_counter() - compile_start_s
    backends = [f"llguidance {version('llguidance')}"]
    versions = ", ".join([f"torch {torch.__version__} ({torch.get_num_threads()} threads)", *backends])
    print(f"model and tokenizer ready in {compile_start_s - build_start_s:.1f} s; vocab {llm.engine.core.vocab_size}; "
          f"{versions}; first schema compile {compile_s * 1e3:.0f} ms")  # fmt: skip

    rng = random.Random(0)
    vocab_size = llm.engine.core.vocab_size
    # Without a grammar a random model may sample EOS; ignoring it keeps all 64 decoding (min_tokens is 0, so the
    # sampler's work is the same).
    free = SamplingParams(max_tokens=args.steps + 1, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.steps + 1, temperature=1.0, structured_output=spec)
    prompts = [random_tokens(rng, vocab_size, PROMPT_TOKENS) for _ in range(NUM_REQUESTS)]
    # The first 64 matchers of a fresh grammar: a backend that builds its automata lazily does it here, in the step.
    cold = run(llm, prompts, constrained)
    cold_ms = statistics.median(cold.step_ms)
    print(f"cold: first constrained run {cold_ms:.1f} ms/step (TokenMasks.apply {statistics.median(cold.apply_ms):.1f}"
          f" ms), slowest step {max(cold.step_ms):.0f} ms")  # fmt: skip
    run(llm, prompts, free)  # the free path's warm-up
    rounds: list[dict[str, Run]] = []
    for round_index in range(args.rounds):
        # Fresh prompts each round: no prefix cache hits, the same prefill work for both runs of the round.
        prompts = [random_tokens(rng, vocab_size, PROMPT_TOKENS) for _ in range(NUM_REQUESTS)]
        order = [("constrained", constrained), ("free", free)]
        if round_index % 2:
            order.reverse()
        results = {name: run(llm, prompts, params) for name, params in order}
        rounds.append(results)
        print(f"round {round_index}: " + ", ".join(
            f"{name} {statistics.median(result.step_ms):.1f} ms/step over {len(result.step_ms)} steps"
            for name, result in results.items()
        ))  # fmt: skip
    report(rounds, cold_ms, args)


def report(rounds: list[dict[str, Run]], cold_ms: float, args: argparse.Namespace) -> None:
    def median_of_rounds(name: str, attribute: str) -> float:
        return statistics.median(statistics.median(getattr(r[name], attribute)) for r in rounds)

    free_ms = median_of_rounds("free", "step_ms")
    constrained_ms = median_of_rounds("constrained", "step_ms")
    differences = [statistics.median(r["constrained"].step_ms) - statistics.median(r["free"].step_ms) for r in rounds]
    apply_ms = median_of_rounds("constrained", "apply_ms")
    accept_ms = median_of_rounds("constrained", "accept_ms")
    print()
    print(f"{NUM_REQUESTS} requests decoding, {args.steps} steps a run, {args.rounds} rounds (medians of rounds)")
    print()
    print("| | ms per step |")
    print("|---|---:|")
    print(f"| unconstrained step | {free_ms:.2f} |")
    print(f"| json_schema step | {constrained_ms:.2f} |")
    print(f"| difference (median of per-round differences) | {statistics.median(differences):+.2f} |")
    print(f"| ratio json_schema / unconstrained | {constrained_ms / free_ms:.3f} |")
    print(f"| `TokenMasks.apply` (fill 64 bitmask rows + mask logits) | {apply_ms:.2f} |")
    print(f"| 64 matchers taking their sampled token (`consume_token`) | {accept_ms:.2f} |")
    print(f"| apply + accept, share of the constrained step | {(apply_ms + accept_ms) / constrained_ms:.1%} |")
    print(f"| json_schema step, cold run: the fresh schema's first 64 requests (not in the rounds) | {cold_ms:.2f} |")
    print()
    print(f"    {Path(sys.executable).name} -m benchmarks.structured_output_overhead "
          f"--rounds {args.rounds} --steps {args.steps}")  # fmt: skip


if __name__ == "__main__":
    main()
