"""A generator-side peer for tests/pipeline/test_pause.py: a real ZmqGeneratorConnection in
its own process that recv()s in a loop and, after being paused (a gap in its loop), stays
busy for ``busy_s`` without reading, as a generator inside a long generate call does.

    python tests/pipeline/pause_peer.py CONTROL WEIGHTS RUN_S BUSY_S
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.net.transport.config import TransportConfig  # noqa: E402
from pipeline.net.transport.zmq import ZmqGeneratorConnection  # noqa: E402
from proto.records import Hello  # noqa: E402

CFG = TransportConfig(heartbeat_interval_s=0.5, peer_timeout_s=4.0)


def main() -> None:
    ctrl, wts, run_s, busy_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    hello = Hello("g1", "h", os.getpid(), [], 2, 0, time.time())
    conn = ZmqGeneratorConnection(CFG, hello, control=ctrl, weights=wts)
    t0 = last = time.time()
    got = paused = 0
    while time.time() - t0 < run_s:
        if time.time() - last > 2.0:
            paused += 1
            time.sleep(busy_s)
        last = time.time()
        if conn.recv(0.1) is not None:
            got += 1
    print(f"received {got} paused {paused} ready {int(conn.ready)}", flush=True)
    conn.close()


if __name__ == "__main__":
    main()
