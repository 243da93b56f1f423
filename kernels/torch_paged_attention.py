"""Torch paged attention: the reference for the C++ and Triton kernels, and the engine's path where
neither runs. The CPU backend uses its prompt-chunk half (`extend_attention`).

Each request gathers exactly its `seq_len` cached positions from its blocks, so padding and
unused slots (whatever they hold, NaN included) never enter the arithmetic. Measured on the CPU,
this per-request loop beat one padded batched gather by 5-8x at decode (BENCHMARKS.md); the C++
decode kernel, one call for all requests, is faster still.

An int8 cache holds each token's K and V per head as int8 times an fp32 scale (absmax / 127). The
decode path folds the K scales into the scores and the V scales into the probabilities; the
prefill/extend path dequantizes the gathered context and hands it to SDPA.

Gemma's options: a sliding window W (a query at position i sees keys at positions i - W + 1 ... i:
only the blocks holding those are gathered) and soft-capping of the scores (cap * tanh(scores / cap),
after the scale and before the mask and softmax, as HF computes it; SDPA cannot, so those rows take
the explicit path).
"""

import itertools

import torch
import torch.nn.functional as F

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.paged_kv import INT8_MAX, PagedKV


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> int8 data and fp32 scales [...]: scale = absmax / 127, data = x / scale
    rounded to nearest (halves away from zero); an all-zero vector gets scale 0 and zeros."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # Divided by a tensor, not the number: on CUDA torch turns division by a Python scalar into multiplication by
    # its reciprocal, an ulp away from the quotient the kernels compute, and codes near .5 then round apart.
    scale = amax / amax.new_full((), INT8_MAX)
    scaled = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return rounded.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots (all >= 0: unlike the
    kernels', which skip negative slots, this path has no way to skip one without reading the mapping)."""
    for new, data, scale in ((key, cache.key, cache.key_scale), (value, cache.value, cache.value_scale)):
        if cache.quantized:
            new, new_scale = quantize_per_token_head(new)
            scale.view(-1, cache.num_kv_heads).index_copy_(0, slot_mapping, new_scale)
        data.view(-1, *data.shape[2:]).index_copy_(0, slot_mapping, new.to(data.dtype))


def paged_attention(
    query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of query [num_tokens, num_heads, head_dim] over each request's paged context."""
    output = torch.empty_like(query)
    for i in range(metadata.num_decodes):
        first = first_visible_position(metadata.seq_lens_cpu[i], 1, sliding_window)
        keys, values, key_scale, value_scale = _context(cache, metadata, i, first)
        output[i : i + 1] = _decode_one(query[i : i + 1], keys, values, key_scale, value_scale, scale, logit_softcap)
    extend_attention(query, cache, metadata, scale, output, metadata.num_decodes, sliding_window, logit_softcap)
    return output


def first_visible_position(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first position any of a request's last `query_len` positions attends to."""
    return 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)


def extend_attention(
    query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float, out: torch.Tensor, first_seq: int,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> None:  # fmt: skip
    """Write the attention rows of requests `first_seq`, ... (prompts and prompt chunks) into `out`."""
    starts = list(itertools.accumulate(metadata.query_lens_cpu, initial=0))
    for i in range(first_seq, metadata.num_seqs):
        query_len = metadata.query_lens_cpu[i]
        first = first_visible_position(metadata.seq_lens_cpu[i], query_len, sliding_window)
        keys, values, key_scale, value_scale = _context(cache, metadata, i, first)
        if cache.quantized:
            keys = (keys.float() * key_scale.unsqueeze(-1)).to(query.dtype)
            values = (values.float() * value_scale.unsqueeze(-1)).to(query.dtype)
        rows = slice(starts[i], starts[i + 1])
        if sliding_window is None and logit_softcap is None:
            out[rows] = _extend_one(query[rows], keys, values, scale)
        else:
            out[rows] = _extend_masked(query[rows], keys, values, scale, first, sliding_window, logit_softcap)


def _context(cache: PagedKV, metadata: AttentionMetadata, seq: int, first: int = 0):
    """Keys, values [seq_len - first, kv_heads, head_dim] of request `seq` from position `first` on, and their
    scales (None unless int8); blocks wholly before `first` are not read."""
    seq_len = metadata.seq_lens_cpu[seq]
    first_block = first // cache.block_size
    block_ids = metadata.block_tables[seq, first_block : -(-seq_len // cache.block_size)]
    offset, length = first - first_block * cache.block_size, seq_len - first
    keys, values = _gather(cache.key, block_ids, offset, length), _gather(cache.value, block_ids, offset, length)
    if not cache.quantized:
        return keys, values, None, None
    scales = (_gather(scale, block_ids, offset, length) for scale in (cache.key_scale, cache.value_scale))
    return keys, values, *scales


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """`length` positions from `offset` on in a sequence's blocks: [length, ...] of a [num_blocks, block_size, ...]
    cache."""
    return cache.index_select(0, block_ids).flatten(0, 1)[offset : offset + length]


def _decode_one(query, keys, values, key_scale, value_scale, scale: float, logit_softcap: float | None = None):
    """One query token [1, heads, D] against keys/values [L, kv_heads, D]; query heads grouped per KV head."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = keys.shape[1]
    grouped = query.view(num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = torch.bmm(grouped, keys.float().permute(1, 2, 0)) * scale  # [kv_heads, group, L]
    if key_scale is not None:
        scores = scores * key_scale.t().unsqueeze(1)
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    probs = scores.softmax(dim=-1)
    if value_scale is not None:
        probs = probs * value_scale.t().unsqueeze(1)
    out = torch.bmm(probs, values.float().transpose(0, 1))  # [kv_heads, group, D]
    return out.reshape(1, num_heads, head_dim).to(query.dtype)


def _extend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Query rows [Q, heads, D] at the last Q positions of keys/values [L, kv_heads, D], causally.

    Laid out as [1, heads, tokens, D] with the KV heads repeated for each query head, so CPU SDPA runs
    its flash kernel (3-4x its fallback for GQA or 3-d inputs at 512 tokens, BENCHMARKS.md).
    """
    query_len, seq_len = query.shape[0], keys.shape[0]
    context_len = seq_len - query_len
    group = query.shape[1] // keys.shape[1]
    q = query.transpose(0, 1)[None]
    k, v = (x.transpose(0, 1).repeat_interleave(group, dim=0)[None] for x in (keys, values))
    if context_len == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query row r sits at position context_len + r and sees keys at positions <= its own.
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(context_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def _extend_masked(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int,
    sliding_window: int | None, logit_softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """`_extend_one` with a sliding window and soft-capped scores, written out: keys/values start at position
    `first`, query rows are the last Q positions."""
    query_len, num_keys = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    key_positions = first + torch.arange(num_keys, device=query.device)
    query_positions = (first + num_keys - query_len + torch.arange(query_len, device=query.device))[:, None]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= query_positions - key_positions < sliding_window
    q = query.transpose(0, 1).float()  # [heads, Q, D]
    k, v = (x.transpose(0, 1).repeat_interleave(group, dim=0).float() for x in (keys, values))
    scores = q @ k.transpose(1, 2) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(0, 1).to(query.dtype)
