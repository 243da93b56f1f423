"""Which draft tokens a verifying step accepts, and the grammars its rows are masked with."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance


def num_accepted_drafts(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many leading drafts are accepted: `sampled_token_ids[i]` is the token sampled (as without drafts: greedy
    or not) from the row after the last token and drafts[:i], and drafts are accepted while each equals the token
    sampled before it. The sampled token after the last accepted draft is the step's own next token.

    Greedy, the output is token for token decoding's without drafts. Sampled, it is the speculative sampling rule
    for a draft that is certain (q(draft) = 1, as a prompt-lookup draft is): a draft is accepted with probability
    p(draft) = min(1, p / q), and when it is not, the token sampled instead follows p less the draft, renormalised
    (the residual), so every token follows the target's distribution."""
    num_accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids, strict=False):
        if draft != sampled:
            break
        num_accepted += 1
    return num_accepted


def grammars_after_drafts(grammar: "llguidance.LLMatcher", drafts: list[int]) -> list["llguidance.LLMatcher"]:
    """For each draft, a copy of the request's grammar matcher that has consumed the drafts up to it: the row after
    a draft is masked as decoding would mask it had the drafts been output. Drafts come here already checked (text
    proposals cut at the first token the grammar refuses, a draft model's proposed under the grammar); were one
    refused all the same, the copies past it stay where the grammar last accepted, so that every row still allows
    some token (the row before the refused draft cannot sample it: verification stops there)."""
    num_valid = grammar.validate_tokens(drafts)
    copies = []
    for ahead in range(1, len(drafts) + 1):
        copy = grammar.deep_copy()
        copy.consume_tokens(drafts[: min(ahead, num_valid)])
        copies.append(copy)
    return copies
