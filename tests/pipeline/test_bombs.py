"""Decompression bombs against a real learner endpoint in its own process.

A learner endpoint (pipeline.net.transport.zmq, the sockets `looprl learner` binds) runs in
a second process, so its RSS is its own; raw ZeroMQ DEALERs on 127.0.0.1 send it frames of
about 32 KiB whose zstd body declares 1 GiB (control and weights port) or exactly the
control frame limit. Each such frame may cost the learner at most its channel's frame limit,
each connection gets at most STRIKE_LIMIT refused frames decoded per window, and an honest
generator is served throughout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from pipeline.net.strikes import STRIKE_LIMIT, Strikes
from pipeline.net.transport.zmq import ZmqGeneratorConnection
from proto.codec import Codec
from proto.records import ErrorMsg
from tests.pipeline import FakeClock, fast_zmq, hello
from tests.proto.test_codec import bomb_frame

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LIMIT = 8 * MIB  # the learner's control frame limit in this test (256 MiB by default)
FRAMES = 20  # per attacking connection, as in the attack
# RSS the learner may gain beyond one frame limit: what libzmq holds of the attack frames
# (3 x 20 frames of <= 33 KiB = 2 MiB), the error replies, log lines and the allocator's
# pools. Unbounded, each 1 GiB frame is decompressed: +1 GiB (2 GiB with msgpack's copy).
SLACK = 6 * MIB
CFG = dict(max_frame_bytes=LIMIT, heartbeat_interval_s=0.5, peer_timeout_s=30.0)

LEARNER = """
import json, select, sys
from pipeline.commands import console
from pipeline.net.transport.zmq import ZmqLearnerEndpoint
from proto.records import Hello, Welcome
from tests.pipeline import fast_zmq
console.setup(sys.argv[2])
cfg = fast_zmq(**json.loads(sys.argv[1]))
ep = ZmqLearnerEndpoint(cfg, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
print(json.dumps(ep.endpoints), flush=True)
while True:
    inc = ep.recv(0.005)
    if inc is not None and isinstance(inc.record, Hello):
        ep.send(inc.peer, Welcome("run", inc.peer, 0, 0.5))
    if select.select([sys.stdin], [], [], 0)[0]:
        if not sys.stdin.readline():
            break
        print(json.dumps({**vars(ep.stats), "peers": ep.peers()}), flush=True)
ep.close()
"""


class Learner:
    """The learner endpoint process: ``stats()`` asks it for its counters; stopped by pid."""

    def __init__(self, log: Path, stderr: Path) -> None:
        with stderr.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LEARNER, json.dumps(CFG), str(log)],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.out, self.inp = self.proc.stdout, self.proc.stdin
        self.endpoints: dict[str, str] = json.loads(self.out.readline())
        self.ps = psutil.Process(self.proc.pid)

    def stats(self) -> dict[str, Any]:
        self.inp.write("stats\n")
        self.inp.flush()
        return json.loads(self.out.readline())  # type: ignore[no-any-return]

    def peak_rss(self) -> int:
        """VmHWM: the most RSS the process ever had (reset by ``reset_peak``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def stop(self) -> None:
        self.inp.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def learner(tmp_path: Path) -> Iterator[Learner]:
    lrn = Learner(tmp_path / "learner.log", tmp_path / "stderr.txt")
    try:
        yield lrn
    finally:
        lrn.stop()


def honest(lrn: Learner, gid: str) -> ZmqGeneratorConnection:
    """A generator that says Hello and waits for its Welcome (a round trip)."""
    eps = lrn.endpoints
    conn = ZmqGeneratorConnection(
        fast_zmq(**CFG),
        hello(gid),
        control=eps["control"],
        weights=eps["weights"],
    )
    end = time.monotonic() + 10
    while not conn.ready:
        assert time.monotonic() < end, f"{gid}: no Welcome"
        conn.recv(0.02)
    return conn


def test_bombs_cost_a_frame_limit_and_honest_peers_are_served(
    learner: Learner, tmp_path: Path
) -> None:
    before_bombs = honest(learner, "honest-0")
    ctx = zmq.Context()
    socks = []
    sampled = [0]
    stop = threading.Event()

    def sample() -> None:  # the learner's RSS every millisecond (psutil)
        while not stop.is_set():
            sampled[0] = max(sampled[0], learner.ps.memory_info().rss)
            time.sleep(0.001)

    try:
        # (routing id, port, declared size): at the limit (decompressed, then refused) on
        # control; 1 GiB (refused before decompression) on control and on weights, whose
        # learner-side frame limit is 64 KiB: the 32 KiB bomb fits it.
        plan = [(b"bomb-at-limit", "control", LIMIT), (b"bomb-control", "control", 1 << 30),
                (b"bomb-weights", "weights", 1 << 30)]  # fmt: skip
        for rid, port, _ in plan:
            s = ctx.socket(zmq.DEALER)
            s.routing_id, s.linger = rid, 0
            s.connect(learner.endpoints[port])
            socks.append(s)
        time.sleep(0.3)  # connected; the learner settles
        learner.reset_peak()
        base = learner.ps.memory_info().rss
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        for s, (_, _, declared) in zip(socks, plan):
            frame = bomb_frame(declared)
            assert len(frame) < 33 << 10
            for _ in range(FRAMES):
                s.send(frame)
        sent = FRAMES * len(plan)
        end = time.monotonic() + 20
        while (st := learner.stats())["rejected"] < sent:
            assert time.monotonic() < end, st
            time.sleep(0.05)
        took = time.monotonic() - t0
        stop.set()
        sampler.join()
        peak = learner.peak_rss() - base
        high = sampled[0] - base
        print(
            f"\nlearner RSS {base / MIB:.1f} MiB before {sent} bombs; peak +{peak / MIB:.1f} "
            f"MiB (VmHWM), +{high / MIB:.1f} MiB sampled; all refused in {took:.2f} s; "
            f"stats {st}"
        )
        assert peak <= LIMIT + SLACK, f"peak RSS grew {peak / MIB:.1f} MiB"
        assert st["rejected"] == sent and st["received"] >= 1
        assert st["muted"] == len(plan) * (FRAMES - STRIKE_LIMIT)  # decoded: 8 per connection
        for s in socks:  # decoded frames are answered, muted ones are not
            replies = []
            while s.poll(200):
                replies.append(Codec().decode(s.recv()))
            assert [type(r) for r in replies] == [ErrorMsg] * STRIKE_LIMIT

        # Honest generators are still served: the one that was there, and a new one.
        after = honest(learner, "honest-1")
        assert before_bombs.ready and set(learner.stats()["peers"]) >= {"honest-0", "honest-1"}
        after.close()
    finally:
        stop.set()
        for s in socks:
            s.close(0)
        ctx.term()
        before_bombs.close()
    log = (tmp_path / "learner.log").read_text()
    assert "Logging error" not in (tmp_path / "stderr.txt").read_text()
    for rid, _, _ in plan:  # one line for the refusals, one for the mute, per connection
        peer = rid.decode()
        assert log.count(f"rejected a frame from {peer} ") == 1, log
        assert log.count(f"ignoring frames from {peer} ") == 1, log


def test_strikes_mute_a_key_for_the_rest_of_its_window() -> None:
    clock = FakeClock()
    s = Strikes(clock, limit=3, window_s=10.0, max_keys=2)
    assert [s.strike(b"a") for _ in range(3)] == [False, False, True]  # the 3rd mutes
    assert s.muted(b"a") and not s.muted(b"b") and s.remaining_s(b"a") == 10.0
    clock.advance(9.9)
    assert s.muted(b"a") and not s.strike(b"a")  # more strikes do not extend the window
    clock.advance(0.1)  # the window (from the first strike) is over: decoded again
    assert not s.muted(b"a") and s.remaining_s(b"a") == 0.0
    assert not s.strike(b"a") and not s.muted(b"a")  # a new window, 1 strike
    for k in (b"b", b"c"):  # a peer inventing keys: the oldest is forgotten, never muted
        s.strike(k)
    assert len(s._windows) == 2 and not s.muted(b"a")
