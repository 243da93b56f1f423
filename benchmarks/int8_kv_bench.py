"""INT8 KV cache: capacity at a fixed budget, error against the full-precision cache, CPU speed.

1. Capacity: the blocks the engine allocates from one byte budget with a bf16 and an int8 cache, and
   the most requests it then runs at once on the same workload (no preemption counted as success).
2. Error: a small Llama (head_dim 128) trained here for a few minutes on the license texts Debian
   ships in /usr/share/common-licenses, so its activations are not noise. On held-out licenses the
   engine's model is run teacher-forced one decode step at a time (every step reads all earlier
   keys and values from the paged cache), once over an fp32 cache and once over an int8 cache:
   max and mean absolute logit error, top-1 agreement over every step, and perplexity of each.
3. Speed on the CPU: the torch decode path over fp32, bf16 and int8 caches (median of 20).

    .venv/bin/python -m benchmarks.int8_kv_bench                  # BENCHMARKS.md's run (about 5 minutes on 2 cores)
    .venv/bin/python -m benchmarks.int8_kv_bench --quick          # fewer training steps, a smoke run
    .venv/bin/python -m benchmarks.int8_kv_bench --default-model  # 2. on the built-in model and its held-out text
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from benchmarks.harness import median_ms
from benchmarks.processes import REPO
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import cache_root, default_model_dir
from kvserve.engine.step_plan import StepPlan
from kvserve.kernels import AttentionMetadata, PagedKV, paged_attention, quantize_per_token_head
from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

LICENSES = Path("/usr/share/common-licenses")
HELD_OUT = ("Apache-2.0", "MPL-2.0")
MODEL_NAME = "bench-license-llama-v1"
DEFAULT_MODEL_HELD_OUT = REPO / "tests/data/default_model/held_out_chapters.txt"


def license_texts() -> tuple[str, str]:
    """(training text, held-out text): each license file once (several names are links to one file)."""
    files = {path.resolve() for path in LICENSES.iterdir() if path.is_file()}
    held_out = {(LICENSES / name).resolve() for name in HELD_OUT}
    read = lambda paths: "\n".join(p.read_text(errors="replace") for p in sorted(paths))  # noqa: E731
    return read(files - held_out), read(held_out)


def trained_model_dir(num_steps: int) -> Path:
    """Train (once; cached by step count) a 4-layer Llama with 2 query heads and 1 KV head of 128 dims."""
    model_dir = cache_root() / f"{MODEL_NAME}-{num_steps}"
    if (model_dir / "config.json").exists():
        return model_dir
    train_text, _ = license_texts()
    tokenizer = train_tokenizer(train_text, 2048)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    write_random_checkpoint(config, tokenizer, model_dir, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor(tokenizer(train_text)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=num_steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    seq_len, batch_size = 128, 8
    start_s = time.perf_counter()
    for step in range(num_steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == num_steps - 1:
            print(f"  step {step}: loss {loss.item():.3f} ({time.perf_counter() - start_s:.0f} s)", flush=True)
    model.save_pretrained(model_dir)
    return model_dir


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, sequences: list[list[int]], prompt_len: int) -> torch.Tensor:
    """Logits [num_seqs, len - prompt_len, vocab]: the prompt is prefilled, then each later token is fed
    as one decode step of all sequences, reading every earlier position from the paged cache. Runs the
    engine's worker on plans of its own, sequence i in block-table row i, blocks i * n ... (i + 1) * n - 1."""
    worker = llm.engine.core.runner.worker
    num_seqs, length = len(sequences), len(sequences[0])
    blocks_per_seq = -(-length // worker.kv_cache.spec.block_size)
    entries = np.array([(row, column, row * blocks_per_seq + column)
                        for row in range(num_seqs) for column in range(blocks_per_seq)]).T  # fmt: skip
    tokens = np.array(sequences)

    def run(first: int, count: int, table_entries: np.ndarray) -> torch.Tensor:
        plan = StepPlan(
            input_ids=tokens[:, first : first + count].reshape(-1), query_lens=np.full(num_seqs, count),
            seq_lens=np.full(num_seqs, first + count), rows=np.arange(num_seqs),
            logit_rows=np.arange(num_seqs * count), table_entries=table_entries, sequence_lens=None,
        )  # fmt: skip
        return worker.execute(plan)

    logits = [run(0, prompt_len, entries)[prompt_len - 1 :: prompt_len]]
    logits += [run(position, 1, entries[:, :0]) for position in range(prompt_len, length - 1)]
    return torch.stack(logits, dim=1)  # step t predicts token prompt_len + t


def error_report(
    model_dir: Path, held_out: str, num_seqs: int, length: int, prompt_len: int, dtype: str = "float32"
) -> None:
    """int8 against the model's own dtype for the cache (`dtype`: the model's, float32 or bfloat16)."""
    ids = AutoTokenizer.from_pretrained(model_dir)(held_out)["input_ids"]
    stride = (len(ids) - length) // num_seqs
    sequences = [ids[i * stride : i * stride + length] for i in range(num_seqs)]
    logits = {}
    for kind in ("auto", "int8"):  # "auto": the model's dtype
        with LLM(str(model_dir), dtype=dtype, kv_cache_dtype=kind, kv_cache_memory_bytes=64 << 20) as llm:
            logits[kind] = teacher_forced_logits(llm, sequences, prompt_len).float()
    exact, approx = logits["auto"], logits["int8"]
    targets = torch.tensor(sequences)[:, prompt_len:]
    nll = {
        kind: -torch.log_softmax(value, -1).gather(-1, targets.unsqueeze(-1)).mean().item()
        for kind, value in logits.items()
    }
    error = (approx - exact).abs()
    agreement = (approx.argmax(-1) == exact.argmax(-1)).float()
    print(
        f"\nerror ({dtype} model), {num_seqs} held-out sequences x {exact.shape[1]} teacher-forced decode steps"
        f" = {agreement.numel()} steps"
    )
    print(
        f"  logit error int8 vs {dtype} cache: max {error.max():.4f}, mean {error.mean():.5f}"
        f" (logit std {exact.std():.2f})"
    )
    print(f"  top-1 agreement: {agreement.mean() * 100:.2f}% ({int(agreement.sum())}/{agreement.numel()})")
    print(f"  perplexity: {dtype} cache {math.exp(nll['auto']):.3f}, int8 cache {math.exp(nll['int8']):.3f}")


def capacity_report(model_dir: Path, budget_bytes: int, num_requests: int) -> None:
    print(f"\ncapacity at a KV budget of {budget_bytes / 2**20:.0f} MiB (bf16 model; requests of 192 + 64 tokens)")
    prompts = [[10 + (i * 7 + j) % 1900 for j in range(192)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rows = {}
    for kind in ("auto", "int8"):
        llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype=kind, kv_cache_memory_bytes=budget_bytes,
                  max_num_seqs=num_requests, watermark_fraction=0.0)  # fmt: skip
        engine = llm.engine
        for prompt in prompts:
            engine.add_request(prompt, params)
        most_running = 0
        while engine.has_unfinished():
            engine.step()
            most_running = max(most_running, len(engine.core.scheduler.running))
        core = engine.core
        spec = core.kv_cache.spec
        rows[kind] = (core.kv_cache.num_tokens, most_running, core.scheduler.num_preemptions, spec.bytes_per_token)
        name = "bf16" if kind == "auto" else "int8"
        print(f"  {name:5} cache: {spec.bytes_per_token} bytes a token, {rows[kind][0]} tokens, "
              f"at most {most_running} requests running, {rows[kind][2]} preemptions")  # fmt: skip
    print(
        f"  int8 / bf16: tokens {rows['int8'][0] / rows['auto'][0]:.3f}x,"
        f" concurrent requests {rows['int8'][1] / rows['auto'][1]:.2f}x"
    )
    for head_dim in (64, 128):
        ratio = (2 * head_dim) / (head_dim + 4)
        print(
            f"  (per token and head, head_dim {head_dim}: bf16 {2 * head_dim} bytes,"
            f" int8 {head_dim} + 4 scale = {ratio:.3f}x)"
        )


def cpu_speed_report(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    block_size = 16
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    (key_data, key_scale), (value_data, value_scale) = quantize_per_token_head(keys), quantize_per_token_head(values)
    caches = {
        "fp32": PagedKV(keys, values),
        "bf16": PagedKV(keys.bfloat16(), values.bfloat16()),
        "int8": PagedKV(key_data, value_data, key_scale, value_scale),
    }
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=torch.randperm(num_blocks, generator=generator).to(torch.int32).view(batch, blocks_per_seq),
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    print(
        f"\nCPU decode attention (torch path), batch {batch} x context {context},"
        f" {num_heads}q/{num_kv_heads}kv/{head_dim}:"
    )
    timings = {}
    for name, cache in caches.items():
        query = torch.randn(batch, num_heads, head_dim, generator=generator).to(
            cache.key.dtype if name == "bf16" else torch.float32
        )
        timings[name] = median_ms(paged_attention, query, cache, metadata, head_dim**-0.5, repeats=20, warmup=0)
        print(f"  {name} cache: median {timings[name]:.2f} ms ({timings['fp32'] / timings[name]:.2f}x fp32's speed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few training steps and sequences: a smoke run")
    parser.add_argument(
        "--default-model", action="store_true", help="only the error, of the built-in model on its held-out text"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.default_model:
        held_out = DEFAULT_MODEL_HELD_OUT.read_text()
        for dtype in ("float32", "bfloat16"):
            error_report(default_model_dir(), held_out, num_seqs=8, length=192, prompt_len=16, dtype=dtype)
        return
    if not LICENSES.is_dir():
        sys.exit(f"{LICENSES} is missing: this benchmark trains on the license texts Debian ships there")
    print(f"torch threads {torch.get_num_threads()}")
    model_dir = trained_model_dir(num_steps=20 if args.quick else 200)
    capacity_report(model_dir, budget_bytes=(4 if args.quick else 16) << 20, num_requests=16 if args.quick else 128)
    held_out = license_texts()[1]
    error_report(model_dir, held_out, num_seqs=2 if args.quick else 8, length=64 if args.quick else 160, prompt_len=16)
    cpu_speed_report(batch=8, context=2048, num_heads=16, num_kv_heads=8, head_dim=128)


if __name__ == "__main__":
    main()
