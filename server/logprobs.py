"""vLLM's `prompt_logprobs` response extra, shared by completions and chat."""

from kvserve.engine import TokenLogprob
from kvserve.server.protocol import PromptLogprob


def vllm_prompt_logprobs(
    num_top: int | None, entries: list[TokenLogprob | None] | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """Per prompt token (None for the first), its logprob and its `num_top` likeliest alternatives, keyed by
    token id like vLLM's; ranks count from 1 for the likeliest token."""
    if num_top is None or entries is None:
        return None
    return [None if entry is None else _entry(entry, num_top) for entry in entries]


def _entry(entry: TokenLogprob, num_top: int) -> dict[str, PromptLogprob]:
    ranked = {token_id: rank for rank, (token_id, _) in enumerate(entry.top_logprobs, start=1)}
    alternatives = zip(entry.top_logprobs[:num_top], entry.top_tokens[:num_top], strict=True)
    result = {
        str(token_id): PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
        for rank, ((token_id, logprob), text) in enumerate(alternatives, start=1)
    }
    result[str(entry.token_id)] = PromptLogprob(
        logprob=entry.logprob, rank=ranked.get(entry.token_id), decoded_token=entry.token
    )
    return result
