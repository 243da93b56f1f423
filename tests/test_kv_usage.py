"""KV usage figures: blocks used and free, and how much of the allocated space holds live tokens."""

import torch

from kvserve.kvcache import KVCacheSpec, KVUsage


def test_usage_figures_follow_blocks_and_live_tokens():
    usage = KVUsage(num_total_blocks=10, num_used_blocks=4, num_live_tokens=50, block_size=16)
    assert (usage.num_free_blocks, usage.usage_fraction) == (6, 0.4)
    assert usage.slot_utilization == 50 / 64


def test_an_empty_cache_counts_as_fully_utilised():
    assert KVUsage(num_total_blocks=10, num_used_blocks=0, num_live_tokens=0, block_size=16).slot_utilization == 1.0


def test_the_block_count_comes_from_the_byte_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
    assert spec.bytes_per_block == 2 * 2 * 2 * 16 * 4 * 16  # K and V, layers, heads, head_dim, fp32, tokens
    assert spec.num_blocks_for_budget(10 * spec.bytes_per_block + 1) == 10
