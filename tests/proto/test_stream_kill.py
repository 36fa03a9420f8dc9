"""Rollout streams across processes: a writer killed with SIGKILL, a reader tailing a writer."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from proto.stream.format import StreamCorruptError, StreamError
from proto.stream.reader import StreamReader
from proto.stream.writer import StreamWriter, recover

REPO = Path(__file__).resolve().parents[2]

# Payload of frame ``seq``: big enough (up to ~400 KB) that a kill often lands mid-write.
PAYLOAD_SRC = """
def payload(seq):
    n = (seq * 104729) % 400_000
    return (seq.to_bytes(8, "little") * (n // 8 + 1))[:n]
"""
_ns: dict[str, object] = {}
exec(PAYLOAD_SRC, _ns)
payload: Callable[[int], bytes] = _ns["payload"]  # type: ignore[assignment]

WRITER = (
    PAYLOAD_SRC
    + """
import sys
from proto.stream.writer import StreamWriter
with StreamWriter(sys.argv[1], segment_bytes=int(sys.argv[2]), fsync=sys.argv[3]) as w:
    while True:
        w.append(payload(w.next_seq))
        w.flush()
"""
)

TAILER = """
import hashlib, json, sys
from proto.stream.reader import StreamReader
r = StreamReader(sys.argv[1])
want = int(sys.argv[2])
print("ready", flush=True)
seen, active = [], 0
for f in r.iter(follow=True, timeout=10.0, poll_s=0.002):
    seen.append([f.seq, hashlib.sha1(f.payload).hexdigest()])
    active += r.writer_active()
    if len(seen) == want:
        break
print(json.dumps({"frames": seen, "seen_while_writer_active": active}), flush=True)
"""


def _stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _frames_visible(path: Path) -> int:
    try:
        with StreamReader(path) as r:
            return len(r)
    except StreamCorruptError:
        raise
    except StreamError:  # not created yet
        return 0


def test_writer_killed_mid_write(tmp_path: Path) -> None:
    rng = random.Random(0)
    torn_seen = 0
    s = tmp_path / "s"
    expected = 0  # frames in the stream before this round's writer starts
    for round_ in range(4):
        fsync = ("never", "batch")[round_ % 2]
        cmd = [sys.executable, "-c", WRITER, str(s), str(2 << 20), fsync]
        proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 20
            while _frames_visible(s) < expected + 15:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "writer made no progress"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.02))
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            _stop(proc)
            if proc.stderr:
                proc.stderr.close()

        before = {n: (s / n).stat().st_size for n in os.listdir(s)}
        with StreamReader(s) as r:  # a reader copes with the torn tail without changing it
            seqs = [f.seq for f in r.iter()]
            n = len(seqs)
            assert seqs == list(range(n)) and n >= expected + 15
            assert all(r.get(q) == payload(q) for q in (0, n // 2, n - 1))
            torn = r.torn_tail is not None
            torn_seen += torn
        assert {n: (s / n).stat().st_size for n in os.listdir(s)} == before

        if round_ % 2:
            rep = recover(s)
        else:
            with StreamWriter(s, segment_bytes=2 << 20) as w:
                rep = w.recovery
        assert rep.last_seq == n - 1 and (rep.truncated_bytes > 0) == torn
        with StreamWriter(s, segment_bytes=2 << 20) as w:
            assert w.next_seq == n and w.recovery.truncated_bytes == 0
            w.append(payload(n))
        with StreamReader(s) as r:
            frames = list(r.iter())
            assert [f.seq for f in frames] == list(range(n + 1))
            assert all(f.payload == payload(f.seq) for f in frames)
            assert r.torn_tail is None and r.verify() == n + 1
        expected = n + 1
    print(f"torn tails seen by the reader after SIGKILL: {torn_seen} of 4")


def test_reader_tails_a_live_writer(tmp_path: Path) -> None:
    s = tmp_path / "s"
    n = 300
    with StreamWriter(s, segment_bytes=256 << 10, fsync="never", buffer_bytes=64 << 10) as w:
        proc = subprocess.Popen(
            [sys.executable, "-c", TAILER, str(s), str(n)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            for q in range(n):
                w.append(payload(q % 40 * 1000 + q))
                if q % 7 == 0:
                    w.flush()
                    time.sleep(0.002)
            w.flush()
            out, err = proc.communicate(timeout=20)
        finally:
            _stop(proc)
            for f in (proc.stdout, proc.stderr):
                if f:
                    f.close()
    assert proc.returncode == 0, err
    got = json.loads(out)
    want = [[q, hashlib.sha1(payload(q % 40 * 1000 + q)).hexdigest()] for q in range(n)]
    assert got["frames"] == want
    assert got["seen_while_writer_active"] > 0
    with StreamReader(s) as r:
        assert len(r.segments) > 3  # the tail followed segment rollovers
