"""The tensor-parallel step watchdog (engine/parallel/watchdog.py): it reports a step that runs past its limit,
once, and says nothing of steps that end in time or of an idle engine."""

import threading
import time

from kvserve.engine.parallel.watchdog import POLL_S, StepWatchdog

LIMIT_S = 0.2


def _watchdog() -> tuple[StepWatchdog, list[str], threading.Event]:
    reports: list[str] = []
    reported = threading.Event()

    def on_stuck(message: str) -> None:
        reports.append(message)
        reported.set()

    return StepWatchdog(LIMIT_S, on_stuck), reports, reported


def test_a_step_past_the_limit_is_reported_once_with_how_long_it_ran():
    watchdog, reports, reported = _watchdog()
    watchdog.step_started()
    assert reported.wait(LIMIT_S + 4 * POLL_S)
    time.sleep(3 * POLL_S)  # still running: no second report
    watchdog.close()
    assert len(reports) == 1 and reports[0].startswith("a tensor-parallel step failed: it ran for")


def test_steps_that_end_in_time_and_idle_time_are_not_reported():
    watchdog, reports, _ = _watchdog()
    deadline = time.monotonic() + LIMIT_S + 3 * POLL_S
    while time.monotonic() < deadline:  # many short steps, together longer than the limit
        watchdog.step_started()
        time.sleep(LIMIT_S / 4)
        watchdog.step_ended()
    time.sleep(LIMIT_S + 2 * POLL_S)  # idle
    watchdog.close()
    assert reports == []
