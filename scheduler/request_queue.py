"""The waiting queue, in the order admission takes from it: first come first served, or by priority.

`fcfs` keeps arrival order, and a request put back (preempted, or passed over for a LoRA slot) goes to the front.
`priority` keeps the queue sorted by `priority_order`, as vLLM's priority scheduler does: the lowest priority value
first, earlier arrivals first among equals; a request put back takes its place by the same key, so a preempted
request still goes ahead of later arrivals of its priority.
"""

from bisect import insort
from collections import deque
from collections.abc import Iterator
from typing import Literal

from kvserve.scheduler.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_order(request: Request) -> tuple[int, int]:
    """Sort key of the priority policy: smaller runs first (and is preempted last)."""
    return request.priority, request.arrival_index


class FcfsQueue:
    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def put_back(self, request: Request) -> None:
        self._requests.appendleft(request)

    def put_back_all(self, requests: list[Request]) -> None:
        """Put requests back at the front, keeping their order."""
        self._requests.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityQueue:
    """A list kept sorted by `priority_order`. The queue holds at most hundreds of requests (the server's
    max_queued_requests), so an insert's shift is cheap, and the head and the order need no heap to keep."""

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        insort(self._requests, request, key=priority_order)

    put_back = add

    def put_back_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


WaitingQueue = FcfsQueue | PriorityQueue


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
