"""When the coordinator sends work and starts steps: new work is issued against
the trainer's version (announced + being written), so none is generated only to be too stale on
arrival; and what a completed step frees is acted on at once, not after the next poll wait."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.fakes import FakeGenerator, make_coordinator
from tests.pipeline.test_publishing import SlowPublisher, _run


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_no_work_is_issued_that_would_be_stale_on_arrival(
    tmp_path: Path, max_staleness: int
) -> None:
    """A 0.4 s write of each version beside 0.1 s steps (publish.max_pending 1): while version
    T is being written the trainer is at T already; work issued then against the announced
    T - 1 could only be trained at T - 1 + max_staleness. Every item goes out at a version
    >= T - max_staleness, and no group is generated again for staleness (before this change:
    1,204 groups at max_staleness 0 and 12 at 1 in 8 steps of this harness)."""
    sent: list[tuple[int, int]] = []  # (trainer's version, min_weight_version) per item

    def watch(c: Any) -> None:
        send = c._send_work

        def recorded(gid: str, item: Any) -> bool:
            sent.append((c.trained_version, item.min_weight_version))
            return bool(send(gid, item))

        c._send_work = recorded

    c, _t, rows = _run(tmp_path, [f"staleness.max_staleness={max_staleness}"], 8, setup=watch)
    try:
        assert len(rows) >= 8 and sent
        assert all(mv >= tv - max_staleness for tv, mv in sent), sent
        assert c.intake.counts["groups_regenerated_stale"] == 0, dict(c.intake.counts)
        assert c.gate.counts["stale_dropped"] == 0, dict(c.gate.counts)
    finally:
        c.close()


def test_a_completed_step_is_followed_without_a_poll_wait(tmp_path: Path) -> None:
    """poll_s 0.5 s and the next step's groups already buffered (max_staleness 2): the next step
    starts within 0.25 s of the last one's end (it waited a whole poll_s before)."""
    t = SlowPublisher(finish_s=0.0, step_s=0.02)
    c, net, _ = make_coordinator(
        tmp_path, ["staleness.max_staleness=2", "publish.max_pending=0"], trainer=t
    )
    c.poll_s = 0.5
    g = FakeGenerator(net, "g0", max_inflight=8)
    deadline = time.monotonic() + 60
    try:
        while c.step < 6:
            assert time.monotonic() < deadline, f"only {c.step} of 6 steps in 60 s"
            c.turn()
            g.step()
        spans = {(k, n): ts for k, n, ts in t.events}
        gaps = [spans[("step_start", v + 1)] - spans[("step_end", v)] for v in range(1, 6)]
        assert max(gaps) < 0.25, gaps
    finally:
        c.close()
