"""vLLM's offline embeddings on texts, for benchmarks/embeddings.py: run by the vLLM CPU build's own Python (it
imports vLLM only). Warms up on a few texts, then times `LLM.embed` over all and writes inputs/s and the first
vector as JSON.

    /tmp/vllm-cpu-venv/bin/python benchmarks/vllm_embed_worker.py MODEL_DIR TEXTS.json OUT.json
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM  # the vLLM venv's

    model_dir, texts_file, out_file = sys.argv[1:4]
    with open(texts_file) as texts_in:
        texts = json.loads(texts_in.read())
    llm = LLM(model=model_dir, runner="pooling", dtype="float32", max_model_len=512, seed=0)
    llm.embed(texts[:8])
    start_s = time.perf_counter()
    outputs = llm.embed(texts)
    elapsed_s = time.perf_counter() - start_s
    result = {"inputs_per_s": len(texts) / elapsed_s, "first": outputs[0].outputs.embedding}
    with open(out_file, "w") as out:
        out.write(json.dumps(result))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which imports this module again
    main()
