"""Prompt logprobs (`prompt_logprobs`): which of a step's token rows score a prompt token, and their results.

The logits at position p score prompt token p + 1, so a request's prompt is scored as its chunks are computed (a
request that wants them never reuses a cached prefix: a cached block has no logits). A preempted request computes
its prompt again; positions already scored are skipped. The first prompt token has no logprob (None).
"""

import torch

from kvserve.engine.outputs import TokenLogprob
from kvserve.engine.sampler import prompt_logprobs
from kvserve.scheduler import Request, SchedulerOutput


class PromptScoring:
    def __init__(self) -> None:
        self._scored: dict[str, list[TokenLogprob | None]] = {}  # requests still scoring, and what they have
        self._num_top: dict[str, int] = {}

    def add(self, request: Request, num_top: int) -> None:
        self._scored[request.request_id] = [None]
        self._num_top[request.request_id] = num_top

    def discard(self, request_id: str) -> None:
        self._scored.pop(request_id, None)
        self._num_top.pop(request_id, None)

    def rows(self, output: SchedulerOutput) -> tuple[list[int], list[tuple[str, int]]]:
        """The step's token rows whose logits score a prompt token still without a logprob, and for each its
        request and that token."""
        rows, targets = [], []
        if not self._scored:
            return rows, targets
        first_row = 0
        for item in output.scheduled:
            scored = self._scored.get(item.request.request_id)
            if scored is not None:
                prompt = item.request.prompt_token_ids
                first = max(item.start_position, len(scored) - 1)
                end = min(item.start_position + item.num_new_tokens, len(prompt) - 1)
                for position in range(first, end):
                    rows.append(first_row + position - item.start_position)
                    targets.append((item.request.request_id, prompt[position + 1]))
            first_row += item.num_new_tokens
        return rows, targets

    def record(self, logits: torch.Tensor, targets: list[tuple[str, int]]) -> None:
        num_top = [self._num_top[request_id] for request_id, _ in targets]
        entries = prompt_logprobs(logits, [token_id for _, token_id in targets], num_top)
        for (request_id, _), entry in zip(targets, entries, strict=True):
            self._scored[request_id].append(entry)

    def take_complete(self, request: Request) -> list[TokenLogprob | None] | None:
        """The request's prompt logprobs once all are computed (then forgotten here), else None."""
        scored = self._scored.get(request.request_id)
        if scored is None or len(scored) < len(request.prompt_token_ids):
            return None
        self.discard(request.request_id)
        return scored
