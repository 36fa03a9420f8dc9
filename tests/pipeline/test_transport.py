"""Transports: the in-memory implementation (fake clock) and ZMQ over tcp on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from pipeline.net.transport.config import TransportConfig, TransportError
from pipeline.net.transport.memory import MemoryNetwork
from pipeline.net.transport.session import GeneratorConnection, Incoming, LearnerEndpoint
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
from proto.codec import Codec
from proto.records import ErrorMsg, Goodbye, Heartbeat, Hello, RolloutBatch, Welcome, WorkItem
from tests.pipeline import FakeClock, hello, rollout

CFG = TransportConfig(
    max_frame_bytes=64 << 10,
    weights_max_frame_bytes=64 << 10,
    oversize_grace_bytes=64 << 10,
    heartbeat_interval_s=1.0,
    peer_timeout_s=5.0,
    hello_retry_s=0.5,
    hello_retry_max_s=4.0,
)


def drain(
    t: LearnerEndpoint | GeneratorConnection, timeout_s: float = 0.0, until: float = 0.0
) -> list[Incoming]:
    """Everything that arrives within ``timeout_s`` per call, stopping at the first gap."""
    out = []
    end = time.monotonic() + until
    while True:
        inc = t.recv(timeout_s)
        if inc is not None:
            out.append(inc)
        elif time.monotonic() >= end:
            return out


def types(incs: list[Incoming]) -> list[str]:
    return [type(i.record).__name__ for i in incs]


def welcome(gid: str, interval: float = 1.0) -> Welcome:
    return Welcome("run", gid, 0, interval)


@pytest.fixture
def mem() -> Iterator[tuple[MemoryNetwork, FakeClock]]:
    yield MemoryNetwork(), FakeClock()


def joined(net: MemoryNetwork, clock: FakeClock, gid: str = "gen-0") -> tuple[Any, Any]:
    ep = net.bind("learner", CFG, clock=clock)
    conn = net.connect("learner", hello(gid), CFG, clock=clock)
    (inc,) = drain(ep)
    assert isinstance(inc.record, Hello) and inc.peer == gid and ep.peers() == [gid]
    assert ep.send(gid, welcome(gid))
    assert types(drain(conn)) == ["Welcome"] and conn.ready
    return ep, conn


# -- in-memory ------------------------------------------------------------------------------


def test_memory_hello_welcome_work_rollout(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    ep, conn = joined(*mem)
    work = WorkItem("w0", "p0", np.array([1, 2], np.int32), np.array([7, 8], np.uint64))
    assert ep.send("gen-0", work)
    (got,) = drain(conn)
    assert got.channel == "control" and got.record.work_id == "w0"
    assert conn.send(RolloutBatch([rollout(), rollout(index=1)]))
    (got,) = drain(ep)
    assert got.peer == "gen-0" and len(got.record.rollouts) == 2
    assert ep.stats.rejected == conn.stats.rejected == 0


def test_memory_heartbeats_and_expiry(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    ep.set_status(weight_version=3, inflight=2)
    clock.advance(1.1)
    assert drain(ep) == []  # the learner's tick sent its heartbeat
    assert types(drain(conn)) == ["Heartbeat"]  # and the generator's tick sent one too
    hb = drain(ep)[0].record
    assert isinstance(hb, Heartbeat) and hb.sender_id == "gen-0"
    clock.advance(4.5)  # the generator stays silent from here on: it never calls recv()
    assert ep.expired_peers() == []
    clock.advance(1.0)
    assert ep.expired_peers() == ["gen-0"] and ep.peers() == []
    assert ep.expired_peers() == []  # reported once


def test_memory_rejects_bad_frames_and_keeps_serving(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    codec = Codec()
    bad = [
        b"",
        b"junk",
        b"LQRL\x01\x00\x00\x00\x93\x01",  # msgpack that is no record
        b"LQRL\x09\x00\x00\x00" + b"x" * 10,  # protocol major 9
        codec.encode(WorkItem("w", "p", np.array([1], np.int32), np.array([1], np.uint64))),
        codec.encode(Hello("someone-else", "h", 1, [], 1, -1, 0.0)),  # spoofed id
        Codec(level=0).encode(rollout(n_tokens=20_000)),  # > max_frame_bytes
    ]
    assert len(bad[-1]) > CFG.max_frame_bytes
    for frame in bad:
        assert conn.send_frame(frame)
    ep.inbox.put(("control", "gen-0", [b"a", b"b"]))  # multipart
    assert conn.send(RolloutBatch([rollout()]))
    got = drain(ep)
    assert types(got) == ["RolloutBatch"]  # the valid frame after the junk still arrives
    assert ep.stats.rejected == len(bad) + 1 and ep.stats.received == 2
    errs = drain(conn)
    assert all(isinstance(e.record, ErrorMsg) and e.record.code == "protocol" for e in errs)
    assert len(errs) == len(bad) + 1
    assert "max_frame_bytes" in errs[-2].record.message
    assert ep.peers() == ["gen-0"]


def test_memory_unknown_peer_and_bad_settings(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, _ = joined(net, clock)
    assert not ep.send("nobody", welcome("nobody"))
    assert ep.stats.unroutable == 1
    with pytest.raises(TransportError, match="heartbeat_interval_s"):
        TransportConfig(heartbeat_interval_s=5.0, peer_timeout_s=1.0)
    with pytest.raises(TransportError, match="generator id"):
        net.connect("learner", hello(""), CFG)
    with pytest.raises(TransportError, match="unknown channel"):
        ep.send("gen-0", welcome("gen-0"), channel="bulk")  # type: ignore[arg-type]


def test_memory_learner_away_rehello_with_backoff(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    ep.close()
    sent: list[float] = []
    for _ in range(150):  # 15 s in 0.1 s steps, the generator polling as it would
        clock.advance(0.1)
        before = conn.stats.sent
        conn.recv(0)
        if conn.stats.sent > before and not conn.ready:
            sent.append(round(clock.t - 1000.0, 1))
    assert conn.stats.reconnects == 1 and not conn.ready
    # silent for > 5 s -> Hello at once, then after 0.5, 1, 2, 4 (capped) s
    gaps = [round(b - a, 1) for a, b in zip(sent[1:], sent[2:])]
    assert gaps[:3] == [1.0, 2.0, 4.0] and sent[1] - sent[0] == pytest.approx(0.5, abs=0.11)
    ep2 = net.bind("learner", CFG, clock=clock)  # the learner is back: queued frames arrive
    got = drain(ep2)
    assert set(types(got)) <= {"Hello", "Heartbeat"} and "Hello" in types(got)
    ep2.send("gen-0", welcome("gen-0"))
    assert "Welcome" in types(drain(conn)) and conn.ready


def test_memory_restarted_learner_asks_for_hello(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    ep.close()
    ep2 = net.bind("learner", CFG, clock=clock)  # back before the generator timed out
    clock.advance(1.1)
    conn.recv(0)  # heartbeat to a learner that does not know us
    assert types(drain(ep2)) == ["Heartbeat"] and ep2.peers() == []
    (err,) = drain(conn)
    assert isinstance(err.record, ErrorMsg) and err.record.code == "hello_first"
    assert not conn.ready and conn.stats.reconnects == 1
    conn.recv(0)
    assert types(drain(ep2)) == ["Hello"] and ep2.peers() == ["gen-0"]


def test_memory_goodbye(mem: tuple[MemoryNetwork, FakeClock]) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    conn.close("done")
    (got,) = drain(ep)
    assert isinstance(got.record, Goodbye) and got.record.reason == "done"
    assert ep.peers() == [] and not ep.send("gen-0", welcome("gen-0"))


def test_memory_is_thread_safe_for_one_reader_and_writer(
    mem: tuple[MemoryNetwork, FakeClock],
) -> None:
    net, clock = mem
    ep, conn = joined(net, clock)
    n = 300

    def produce() -> None:
        for i in range(n):
            while not conn.send(RolloutBatch([rollout(index=i)])):
                time.sleep(0.001)

    th = threading.Thread(target=produce)
    th.start()
    got: list[Incoming] = []
    # all n, however long the writer is descheduled (a loaded host paused it > 0.5 s
    # mid-stream, which ended the earlier drain at its first gap)
    end = time.monotonic() + 60
    while len(got) < n and time.monotonic() < end:
        inc = ep.recv(0.05)
        if inc is not None:
            got.append(inc)
    th.join(5)
    assert not th.is_alive()
    assert [g.record.rollouts[0].sample_index for g in got] == list(range(n))


# -- ZMQ over tcp on 127.0.0.1 ----------------------------------------------------------------

ZCFG = TransportConfig(
    max_frame_bytes=64 << 10,
    weights_max_frame_bytes=64 << 10,
    oversize_grace_bytes=64 << 10,
    heartbeat_interval_s=0.1,
    peer_timeout_s=0.6,
    hello_retry_s=0.05,
    hello_retry_max_s=0.2,
    reconnect_ivl_ms=20,
    reconnect_ivl_max_ms=100,
    linger_ms=50,
)


def wait_for(
    t: LearnerEndpoint | GeneratorConnection,
    pred: Callable[[Incoming], bool],
    timeout_s: float = 5,
    also: tuple[LearnerEndpoint | GeneratorConnection, ...] = (),
) -> Incoming:
    """Receive on ``t`` until ``pred``; ``also`` get their housekeeping (what they get is lost)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for other in also:
            other.recv(0)
        inc = t.recv(0.02)
        if inc is not None and pred(inc):
            return inc
    raise AssertionError("timed out waiting for a message")


def is_(cls: type) -> Callable[[Incoming], bool]:
    return lambda inc: isinstance(inc.record, cls)


@pytest.fixture
def zep() -> Iterator[ZmqLearnerEndpoint]:
    ep = ZmqLearnerEndpoint(ZCFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    yield ep
    ep.close()


def zconnect(ep: ZmqLearnerEndpoint, gid: str = "gen-0") -> ZmqGeneratorConnection:
    conn = ZmqGeneratorConnection(
        ZCFG, hello(gid), control=ep.endpoints["control"], weights=ep.endpoints["weights"]
    )
    wait_for(ep, lambda i: isinstance(i.record, Hello) and i.peer == gid)
    assert ep.send(gid, welcome(gid, 0.1))
    wait_for(conn, is_(Welcome))
    assert conn.ready
    return conn


def test_zmq_round_trip_both_channels(zep: ZmqLearnerEndpoint) -> None:
    conn = zconnect(zep)
    try:
        assert conn.send(RolloutBatch([rollout()]))
        got = wait_for(zep, is_(RolloutBatch))
        assert got.channel == "control" and got.peer == "gen-0"
        assert zep.send("gen-0", ErrorMsg("x", "on weights"), channel="weights")
        got = wait_for(conn, is_(ErrorMsg))
        assert got.channel == "weights"
        wait_for(conn, is_(Heartbeat), also=(zep,))  # heartbeats come from recv()
        wait_for(zep, is_(Heartbeat), also=(conn,))
    finally:
        conn.close()


def test_zmq_rejects_bad_frames_oversize_and_keeps_serving(zep: ZmqLearnerEndpoint) -> None:
    good = zconnect(zep, "good")
    raw = zep._ctx.socket(zmq.DEALER)  # a misbehaving peer speaking raw ZMQ
    raw.routing_id, raw.linger = b"raw", 0
    raw.connect(zep.endpoints["control"])
    try:
        raw.send(b"not a frame")
        raw.send_multipart([b"a", b"b"])
        raw.send(b"LQRL\x01\x00\x00\x00" + b"\x00" * (100 << 10))  # > max, < max + grace
        replies: list[ErrorMsg] = []
        end = time.monotonic() + 5
        while len(replies) < 3 and time.monotonic() < end:
            assert zep.recv(0.02) is None  # nothing valid: each junk frame is answered
            while raw.poll(0):
                replies.append(Codec().decode(raw.recv()))
        assert [(type(r), r.code) for r in replies] == [(ErrorMsg, "protocol")] * 3
        assert "max_frame_bytes" in replies[2].message
        assert zep.stats.rejected == 3
        raw.send(b"x" * (200 << 10))  # beyond ZMQ_MAXMSGSIZE: libzmq drops the connection
        end = time.monotonic() + 5
        while zep.stats.disconnects == 0 and time.monotonic() < end:
            zep.recv(0.05)
        assert zep.stats.disconnects >= 1 and zep.stats.rejected == 3
        assert good.send(RolloutBatch([rollout(gid="good")]))
        assert wait_for(zep, is_(RolloutBatch)).peer == "good"
    finally:
        raw.close(0)
        good.close()


def test_zmq_generator_rehellos_after_learner_restart() -> None:
    ep = ZmqLearnerEndpoint(ZCFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    ends = dict(ep.endpoints)
    conn = zconnect(ep)
    try:
        ep.close()  # learner gone
        end = time.monotonic() + 5
        while conn.ready and time.monotonic() < end:
            conn.recv(0.05)
        assert not conn.ready and conn.stats.reconnects == 1
        ep = ZmqLearnerEndpoint(ZCFG, control=ends["control"], weights=ends["weights"])
        # the generator keeps running its loop (its Hello retries): a Hello written to the dead
        # connection is lost, and on a loaded host that was the only one without the retries
        got = wait_for(ep, is_(Hello), also=(conn,))
        assert got.peer == "gen-0"
        ep.send("gen-0", welcome("gen-0", 0.1))
        wait_for(conn, is_(Welcome))
        assert conn.ready
    finally:
        conn.close()
        ep.close()


def test_zmq_no_threads_left() -> None:
    before = threading.active_count()
    ep = ZmqLearnerEndpoint(ZCFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    conn = zconnect(ep)
    conn.close()
    ep.close()
    assert threading.active_count() == before


def test_zmq_waker_ends_a_recv_wait_at_once(zep: ZmqLearnerEndpoint) -> None:
    """waker(): a thread that finished work ends the loop's recv wait (None, long before its
    timeout); a wake before the wait is not lost; frames still come first; after close the
    waker does nothing (a late trainer or lane thread)."""
    wake = zep.waker()
    assert zep.waker() is wake  # one pipe per transport
    threading.Timer(0.2, wake).start()
    t0 = time.monotonic()
    assert zep.recv(5.0) is None
    assert 0.15 <= time.monotonic() - t0 < 2.0
    wake()
    wake()  # two wakes before a wait: one early return, then the wait is a wait again
    t0 = time.monotonic()
    assert zep.recv(5.0) is None and time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert zep.recv(0.3) is None and time.monotonic() - t0 >= 0.25
    conn = zconnect(zep)
    try:
        assert conn.send(RolloutBatch([rollout()]))
        wake()
        got = wait_for(zep, is_(RolloutBatch))  # a woken recv loses no frame
        assert got.peer == "gen-0"
    finally:
        conn.close()
    zep.close()
    wake()  # closed: nothing written, nothing raised
