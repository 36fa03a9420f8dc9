"""Claims are checked: a generator's claimed serving version against what
was published; repeated Hellos of one process answered once per interval, logged once, and
neither releasing its work nor restarting its weight transfer (fake generator, in-memory
transport; the coordinator's handle() fed directly, as the endpoint would)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.core.peers import HELLO_INTERVAL_S, MAX_WORK_TIMEOUTS
from proto.records import Heartbeat, Hello, Welcome, WorkItem
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
    for i in range(5000):  # 5,000 Hellos over 5 s (a flood once seen: 5,302 INFO lines)
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
    # interval, not once per Hello (once seen: 3,624 dispatched for 1,312 accepted)
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
    c.publisher.pump()  # v1 announced to g
    # Hello claiming v500 (once seen: "joined (serving v500)", work min_weight_version=500)
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
    # an honest claim (a version published and announced to g) is believed
    assert c.deliveries.delivered("g", 1)
    c.handle("control", "g", Heartbeat("g", 0.0, 1, 0))
    assert c.dispatcher.generators()["g"] == 1


def test_a_generator_that_swallows_work_gets_no_more(tmp_path: Path) -> None:
    """Takes work, heartbeats, never answers: after one intake.work_timeout_s its work goes to
    the other generator and it gets no new work while that one can take it (so it delays
    training once, by one work timeout, instead of once per item it is given)."""
    c, hole, t = drive_with_a_hole(tmp_path, 12)
    assert c.dispatcher.timeouts["hole"] == 1
    # it received only the work it held before its timeout (max_inflight 2), none after
    assert "hole" in c.dispatcher.generators() and 1 <= len(hole.queue) <= 2, hole.queue
    trained = [rid for b in t.batches for rid in b]
    assert len(trained) == len(set(trained)) == 12 * 8
    assert not any(rid.startswith("hole") for rid in trained)


def test_a_lone_generator_that_swallows_work_is_banned(tmp_path: Path) -> None:
    """Alone, it is given its work back; after MAX_WORK_TIMEOUTS timeouts without a single
    answer in between it is banned (a slow generator that answers is never banned)."""
    now = [0.0]
    c, net, _ = make_coordinator(tmp_path, ["intake.work_timeout_s=30"])
    c.dispatcher.clock = lambda: now[0]
    hole = FakeGenerator(net, "hole", seed=2)
    hole.paused = True
    for _ in range(200):
        c.turn(0.0)
        hole.step()
        now[0] += 1.0
    assert "hole" in c.banned and "work_timeout_s" in c.banned["hole"], c.banned
    assert c.dispatcher.timeouts["hole"] == MAX_WORK_TIMEOUTS and c.step == 0


def test_a_version_never_delivered_to_that_generator_is_refused(tmp_path: Path) -> None:
    """Real ZeroMQ sockets on loopback: "g" is sent v1 and v2 and serves them; "late" joins
    after both and claims v1 (published, below the newest, never announced to it) in its
    Hello, its Heartbeats and a weights Ack: each claim refused (``claims_refused``), no work
    issued against v1, the current weights (v2) announced to it; once it acknowledges v2,
    which was delivered, it is believed. The honest generator's claims are never refused."""
    import time

    from pipeline.config.run import load_config
    from pipeline.core.coordinator import Coordinator
    from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
    from proto.records import Ack, WeightAnnounce
    from tests.pipeline import fast_zmq, hello
    from tests.pipeline.fakes import FAKE_LIMITS, FakeTrainer, prompts

    tc = fast_zmq()
    ep = ZmqLearnerEndpoint(tc, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    cfg = load_config(None, [f"run_dir={tmp_path}", "rollout.n=4", "rollout.prompts_per_step=2",
                             "staleness.max_staleness=2", "publish.keep=0"])  # fmt: skip
    c = Coordinator(cfg, endpoint=ep, trainer=FakeTrainer(), prompts=prompts(), run_dir=tmp_path,
                    limits=FAKE_LIMITS)  # fmt: skip
    conns: dict[str, ZmqGeneratorConnection] = {}
    announced: dict[str, list[int]] = {}
    items: dict[str, list[WorkItem]] = {}

    def connect(gid: str, version: int) -> None:
        conns[gid] = ZmqGeneratorConnection(tc, hello(gid, version), control=ep.endpoints["control"],
                                            weights=ep.endpoints["weights"])  # fmt: skip
        announced[gid], items[gid] = [], []

    def run_until(cond: object, *, ack: dict[str, bool], timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not cond() and time.monotonic() < end:  # type: ignore[operator]
            c.turn(0.01)
            for gid, conn in conns.items():
                inc = conn.recv(0.0)
                while inc is not None:
                    if isinstance(inc.record, WeightAnnounce):
                        announced[gid].append(inc.record.version)
                        if ack[gid]:  # loads it at once
                            v = inc.record.version
                            conn.set_status(v, 0)
                            conn.send(Ack("weights", str(v), v), channel="weights")
                    elif isinstance(inc.record, WorkItem):
                        items[gid].append(inc.record)
                    inc = conn.recv(0.0)
        assert cond(), "timed out"  # type: ignore[operator]

    try:
        connect("g", 0)
        run_until(lambda: "g" in c.dispatcher.generators(), ack={"g": True})
        for v in (1, 2):
            c.publish()
            run_until(lambda v=v: c.publisher.generators().get("g") == v, ack={"g": True})  # type: ignore[misc]
        assert announced["g"] == [1, 2] and c.intake.counts["claims_refused"] == 0
        connect("late", 1)  # v1: published, below the newest, never delivered to "late"
        conns["late"].set_status(1, 0)
        ack = {"g": True, "late": False}
        run_until(lambda: "late" in c.dispatcher.generators() and announced["late"], ack=ack)
        assert c.dispatcher.generators()["late"] == -1  # serves nothing we know
        assert announced["late"] == [2]  # it gets the current weights
        n = c.intake.counts["claims_refused"]
        assert n >= 1
        run_until(lambda: c.intake.counts["claims_refused"] >= n + 3, ack=ack)  # Heartbeats
        conns["late"].send(Ack("weights", "1", 1), channel="weights")  # "I loaded v1"
        run_until(lambda: c.intake.counts["claims_refused"] >= n + 4, ack=ack)
        assert c.publisher.generators()["late"] == -1
        assert c.dispatcher.generators()["late"] == -1
        assert not [it for it in items["late"] if it.min_weight_version == 1]
        conns["late"].set_status(2, 0)  # it loads v2, which was delivered to it: believed
        conns["late"].send(Ack("weights", "2", 2), channel="weights")
        run_until(lambda: c.dispatcher.generators()["late"] == 2, ack=ack)
        assert c.publisher.generators()["late"] == 2
        assert c.dispatcher.generators()["g"] == 2 and c.publisher.generators()["g"] == 2
    finally:
        for conn in conns.values():
            conn.close(None)
        c.close()
        ep.close()
