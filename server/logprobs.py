"""vLLM's `prompt_logprobs` response extra, shared by completions and chat."""

from kvserve.engine import TokenLogprob
from kvserve.server.context import ServerContext
from kvserve.server.protocol import PromptLogprob


def vllm_prompt_logprobs(
    ctx: ServerContext, num_top: int | None, entries: list[TokenLogprob | None] | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """Per prompt token (None for the first), its logprob and its `num_top` likeliest alternatives, keyed by
    token id like vLLM's; ranks count from 1 for the likeliest token."""
    if num_top is None or entries is None:
        return None
    return [None if entry is None else _entry(ctx, entry, num_top) for entry in entries]


def _entry(ctx: ServerContext, entry: TokenLogprob, num_top: int) -> dict[str, PromptLogprob]:
    ranked = {token_id: rank for rank, (token_id, _) in enumerate(entry.top_logprobs, start=1)}
    result = {
        str(token_id): PromptLogprob(logprob=logprob, rank=rank, decoded_token=ctx.token_text(token_id))
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs[:num_top], start=1)
    }
    result[str(entry.token_id)] = PromptLogprob(
        logprob=entry.logprob, rank=ranked.get(entry.token_id), decoded_token=ctx.token_text(entry.token_id)
    )
    return result
