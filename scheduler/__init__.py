"""Continuous-batching scheduler: request state, admission, preemption, per-step output."""

from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.request_queue import SCHEDULING_POLICIES, SchedulingPolicy, priority_order
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.scheduler_output import (
    LoraRequestCounts,
    PriorityRequestCounts,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)

__all__ = [
    "SCHEDULING_POLICIES",
    "FinishReason",
    "LoraRequestCounts",
    "PriorityRequestCounts",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "priority_order",
]
