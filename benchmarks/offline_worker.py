"""One offline run of kvserve's or vLLM's `LLM.generate` over a workload, in a process of its own.

Neither engine inherits the other's threads, caches or memory: `run_offline` starts this module with the engine's
Python (vLLM's in its venv) and reads back the tokens and the timing it writes as JSON.

Only the standard library (and processes.py, which uses nothing else) is imported at the top: vLLM's venv, where
kvserve is not installed, runs this module too.
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.processes import TreeRSS, child_cwd, child_env

KV_CACHE_GIB = 2
MAX_MODEL_LEN = 1024  # vLLM's --max-model-len


def kvserve_generate(model_dir: str, max_num_seqs: int, dtype: str):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=KV_CACHE_GIB << 30)

    def generate(workload: list[dict]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
        return [output.token_ids for output in llm.generate([r["prompt_token_ids"] for r in workload], params)]

    return generate


def vllm_generate(model_dir: str, max_num_seqs: int, dtype: str):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, seed=0)

    def generate(workload: list[dict]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
        return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def offline_worker(
    engine: str, model_dir: str, workload_file: str, max_num_seqs: int, out_file: str, dtype: str
) -> None:
    """Build one engine, run the workload once, write the tokens, when the engine was ready and the time taken."""
    workload = json.loads(Path(workload_file).read_text())
    generate = (kvserve_generate if engine == "kvserve" else vllm_generate)(model_dir, max_num_seqs, dtype)
    start_s = time.time()
    token_ids = generate(workload)
    end_s = time.time()
    Path(out_file).write_text(json.dumps({"ready_s": start_s, "elapsed_s": end_s - start_s, "token_ids": token_ids}))


def engine_env(engine: str) -> dict[str, str]:
    """A child's environment for `engine` (kvserve or vllm): vLLM's CPU KV cache gets kvserve's budget unless the
    environment already sizes it."""
    env = child_env()
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    return env


def run_offline(
    engine: str, python: str, model_dir: Path, workload_file: Path, max_num_seqs: int, dtype: str = "float32"
) -> dict:
    """One offline run of `engine` by `python` in a fresh process: its tok/s, start-up time, peak RSS of the process
    tree and outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        command = [python, "-m", __spec__.name, "--engine", engine, "--model-dir", str(model_dir), "--workload",
                   str(workload_file), "--max-num-seqs", str(max_num_seqs), "--out", str(out_file), "--dtype",
                   dtype]  # fmt: skip
        spawn_s = time.time()
        process = subprocess.Popen(
            command, env=engine_env(engine), cwd=child_cwd(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        rss = TreeRSS(process.pid)
        _, stderr = process.communicate()
        peak_rss = rss.stop()
        if process.returncode != 0:
            raise RuntimeError(f"{engine} offline run failed ({process.returncode}):\n{stderr.decode()[-3000:]}")
        result = json.loads(out_file.read_text())
    num_tokens = sum(map(len, result["token_ids"]))
    return {"tok_s": num_tokens / result["elapsed_s"], "elapsed_s": result["elapsed_s"], "num_tokens": num_tokens,
            "startup_s": result["ready_s"] - spawn_s, "peak_rss_mib": peak_rss / 2**20,
            "outputs": result["token_ids"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("kvserve", "vllm"), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", required=True, help="a JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    offline_worker(args.engine, args.model_dir, args.workload, args.max_num_seqs, args.out, args.dtype)


if __name__ == "__main__":
    main()
