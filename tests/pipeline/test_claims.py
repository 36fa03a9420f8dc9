"""Claims are checked (issue 24 item 5): a generator's claimed serving version against what
was published; repeated Hellos of one process answered once per interval, logged once, and
neither releasing its work nor restarting its weight transfer (fake generator, in-memory
transport; the coordinator's handle() fed directly, as the endpoint would)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.core.coordinator import HELLO_INTERVAL_S, MAX_WORK_TIMEOUTS
from proto import Heartbeat, Hello, Welcome, WorkItem
from tests.pipeline import FakeClock
from tests.pipeline.fakes import FakeGenerator, drive, drive_with_a_hole, make_coordinator


def _spy(c: object) -> list[tuple[str, object]]:
    sent: list[tuple[str, object]] = []
    ep = c.endpoint  # type: ignore[attr-defined]
    orig = ep.send

    def send(peer: str, rec: object) -> bool:
        sent.append((peer, rec))
        return bool(orig(peer, rec))

    ep.send = send
    return sent


def test_a_hello_flood_is_answered_once_per_interval(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    clock = FakeClock()
    c, net, _ = make_coordinator(tmp_path, [], clock=clock)
    g = FakeGenerator(net, "g", clock=clock)
    drive(c, [g], 2, hook=lambda _t: clock.advance(0.01))
    held = c.dispatcher.inflight()
    released = c.ledger.counts["released"]
    sent = _spy(c)
    hello = Hello("g", "host", 1, ["fake"], 2, g.version, 0.0)  # the same process (pid, start)
    caplog.set_level(logging.DEBUG, logger="pipeline.core.coordinator")
    caplog.clear()
    for i in range(5000):  # 5,000 Hellos over 5 s (the flood: 5,302 INFO lines)
        c.handle("control", "g", hello)
        if i % 1000 == 999:
            clock.advance(1.0)
    welcomes = [r for _, r in sent if isinstance(r, Welcome)]
    assert 1 <= len(welcomes) <= 1 + 5 / HELLO_INTERVAL_S, len(welcomes)
    assert c.intake.counts["hellos_throttled"] == 5000 - len(welcomes)
    info = [m for r in caplog.records if r.levelno >= logging.INFO
            and ("Hello" in (m := r.getMessage()) or "joined" in m)]  # fmt: skip
    assert not info, info[:3]
    # the same process keeps its work: nothing released, nothing handed out twice
    assert c.dispatcher.inflight() == held and c.ledger.counts["released"] == released
    assert not [r for _, r in sent if isinstance(r, WorkItem)]
    # a "new process" in every Hello (invented pids): its work is released at most once per
    # interval, not once per Hello (the issue: 3,624 dispatched for 1,312 accepted)
    n = len(sent)
    for i in range(1000):
        c.handle("control", "g", Hello("g", "host", 100 + i, ["fake"], 2, g.version, float(i)))
    assert len([r for _, r in sent[n:] if isinstance(r, Welcome)]) <= 1
    assert c.ledger.counts["released"] <= released + 4 * max(held, 1)


def test_a_claimed_version_never_published_is_refused(tmp_path: Path) -> None:
    c, net, _ = make_coordinator(tmp_path, [])
    g = FakeGenerator(net, "g")
    drive(c, [g], 1)
    assert c.version == 1
    # Hello claiming v500 (the issue: "joined (serving v500)", work min_weight_version=500)
    c.handle("control", "liar", Hello("liar", "h", 9, ["fake"], 2, 500, 5.0))
    assert c.dispatcher.generators()["liar"] == -1  # serves nothing we know: weights first
    assert c.publisher.generators()["liar"] == -1
    c.handle("control", "liar", Heartbeat("liar", 0.0, 500, 0))
    assert c.dispatcher.generators()["liar"] == -1
    assert c.intake.counts["claims_refused"] == 2
    sent = _spy(c)
    c.dispatcher.pump(c.version, c._send_work, c._expected_version)
    items = [r for p, r in sent if p == "liar" and isinstance(r, WorkItem)]
    assert all(it.min_weight_version <= c.version for it in items)
    # an honest claim (a published version) is believed
    c.handle("control", "g", Heartbeat("g", 0.0, 1, 0))
    assert c.dispatcher.generators()["g"] == 1


def test_a_generator_that_swallows_work_is_banned(tmp_path: Path) -> None:
    """Takes work, heartbeats, never answers: after MAX_WORK_TIMEOUTS releases of its work
    (intake.work_timeout_s each) it is banned, instead of being given work again forever."""
    c, _, t = drive_with_a_hole(tmp_path, 12)
    assert "hole" in c.banned and "work_timeout_s" in c.banned["hole"], c.banned
    assert c.dispatcher.timeouts["hole"] == MAX_WORK_TIMEOUTS
    assert "hole" not in c.dispatcher.generators()
    trained = [rid for b in t.batches for rid in b]
    assert len(trained) == len(set(trained)) == 12 * 8
