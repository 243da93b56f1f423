"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request generators, logprobs."""

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One request's row in a sampling batch."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # never sampled this step (EOS and stop ids before min_tokens)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # empty unless the request asked for logprobs


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """Pick one token per row of logits [num_rows, vocab_size] (fp32)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if any(row.params.has_penalties for row in rows):
        logits = _apply_penalties(logits, rows)
    if any(row.banned_token_ids for row in rows):
        logits = _ban_tokens(logits, rows)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        token_ids[index] = _sample_random(logits[index], [rows[i] for i in random_rows])
    return _gather_logprobs(logprobs, token_ids, rows)


def _ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    temperatures = torch.tensor([row.params.temperature for row in rows], device=logits.device)
    # Shift the top logit to 0 first: a tiny temperature then sends the others to -inf instead of
    # overflowing to inf (softmax NaN); the clamp keeps a temperature that rounds to 0 in fp32 from 0/0.
    logits = logits - logits.amax(dim=-1, keepdim=True)
    logits = logits / temperatures.clamp_min(torch.finfo(logits.dtype).tiny)[:, None]
    if any(_filters_tokens(row.params) for row in rows):
        logits = _apply_top_k_top_p_min_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each row draws its noise
    # from its own generator, so a seeded request samples the same tokens in any batch.
    noise = torch.stack(
        [torch.empty(probs.shape[1], device=probs.device).exponential_(generator=row.generator) for row in rows]
    )
    return (probs / noise.clamp_min(1e-20)).argmax(dim=-1)


def _filters_tokens(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask to -inf the tokens that top-k, then top-p, then min-p exclude (each on what the last kept)."""
    vocab_size = logits.shape[1]
    device = logits.device
    # top_k <= 0 keeps every token, and so does one beyond the vocabulary: clamped, as 2**63 would overflow int64.
    num_kept_by_top_k = [min(row.params.top_k, vocab_size) if row.params.top_k > 0 else vocab_size for row in rows]
    top_k = torch.tensor(num_kept_by_top_k, device=device)
    top_p = torch.tensor([row.params.top_p for row in rows], device=device)
    min_p = torch.tensor([row.params.min_p for row in rows], device=device)

    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)[None, :]
    excluded_by_top_k = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(excluded_by_top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    excluded = excluded_by_top_k | (mass_before >= top_p[:, None])
    excluded[:, 0] = False
    sorted_probs = torch.softmax(sorted_logits.masked_fill(excluded, float("-inf")), dim=-1)
    excluded |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    excluded_by_token = torch.zeros_like(excluded).scatter_(1, sorted_index, excluded)
    return logits.masked_fill(excluded_by_token, float("-inf"))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence and frequency over output tokens."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    output_counts = torch.zeros(num_rows, vocab_size, device=device)
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if row.output_token_ids:
            output_ids = torch.tensor(row.output_token_ids, device=device)
            output_counts[i].index_add_(0, output_ids, torch.ones(len(output_ids), device=device))
        seen[i, torch.tensor(row.prompt_token_ids, dtype=torch.long, device=device)] = True
    seen |= output_counts > 0

    repetition = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[:, None]
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[:, None]
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0).float()


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    sampled_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    max_top = max((row.params.logprobs or 0 for row in rows), default=0)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    result = []
    for i, (row, token_id) in enumerate(zip(rows, token_ids.tolist(), strict=True)):
        num_top = row.params.logprobs or 0
        top = []
        if num_top:
            top = list(zip(top_ids[i, :num_top].tolist(), top_values[i, :num_top].tolist(), strict=True))
        result.append(SampledToken(token_id=token_id, logprob=sampled_logprobs[i], top_logprobs=top))
    return result
