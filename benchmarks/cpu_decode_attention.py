"""CPU decode attention: the C++ kernel (all requests in one call) vs the torch path's per-request
loop vs per-request SDPA vs one padded batched gather.

The C++ kernel reads each request's blocks in place, with no gather. Of the torch variants, the
per-request loop wins: gathering every request's blocks into one padded [batch, max_len] tensor and
running one SDPA moves far more bytes (padding, plus the masking that keeps stale slots out) than
gathering each request's exact context. All run here on the same cache and block tables; the script
prints the median time per layer call and the ratio to the C++ kernel.

    .venv/bin/python -m benchmarks.cpu_decode_attention
"""

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

from benchmarks.harness import median_ms
from kvserve.kernels import AttentionMetadata, PagedKV, paged_attention
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels

BATCH, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 8, 4, 64, 16


def cpp_decode(query, key_cache, value_cache, metadata, scale):
    return CpuBackend().paged_attention(query, PagedKV(key_cache, value_cache), metadata, scale)


def torch_path_decode(query, key_cache, value_cache, metadata, scale):
    return paged_attention(query, PagedKV(key_cache, value_cache), metadata, scale)


def padded_batched_decode(query, key_cache, value_cache, metadata, scale):
    """The alternative: one gather padded to the longest context, masked, one SDPA call."""
    max_len = metadata.max_seq_len
    block_tables = metadata.block_tables[:, : -(-max_len // BLOCK_SIZE)]
    keys = key_cache[block_tables].flatten(1, 2)[:, :max_len]
    values = value_cache[block_tables].flatten(1, 2)[:, :max_len]
    valid = torch.arange(max_len)[None, :] < metadata.seq_lens[:, None]
    keys = keys.masked_fill(~valid[:, :, None, None], 0.0)
    values = values.masked_fill(~valid[:, :, None, None], 0.0)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.squeeze(2)


def per_request_sdpa_decode(query, key_cache, value_cache, metadata, scale):
    """Like kvserve's path, but one SDPA call per request instead of grouped-query bmm."""
    output = torch.empty_like(query)
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        block_ids = metadata.block_tables[i, : -(-seq_len // BLOCK_SIZE)]
        keys = key_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len].transpose(0, 1)
        values = value_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len].transpose(0, 1)
        output[i] = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), keys, values, scale=scale, enable_gqa=True
        ).squeeze(1)
    return output


def make_batch(seed: int = 0):
    rng = random.Random(seed)
    seq_lens = [rng.randint(48, 1024) for _ in range(BATCH)]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens)
    permutation = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, first = [], 0
    for n in seq_lens:
        tables.append(permutation[first : first + -(-n // BLOCK_SIZE)])
        first += len(tables[-1])
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(BATCH, dtype=torch.long),
        query_start_loc=torch.arange(BATCH + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=[1] * BATCH,
        seq_lens_cpu=seq_lens,
    )
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(BATCH, NUM_HEADS, HEAD_DIM), key_cache, value_cache, metadata


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options but --help
    if not load_cpu_kernels():
        raise SystemExit("the C++ CPU kernels could not be built (see the log)")
    query, key_cache, value_cache, metadata = make_batch()
    scale = HEAD_DIM**-0.5
    peers = {
        "C++ kernel, one call for the batch": cpp_decode,
        "torch path: per-request gather + bmm": torch_path_decode,
        "per-request gather + SDPA": per_request_sdpa_decode,
        "padded batched gather + masked SDPA": padded_batched_decode,
    }
    reference = torch_path_decode(query, key_cache, value_cache, metadata, scale)
    print(
        f"{BATCH} decoding requests, context 48-1024 (mean {statistics.mean(metadata.seq_lens_cpu):.0f}), "
        f"{NUM_HEADS} q / {NUM_KV_HEADS} kv heads x {HEAD_DIM}, torch threads {torch.get_num_threads()}"
    )
    timings = {}
    for name, attend in peers.items():
        assert torch.allclose(attend(query, key_cache, value_cache, metadata, scale), reference, atol=1e-5)
        timings[name] = median_ms(attend, query, key_cache, value_cache, metadata, scale, repeats=15, warmup=1)
    ours_ms = timings["C++ kernel, one call for the batch"]
    for name, ms in timings.items():
        print(f"{name:40} {ms:8.2f} ms per layer call (median), {ms / ours_ms:5.1f}x the C++ kernel's time")


if __name__ == "__main__":
    main()
