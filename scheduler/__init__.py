"""Continuous-batching scheduler: request state, admission, preemption, per-step output."""

from scheduler.config import SchedulerConfig
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.scheduler_output import ScheduledRequest, SchedulerOutput

__all__ = [
    "FinishReason",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
