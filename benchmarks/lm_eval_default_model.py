"""lm-evaluation-harness on the built-in default model through `kvserve serve`: the true next verse of a held-out
KJV chapter among four (tests/data/lm_eval/kjv_next_verse.yaml, written by benchmarks/train_default_model.py).

    .venv/bin/python -m benchmarks.lm_eval_default_model [--limit N] [--json out.json]

Starts `kvserve serve` with no model on a loopback port, scores the task with lm-eval's `local-completions` model
(token-id prompts, as published evals send them), and prints acc, acc_norm and acc_mutual_info with a 95% interval
beside chance (25%: a model that ignores the context gets exactly one document of each group of four right).
"""

import argparse
import json
import math
import subprocess
import tempfile
from pathlib import Path

from benchmarks.processes import child_cwd
from benchmarks.servers import free_port, kvserve_serve_command, serving
from kvserve.engine.default_model import DEFAULT_MODEL_NAME, default_model_dir
from tests.lm_eval_tasks import evaluate, local_completions

TASK, TASK_FILE = "kvserve_kjv_next_verse", "kjv_next_verse.yaml"
METRICS = ("acc", "acc_norm", "acc_mutual_info")
CHANCE = 0.25


def score(base_url: str, limit: int | None) -> dict:
    lm = local_completions(base_url, DEFAULT_MODEL_NAME, default_model_dir(), num_concurrent=4)
    with tempfile.TemporaryDirectory() as task_dir:
        results = evaluate(lm, {TASK: TASK_FILE}, Path(task_dir), limit=limit)
    return results["results"][TASK] | {"documents": results["n-samples"][TASK]["effective"]}


def wilson_interval(share: float, count: int, z: float = 1.96) -> tuple[float, float]:
    """95% score interval of a binomial share: sound near 0 and 1 and for a few hundred documents."""
    centre = (share + z * z / (2 * count)) / (1 + z * z / count)
    half = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count)) / (1 + z * z / count)
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="score the first N documents (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(kvserve_serve_command(None, port), cwd=child_cwd())
    base_url = f"http://127.0.0.1:{port}"
    with serving(server, base_url):
        scores = score(base_url, args.limit)
    count = scores["documents"]
    figures = {"task": TASK, "model": DEFAULT_MODEL_NAME, "documents": count, "chance": CHANCE}
    print(f"{TASK} on {DEFAULT_MODEL_NAME}: {count} documents, chance {CHANCE:.0%}")
    for metric in METRICS:
        share = scores[f"{metric},none"]
        low, high = wilson_interval(share, count)
        figures[metric] = {"share": share, "interval_95": [low, high]}
        print(f"  {metric:16s} {share:6.1%}  (95% interval {low:.1%}-{high:.1%})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
