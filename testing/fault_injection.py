"""Test-only fault injection: model steps that raise or hang, to test how the server copes.

`KVSERVE_FAULT_INJECTION` is read once, when `kvserve serve` builds its engine; unset (always, outside
tests), nothing is wrapped and the step path is untouched. Values (steps counted from 0):

    raise:N      every model step from the N-th on raises `InjectedFault`
    raise:N:K    K steps from the N-th on raise, then steps run normally again
    hang:N       the N-th step blocks until `release()` (never, in a process), stalling the engine thread
"""

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvserve.engine.llm_engine import LLMEngine

ENV_VAR = "KVSERVE_FAULT_INJECTION"
logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The failure a `raise` plan makes a model step raise."""


@dataclass(frozen=True)
class FaultPlan:
    kind: Literal["raise", "hang"]
    first_step: int
    num_steps: int | None = None  # None: every step from `first_step` on

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        kind, *numbers = text.split(":")
        if kind not in ("raise", "hang") or not 1 <= len(numbers) <= 2 or not all(n.isdigit() for n in numbers):
            raise ValueError(f"{ENV_VAR}={text!r}: expected raise:N, raise:N:K or hang:N")
        num_steps = int(numbers[1]) if len(numbers) == 2 else (1 if kind == "hang" else None)
        return cls(kind, int(numbers[0]), num_steps)

    def hits(self, step: int) -> bool:
        return step >= self.first_step and (self.num_steps is None or step < self.first_step + self.num_steps)


class FaultyExecute:
    """Wraps `ModelRunner.execute`, failing or blocking the steps the plan names."""

    def __init__(self, execute: Callable, plan: FaultPlan) -> None:
        self._execute = execute
        self.plan = plan
        self._num_steps = 0
        self._released = threading.Event()

    def __call__(self, scheduler_output, *args):
        step, self._num_steps = self._num_steps, self._num_steps + 1
        if self.plan.hits(step):
            if self.plan.kind == "raise":
                # A message like a real one, naming a file, so tests can check that clients never see it.
                raise InjectedFault(f"injected step failure at step {step} ({__file__})")
            self._released.wait()
        return self._execute(scheduler_output, *args)

    def release(self) -> None:
        """Let a hung step (and any later one) run on."""
        self._released.set()


def plan_from_env(environ: dict[str, str] | None = None) -> FaultPlan | None:
    text = (os.environ if environ is None else environ).get(ENV_VAR)
    return FaultPlan.parse(text) if text else None


def inject(engine: LLMEngine, plan: FaultPlan) -> FaultyExecute:
    runner = engine.core.runner
    faulty = FaultyExecute(runner.execute, plan)
    runner.execute = faulty
    return faulty


def inject_from_env(engine: LLMEngine) -> FaultyExecute | None:
    """`kvserve serve`'s hook: wrap the engine's steps as `KVSERVE_FAULT_INJECTION` asks, if it is set."""
    plan = plan_from_env()
    if plan is None:
        return None
    logger.warning("TEST ONLY: %s=%s makes model steps fail", ENV_VAR, plan)
    return inject(engine, plan)
