"""What the benchmarks feed and time: random token workloads, paged KV batches for the kernel benchmarks, and a
median timer. (The checkpoints they build are in checkpoints.py, which imports far more: the engine, transformers.)"""

import random
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.kernels import AttentionMetadata

FIRST_PLAIN_TOKEN_ID = 4  # train_tokenizer puts its 4 special tokens (BOS, EOS, <|im_start|>, <|im_end|>) first
PAGED_BLOCK_SIZE = 16

# ---- workloads ----


def random_tokens(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    """`length` token ids drawn uniformly from the plain (not special) ids below `vocab_size`."""
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(length)]


def random_workload(
    num_requests: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> tuple[list[list[int]], list[int]]:
    """Random-token prompts with lengths uniform in `prompt_range`, then their output lengths, uniform in
    `output_range`: all the prompts are drawn first (random_requests draws them in turn)."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, vocab_size, rng.randint(*prompt_range)) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return prompts, output_lens


def random_requests(
    num_requests: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[dict]:
    """Requests as JSON-ready dicts ({"prompt_token_ids", "max_tokens"}), each one's prompt and then its output
    length drawn in turn: from the same seed, not the workload random_workload draws."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": random_tokens(rng, vocab_size, rng.randint(*prompt_range)),
         "max_tokens": rng.randint(*output_range)}
        for _ in range(num_requests)
    ]  # fmt: skip


# ---- kernel inputs ----


def paged_batch(batch: int, context: int, query_len: int, num_kv_heads: int, head_dim: int, dtype, device):
    """Random caches holding `batch` sequences of `context` positions in shuffled blocks, and the metadata of
    `query_len` new tokens in each."""
    blocks_per_seq = -(-context // PAGED_BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, PAGED_BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * query_len
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch * query_len, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=block_tables,
        query_lens_cpu=[query_len] * batch,
        seq_lens_cpu=[context] * batch,
    )
    return key_cache, value_cache, metadata


# ---- timing ----


def median_ms(fn: Callable, *args, repeats: int, warmup: int) -> float:
    """Median wall milliseconds of `repeats` calls of fn(*args), after `warmup` calls that are not timed."""
    for _ in range(warmup):
        fn(*args)
    timings = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn(*args)
        timings.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(timings)
