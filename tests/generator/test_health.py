"""generator.health.HealthFile: the liveness file is touched while the loop turns and goes
stale when it stalls (what deploy/k8s/generator.yaml's livenessProbe checks)."""

from __future__ import annotations

import time
from pathlib import Path

from generator.health import HealthFile


def test_touched_while_the_loop_turns_and_stale_once_it_stalls(tmp_path: Path) -> None:
    path = tmp_path / "run" / "alive"
    turn = [time.monotonic()]
    h = HealthFile(path, lambda: turn[0], period_s=0.02, stale_s=0.2).start()
    try:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # the loop turns
            turn[0] = time.monotonic()
            time.sleep(0.01)
        assert path.is_file() and h.touches >= 5
        time.sleep(0.4)  # the loop stalls past stale_s: no more touches
        touched, mtime = h.touches, path.stat().st_mtime
        time.sleep(0.2)
        assert h.touches == touched and path.stat().st_mtime == mtime
        turn[0] = time.monotonic()  # it turns again: touched again
        time.sleep(0.1)
        assert h.touches > touched
    finally:
        h.stop()
    assert not h._thread.is_alive()


def test_a_stalled_loop_never_creates_the_file(tmp_path: Path) -> None:
    now = [100.0]
    h = HealthFile(tmp_path / "alive", lambda: 50.0, stale_s=30.0, clock=lambda: now[0])
    assert not h.beat() and not (tmp_path / "alive").exists()
    now[0] = 79.0
    assert h.beat() and (tmp_path / "alive").is_file()
