"""Start-up's phases: each one that can take more than a second (loading weights, building the C++ kernels, sizing
the KV cache, compiling the Triton kernels, capturing CUDA graphs) is logged when it begins and when it ends, with
its time, so a slow or stuck start says what it is doing. `StartupProgress.current` names the phase under way: the
server's /health reads it from another thread (a plain attribute: replacing a str is atomic in CPython)."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

READY = "ready"


class StartupProgress:
    def __init__(self, label: str = "") -> None:
        self.current = "starting"
        self._started_s = time.monotonic()
        self._label = f"{label}: " if label else ""  # a tensor-parallel rank's, so its lines tell whose they are

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current = name
        logger.info("%sstart-up: %s ...", self._label, name)
        start_s = time.monotonic()
        try:
            yield
        except BaseException:
            logger.error("%sstart-up: %s failed after %.1f s", self._label, name, time.monotonic() - start_s)
            raise
        logger.info("%sstart-up: %s done in %.1f s", self._label, name, time.monotonic() - start_s)

    def finish(self) -> None:
        self.current = READY
        logger.info("%sstart-up: ready in %.1f s", self._label, time.monotonic() - self._started_s)
