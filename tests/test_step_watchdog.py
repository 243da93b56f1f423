"""The tensor-parallel step watchdog (engine/parallel/watchdog.py): it reports a step that goes past its limit
without a collective finishing, once, and says nothing of steps whose collectives keep finishing, however long,
nor of an idle engine."""

import threading
import time

from kvserve.engine.parallel.group import CollectiveProgress
from kvserve.engine.parallel.watchdog import POLL_S, StepWatchdog

LIMIT_S = 0.2


def _watchdog() -> tuple[StepWatchdog, CollectiveProgress, list[str], threading.Event]:
    progress = CollectiveProgress()
    reports: list[str] = []
    reported = threading.Event()

    def on_stuck(message: str) -> None:
        reports.append(message)
        reported.set()

    return StepWatchdog(LIMIT_S, progress, on_stuck), progress, reports, reported


def test_a_step_past_the_limit_without_a_collective_is_reported_once():
    watchdog, _, reports, reported = _watchdog()
    watchdog.step_started()
    assert reported.wait(LIMIT_S + 4 * POLL_S)
    time.sleep(3 * POLL_S)  # still running: no second report
    watchdog.close()
    assert len(reports) == 1 and reports[0].startswith("a tensor-parallel step failed: no collective finished for")


def test_short_steps_long_steps_whose_collectives_finish_and_idle_time_are_not_reported():
    watchdog, progress, reports, _ = _watchdog()
    deadline = time.monotonic() + LIMIT_S + 3 * POLL_S
    while time.monotonic() < deadline:  # many short steps, together longer than the limit
        watchdog.step_started()
        time.sleep(LIMIT_S / 4)
        watchdog.step_ended()
    watchdog.step_started()  # one step several limits long, its collectives finishing now and then
    deadline = time.monotonic() + LIMIT_S + 3 * POLL_S
    while time.monotonic() < deadline:
        time.sleep(LIMIT_S / 4)
        progress.mark()
    watchdog.step_ended()
    time.sleep(LIMIT_S + 2 * POLL_S)  # idle
    watchdog.close()
    assert reports == []
