"""Kill points for the crash tests: ``LOOPRL_KILL_AT=<point>:<step>`` makes the learner kill
itself with SIGKILL (a real kill -9: no handler, no flush, no atexit) at one exact place.

Points (N: the training step's number, 1-based; for ``announce`` the version's):

- ``step``: the trainer finished step N (optimizer state changed in memory), nothing of it
  is logged, settled or published yet (a kill in the middle of a step).
- ``announce``: version N's weights are written and its digests.jsonl line too, but no
  generator has heard of it (between writing weights and announcing them).
- ``checkpoint``: the checkpoint of step N is being written (its ``.tmp-step_*`` directory
  has files, its metadata is not there yet): a kill in the middle of a checkpoint.

Unset (the default) every call here is one dictionary lookup. Used by
tests/pipeline/test_resume_kill.py; nothing else sets the variable.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

ENV = "LOOPRL_KILL_AT"


def _armed(point: str, n: int) -> bool:
    return os.environ.get(ENV, "") == f"{point}:{n}"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(point: str, n: int) -> None:
    """SIGKILL this process now if ``LOOPRL_KILL_AT`` names ``point:n``."""
    if _armed(point, n):
        die()


def kill_while_writing(point: str, n: int, tmp_dir: Path, final: Path) -> None:
    """If armed: a thread kills this process as soon as a file exists under ``tmp_dir`` (the
    checkpoint being written), or once ``final`` exists (the write was quicker than the
    watch: the test sees the complete checkpoint and fails)."""
    if not _armed(point, n):
        return

    def watch() -> None:
        while not final.exists():
            if tmp_dir.is_dir() and any(p.is_file() for p in tmp_dir.rglob("*")):
                break
            time.sleep(0.001)
        die()

    threading.Thread(target=watch, daemon=True, name="kill-at").start()
