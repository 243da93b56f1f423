"""Continuous-batching scheduler: request state, admission, preemption, per-step output."""

from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.scheduler_output import LoraRequestCounts, ScheduledRequest, SchedulerOutput, SchedulerStats

__all__ = [
    "FinishReason",
    "LoraRequestCounts",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
