"""Rank 0's watch over its tensor-parallel steps.

When a rank hangs, every collective of a step fails within the group's timeout, and the server exits. A step in which
no collective has finished for several timeouts is therefore stuck where no timeout reaches (it was seen once on a
loaded CI machine, with a stopped rank, and never reproduced). The watchdog then writes every thread's stack to the
log, to show where, and reports the step as failed, so the server still exits with status 1 in bounded time; the
caller kills the other ranks, which also fails whatever collective the step waits in. A long step (a large prompt
chunk on a CPU) is not stuck: its collectives keep finishing.
"""

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable

from kvserve.engine.parallel.group import CollectiveProgress

logger = logging.getLogger(__name__)

STUCK_AFTER_TIMEOUTS = 2  # a step with no collective finished for this many collective timeouts is stuck
POLL_S = 0.5


class StepWatchdog:
    """Calls `on_stuck(message)` once, from its own thread, if a step goes `limit_s` without `progress`."""

    def __init__(self, limit_s: float, progress: CollectiveProgress, on_stuck: Callable[[str], None]) -> None:
        self.limit_s = limit_s
        self._progress = progress
        self._on_stuck = on_stuck
        self._in_step = False
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="kvserve-step-watchdog", daemon=True).start()

    def step_started(self) -> None:
        self._progress.mark()
        self._in_step = True

    def step_ended(self) -> None:
        self._in_step = False

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            stalled_s = time.monotonic() - self._progress.last_s
            if not self._in_step or stalled_s <= self.limit_s:
                continue
            logger.error("a tensor-parallel step has gone %.0f s without a collective; every thread's stack follows",
                         stalled_s)  # fmt: skip
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._on_stuck(
                f"a tensor-parallel step failed: no collective finished for {stalled_s:.0f} s, over {self.limit_s:.0f} "
                f"s ({STUCK_AFTER_TIMEOUTS} collective timeouts), stuck outside any collective's timeout"
            )
            return
