"""Rank 0's watch over its tensor-parallel steps.

When a rank hangs, every collective of a step fails within the group's timeout, and the server exits. A step that
runs past several timeouts is therefore stuck where no timeout reaches (it was seen once on a loaded CI machine,
with a stopped rank, and never reproduced). The watchdog then writes every thread's stack to the log, to show
where, and reports the step as failed, so the server still exits with status 1 in bounded time; the caller kills
the other ranks, which also fails whatever collective the step waits in.
"""

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

STUCK_AFTER_TIMEOUTS = 2  # a step this many collective timeouts long is stuck
POLL_S = 0.5


class StepWatchdog:
    """Calls `on_stuck(message)` once, from its own thread, if a step runs longer than `limit_s`."""

    def __init__(self, limit_s: float, on_stuck: Callable[[str], None]) -> None:
        self.limit_s = limit_s
        self._on_stuck = on_stuck
        self._step_started_s: float | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="kvserve-step-watchdog", daemon=True).start()

    def step_started(self) -> None:
        self._step_started_s = time.monotonic()

    def step_ended(self) -> None:
        self._step_started_s = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            started_s = self._step_started_s
            if started_s is None or time.monotonic() - started_s <= self.limit_s:
                continue
            running_s = time.monotonic() - started_s
            logger.error("a tensor-parallel step has run for %.0f s; every thread's stack follows", running_s)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._on_stuck(
                f"a tensor-parallel step failed: it ran for {running_s:.0f} s, over {self.limit_s:.0f} s "
                f"({STUCK_AFTER_TIMEOUTS} collective timeouts), stuck outside any collective's timeout"
            )
            return
