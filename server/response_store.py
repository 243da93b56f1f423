"""The Responses API's stored responses (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id}): kept in
memory, at most `max_entries` (the oldest dropped first) and each for `ttl_s` after it was stored."""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # as POST returned it
    # The turns this response's input and output add up to, as chat messages, without its `instructions` (a
    # response that continues it gives its own): what `previous_response_id` continues.
    conversation: list[dict]
    expires_at_s: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._drop_expired()
        if self.max_entries == 0:
            return
        self._responses[response["id"]] = StoredResponse(response, conversation, self._clock() + self.ttl_s)
        while len(self._responses) > self.max_entries:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._drop_expired()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._drop_expired()
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._responses)

    def _drop_expired(self) -> None:
        # Stored in order, all with the same lifetime: the expired ones are at the front.
        now = self._clock()
        while self._responses and next(iter(self._responses.values())).expires_at_s <= now:
            self._responses.popitem(last=False)
