"""Receive memory bounded in bytes per connection, and rate-limited rejection warnings.

The flood test uses real sockets and a real second process (the flooder), so the bytes
queued on the learner's side show up in this process's RSS and nowhere else.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.net.log_limit import RateLimitedLog
from pipeline.net.transport.config import TransportConfig, TransportError
from pipeline.net.transport.memory import MemoryNetwork
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
from proto.records import Hello, RolloutBatch, Welcome
from tests.pipeline import FakeClock, fast_zmq, hello, rollout

MIB = 1 << 20
FLOOD_FRAMES = 150  # of 1 MiB each: 150 MiB offered by one connection

FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.sndhwm, s.linger, s.routing_id = 100000, 0, b"flood"
s.connect(sys.argv[1])
junk = b"LQRL" + b"\\xff" * ((1 << 20) - 4)  # one frame limit of garbage
sent = sum(1 for _ in range(int(sys.argv[2])) if s.send(junk, zmq.NOBLOCK) is None)
print(sent, flush=True)
while True:  # keep the connection (and the flood) up until the test kills us
    time.sleep(1)
"""


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_rcvhwm_from_the_byte_budget() -> None:
    cfg = TransportConfig()  # defaults: 256 MiB frames + 1 MiB grace, 1 GiB per connection
    assert cfg.rcvhwm("learner", "control") == 2  # (2 + 1) x 257 MiB = 771 MiB <= 1 GiB
    assert cfg.rcvhwm("learner", "weights") == 962  # acks: 963 x (64 KiB + 1 MiB) <= 1 GiB
    assert cfg.rcvhwm("generator", "weights") == 14  # 15 x 65 MiB <= 1 GiB
    for side in ("learner", "generator"):
        for ch in ("control", "weights"):
            frame = cfg.recv_limit(side, ch) + cfg.oversize_grace_bytes
            assert (cfg.rcvhwm(side, ch) + 1) * frame <= cfg.recv_budget_bytes  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="recv_budget_bytes .* two of the largest frames"):
        TransportConfig(recv_budget_bytes=256 << 20)


def test_flood_of_large_frames_is_bounded_in_bytes(caplog: pytest.LogCaptureFixture) -> None:
    budget = 4 * MIB
    cfg = fast_zmq(
        max_frame_bytes=MIB,
        weights_max_frame_bytes=MIB,
        oversize_grace_bytes=64 << 10,
        recv_budget_bytes=budget,
    )
    held_max = (cfg.rcvhwm("learner", "control") + 1) * (MIB + (64 << 10))
    assert held_max <= budget
    ep = ZmqLearnerEndpoint(cfg, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    assert ep._socks["control"].rcvhwm == 2
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, ep.endpoints["control"], str(FLOOD_FRAMES)],
        stdout=subprocess.PIPE,
    )
    good = None
    try:
        ep.recv(0.05)
        before = rss_bytes()
        assert flooder.stdout is not None and int(flooder.stdout.readline()) == FLOOD_FRAMES
        time.sleep(1.5)  # the learner does not read: everything the flooder can push, it has
        grown = rss_bytes() - before
        # Without the bound the learner held the whole flood (RCVHWM 1000: ~150 MiB here).
        assert grown < budget + 8 * MIB, f"RSS grew {grown / MIB:.1f} MiB"

        # A normal generator is served while the flood goes on.
        good = ZmqGeneratorConnection(
            cfg, hello("good"), control=ep.endpoints["control"], weights=ep.endpoints["weights"]
        )
        caplog.set_level(logging.WARNING, logger="pipeline.net.transport.session")
        got = None
        end = time.monotonic() + 20
        while got is None and time.monotonic() < end:
            inc = ep.recv(0.01)
            if inc is not None and isinstance(inc.record, Hello):
                ep.send("good", Welcome("run", "good", 0, 0.1))
            elif inc is not None and isinstance(inc.record, RolloutBatch):
                got = inc
            if good.recv(0) is not None and good.ready:
                good.send(RolloutBatch([rollout(gid="good")]))
        assert got is not None and got.peer == "good"
        end = time.monotonic() + 20
        while ep.stats.rejected < 30 and time.monotonic() < end:  # the flood goes on: refused
            ep.recv(0.01)
            assert rss_bytes() - before < budget + 8 * MIB
        assert ep.stats.rejected >= 30
        lines = [r for r in caplog.records if "rejected a frame from flood" in r.getMessage()]
        assert len(lines) == 1  # one line for the whole flood (log_interval_s = 10 s)
        assert ep.stats.warnings_suppressed == ep.stats.rejected - 1
    finally:
        os.kill(flooder.pid, signal.SIGKILL)
        flooder.wait(10)
        if good is not None:
            good.close(None)
        ep.close()


def test_memory_inbox_bounded_in_bytes_per_sender() -> None:
    cfg = TransportConfig(
        max_frame_bytes=64 << 10,
        weights_max_frame_bytes=64 << 10,
        oversize_grace_bytes=0,
        recv_budget_bytes=256 << 10,
        heartbeat_interval_s=1.0,
        peer_timeout_s=5.0,
    )
    net, clock = MemoryNetwork(), FakeClock()
    ep = net.bind("learner", cfg, clock=clock)
    flood = net.connect("learner", hello("flood"), cfg, clock=clock)
    normal = net.connect("learner", hello("normal"), cfg, clock=clock)
    frame = b"\xff" * (60 << 10)
    for _ in range(50):  # 3 MB offered; what the learner's inbox takes stops at the budget
        flood.send_frame(frame)
    assert ep.inbox.held["flood"] <= cfg.recv_budget_bytes
    assert ep.inbox.held["flood"] > cfg.recv_budget_bytes - len(frame)
    assert normal.send(RolloutBatch([rollout(gid="normal")]))  # another sender still gets in
    peers = []
    while (inc := ep.recv(0)) is not None:
        peers.append((inc.peer, type(inc.record).__name__))
    assert ("normal", "RolloutBatch") in peers
    assert "flood" not in ep.inbox.held  # drained: nothing held, the queue accepts again


def test_rejection_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pipeline.net.transport.session")
    net, clock = MemoryNetwork(), FakeClock()
    cfg = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=5.0, log_interval_s=10.0)
    ep = net.bind("learner", cfg, clock=clock)
    g0 = net.connect("learner", hello("gen-0"), cfg, clock=clock)
    g1 = net.connect("learner", hello("gen-1"), cfg, clock=clock)

    def pump() -> list[str]:
        caplog.clear()
        while ep.inbox.q:  # recv skips at most 64 bad frames per call
            ep.recv(0)
        return [r.getMessage() for r in caplog.records]

    for _ in range(500):
        g0.send_frame(b"junk")
    ep.inbox.put(("control", "gen-0", [b"a", b"b"]))  # another reason: multipart
    g1.send_frame(b"junk")  # another peer
    lines = pump()
    assert ep.stats.rejected == 502 and ep.stats.warnings_suppressed == 499
    assert len(lines) == 3, lines  # one per (peer, reason)
    assert sum("from gen-0" in x for x in lines) == 2 and "from gen-1" in lines[-1]
    clock.advance(5.0)
    g0.send_frame(b"junk")
    assert pump() == [] and ep.stats.warnings_suppressed == 500
    clock.advance(5.0)  # the interval has passed: one line, with the count it held back
    g0.send_frame(b"junk")
    (line,) = pump()
    assert "from gen-0" in line and "500 more from gen-0 (malformed) suppressed" in line


def test_rate_limited_log_forgets_old_keys_not_counts() -> None:
    clock = FakeClock()
    log = logging.getLogger("test.log_limit")
    lim = RateLimitedLog(log, 10.0, clock, max_keys=3)
    assert [lim.warn(f"p{i}", "r", "x") for i in range(5)] == [True] * 5
    assert len(lim._keys) == 3  # p2, p3, p4: a peer inventing ids cannot grow it
    assert not lim.warn("p4", "r", "x") and lim.suppressed == 1
    assert lim.warn("p0", "r", "x")  # forgotten: may speak again (early, never hidden)
