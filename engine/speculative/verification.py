"""Which draft tokens a verifying step accepts."""


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
