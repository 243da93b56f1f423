"""Paged attention kernels on a GPU: decode bandwidth and prefill/extend speed against their bounds.

Decode: for each (batch, context, heads) the Triton split-KV decode kernel reads every cached key and
value once; its achieved bandwidth (bytes of K and V read / median time) is printed beside the
device-to-device copy bandwidth (bytes read + written / time) and beside PyTorch SDPA on the same
KV made contiguous (the non-paged bound; the query heads of a KV head become SDPA's query rows),
and the same kernel's time over an int8 cache (int8_speedup = 16-bit time / int8 time). Then the
design notes' layout claims: K/V interleaved vs separate, head_dim 64 padded to 128 or not.
Prefill/extend: the Triton extend kernel against causal SDPA on contiguous, head-expanded K/V.

    python -m benchmarks.gpu_kernel_bench                 # the sweep of BENCHMARKS.md (CUDA)
    python -m benchmarks.gpu_kernel_bench --smoke         # tiny shapes; runs in the interpreter on a CPU

Times are medians of `triton.testing.do_bench` (L2 flushed between runs) on CUDA.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import PAGED_BLOCK_SIZE, median_ms, paged_batch
from kvserve.kernels import AttentionMetadata, AttentionShape, PagedKV, select_backend


def time_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return median_ms(fn, repeats=3, warmup=1)


def copy_bandwidth_gbs(device: torch.device, num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_ms(lambda: dst.copy_(src)) / 1e6


def contiguous_kv(cache: torch.Tensor, metadata: AttentionMetadata, context: int) -> torch.Tensor:
    """[batch, kv_heads, context, head_dim]: each sequence's keys or values gathered in order."""
    gathered = cache[metadata.block_tables.long()]  # [batch, blocks, block_size, kv_heads, D]
    return gathered.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def bench_decode(batch, context, num_heads, num_kv_heads, head_dim, dtype, device, copy_gbs) -> dict:
    key_cache, value_cache, metadata = paged_batch(batch, context, 1, num_kv_heads, head_dim, dtype, device)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    backend = select_backend("triton", device, AttentionShape(batch, num_heads, head_dim))
    scale = head_dim**-0.5
    cache = PagedKV(key_cache, value_cache)
    triton_ms = time_ms(lambda: backend.paged_attention(query, cache, metadata, scale))
    # The int8 cache's contents do not change the time: random data and scales of the same shape.
    scale_shape = key_cache.shape[:-1]
    int8_cache = PagedKV(
        *(torch.randint(-127, 128, key_cache.shape, dtype=torch.int8, device=device) for _ in range(2)),
        *(torch.rand(scale_shape, device=device) / 127 for _ in range(2)),
    )
    int8_ms = time_ms(lambda: backend.paged_attention(query, int8_cache, metadata, scale))

    keys, values = contiguous_kv(key_cache, metadata, context), contiguous_kv(value_cache, metadata, context)
    group = num_heads // num_kv_heads
    grouped_query = query.view(batch, num_kv_heads, group, head_dim)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(grouped_query, keys, values, scale=scale))
    kv_bytes = 2 * keys.numel() * keys.element_size()
    triton_gbs = kv_bytes / triton_ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "heads": f"{num_heads}q/{num_kv_heads}kv/{head_dim}",
        "kv_mib": kv_bytes / 2**20,
        "triton_ms": triton_ms,
        "triton_gbs": triton_gbs,
        "of_copy": triton_gbs / copy_gbs,
        "sdpa_contiguous_ms": sdpa_ms,
        "sdpa_gbs": kv_bytes / sdpa_ms / 1e6,
        "int8_ms": int8_ms,
        "int8_speedup": triton_ms / int8_ms,
    }


def bench_extend(batch, context, query_len, num_heads, num_kv_heads, head_dim, dtype, device) -> dict:
    key_cache, value_cache, metadata = paged_batch(batch, context, query_len, num_kv_heads, head_dim, dtype, device)
    query = torch.randn(batch * query_len, num_heads, head_dim, dtype=dtype, device=device)
    backend = select_backend("triton", device, AttentionShape(batch, num_heads, head_dim))
    scale = head_dim**-0.5
    cache = PagedKV(key_cache, value_cache)
    triton_ms = time_ms(lambda: backend.paged_attention(query, cache, metadata, scale))

    group = num_heads // num_kv_heads
    keys = contiguous_kv(key_cache, metadata, context).repeat_interleave(group, dim=1)
    values = contiguous_kv(value_cache, metadata, context).repeat_interleave(group, dim=1)
    sdpa_query = query.view(batch, query_len, num_heads, head_dim).transpose(1, 2)
    prefix = context - query_len
    # Row r sees positions <= prefix + r: a plain causal mask when there is no prefix.
    mask = None if prefix == 0 else torch.ones(query_len, context, dtype=torch.bool, device=device).tril(prefix)
    sdpa_ms = time_ms(
        lambda: F.scaled_dot_product_attention(
            sdpa_query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    )
    # Multiply-adds of QK^T and PV over the visible (causal) pairs.
    visible_pairs = query_len * prefix + query_len * (query_len + 1) / 2
    flops = 4 * batch * num_heads * head_dim * visible_pairs
    return {
        "batch": batch,
        "context": context,
        "new_tokens": query_len,
        "heads": f"{num_heads}q/{num_kv_heads}kv/{head_dim}",
        "triton_ms": triton_ms,
        "triton_tflops": flops / triton_ms / 1e9,
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": flops / sdpa_ms / 1e9,
        "time_vs_sdpa": triton_ms / sdpa_ms,
    }


def bench_layouts(batch, context, num_heads, num_kv_heads, dtype, device, copy_gbs) -> list[dict]:
    """The design notes' claims, measured: K and V interleaved in one tensor ([..., kv_heads, 2, D]) vs
    separate, and head_dim 64 stored as is vs zero-padded to 128. Bandwidth counts the useful bytes
    (head_dim 64's K and V) for both head_dim rows, so padding only wins if it is more than 2x faster."""
    metadata = paged_batch(batch, context, 1, num_kv_heads, 64, dtype, device)[2]
    rows = []
    for layout, head_dim, stored_dim in [
        ("separate", 128, 128), ("interleaved", 128, 128), ("separate", 64, 64), ("separate", 64, 128),
    ]:  # fmt: skip
        elapsed_ms = _time_layout(metadata, layout, head_dim, stored_dim, num_heads, num_kv_heads, dtype, device)
        useful_bytes = 2 * batch * context * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        gbs = useful_bytes / elapsed_ms / 1e6
        rows.append({
            "layout": layout, "head_dim": head_dim, "stored_dim": stored_dim, "batch": batch, "context": context,
            "ms": elapsed_ms, "useful_gbs": gbs, "of_copy": gbs / copy_gbs,
        })  # fmt: skip
    return rows


def _time_layout(metadata, layout, head_dim, stored_dim, num_heads, num_kv_heads, dtype, device) -> float:
    batch = metadata.num_seqs
    shape = (metadata.block_tables.numel(), PAGED_BLOCK_SIZE, num_kv_heads)
    if layout == "interleaved":
        kv = torch.randn(*shape, 2, stored_dim, dtype=dtype, device=device)
        cache = PagedKV(kv[..., 0, :], kv[..., 1, :])
    else:
        cache = PagedKV(*(torch.randn(*shape, stored_dim, dtype=dtype, device=device) for _ in range(2)))
    query = torch.zeros(batch, num_heads, stored_dim, dtype=dtype, device=device)
    query[..., :head_dim] = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    backend = select_backend("triton", device, AttentionShape(batch, num_heads, stored_dim))
    return time_ms(lambda: backend.paged_attention(query, cache, metadata, head_dim**-0.5))


def print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script itself")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    if args.smoke:
        dtype, copy_bytes = torch.float32, 1 << 20
        decode_cases = [((8, 2, 16), batch, 40) for batch in (1, 2)]
        extend_cases = [((8, 2, 16), 1, 40, 40), ((8, 2, 16), 2, 48, 16)]
    else:
        dtype, copy_bytes = torch.bfloat16, 4 << 30
        heads, wide = (32, 8, 128), (64, 8, 128)
        # (heads, batch, context): one long sequence, mid-size batches, and large batches of short ones.
        decode_cases = [(heads, 1, 32768), (heads, 8, 8192), (heads, 32, 4096), (heads, 32, 8192), (wide, 32, 8192),
                        (heads, 128, 2048), (heads, 128, 4096)]  # fmt: skip
        # (heads, batch, context, new tokens): whole prompts, then a chunk after a cached prefix.
        extend_cases = [(heads, 1, 2048, 2048), (heads, 1, 8192, 8192), (heads, 8, 4608, 512)]

    copy_gbs = copy_bandwidth_gbs(device, copy_bytes)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}; {dtype}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written / time, {copy_bytes >> 20} MiB)\n")

    decode_rows = []
    for (num_heads, num_kv_heads, head_dim), batch, context in decode_cases:
        decode_rows.append(bench_decode(batch, context, num_heads, num_kv_heads, head_dim, dtype, device, copy_gbs))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("paged decode attention (one query token per sequence)")
    print_table(decode_rows)

    extend_rows = []
    for (num_heads, num_kv_heads, head_dim), batch, context, query_len in extend_cases:
        extend_rows.append(bench_extend(batch, context, query_len, num_heads, num_kv_heads, head_dim, dtype, device))
    print("\npaged prefill/extend attention vs causal SDPA on contiguous K/V")
    print_table(extend_rows)

    layout_batch, layout_context = (2, 40) if args.smoke else (32, 8192)
    layout_rows = bench_layouts(layout_batch, layout_context, *decode_cases[0][0][:2], dtype, device, copy_gbs)
    print("\ndecode: K/V interleaved vs separate; head_dim 64 as is vs padded to 128")
    print_table(layout_rows)

    if args.json:
        results = {"copy_gbs": copy_gbs, "decode": decode_rows, "extend": extend_rows, "layouts": layout_rows}
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
