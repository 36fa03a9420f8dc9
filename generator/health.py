"""A liveness file for process supervisors (a Kubernetes livenessProbe, a watchdog script).

``HealthFile(path, last_turn)`` touches ``path`` every ``period_s`` while ``last_turn()`` (the
monotonic time the generator loop last finished a turn, ``GeneratorLoop.last_turn``) is at most
``stale_s`` old, and stops touching it when the loop stalls, so a probe of the file's age
(``find PATH -mmin -1``, or its mtime against ``date``) fails for a wedged generator and
the supervisor restarts it. The generator's ``--health-file`` starts one once the loop exists;
before that (the engine's start-up, minutes) a startup probe waits for the file to appear.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class HealthFile:
    """Touch ``path`` while the loop turns (module docstring); ``start()``, then ``stop()``."""

    def __init__(self, path: Path, last_turn: Callable[[], float], *, period_s: float = 5.0,
                 stale_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.path, self.last_turn, self.clock = Path(path), last_turn, clock
        self.period_s, self.stale_s = period_s, stale_s
        self.touches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generator-health", daemon=True)

    def start(self) -> HealthFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period_s + 1.0)

    def beat(self) -> bool:
        """Touch the file if the loop turned within stale_s; whether it did."""
        if self.clock() - self.last_turn() > self.stale_s:
            return False
        try:
            self.path.touch()
            os.utime(self.path)
        except OSError as e:  # a full or read-only disk: the probe will say so
            log.warning("health file %s: %s", self.path, e)
            return False
        self.touches += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.period_s)
