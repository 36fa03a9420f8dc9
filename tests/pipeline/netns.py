"""A private star network of Linux network namespaces for multi-"host" tests.

Topology (every address lives inside namespaces created here; the root namespace, its
interfaces and its routes are never touched)::

    ns <tag>-hub:    bridge br0, one veth end per node (v0, v1, ...)
    ns <tag>-<node>: lo up, eth0 = 10.213.0.<i>/24 (the other veth end), no default route

so a node reaches the other nodes through the bridge and nothing else. Processes are started
with ``ip netns exec`` in their own session and stopped by pid (SIGTERM to the process group
this module created, then SIGKILL); ``Lab.down()`` stops them and deletes the namespaces,
also after a failure. Run as a module, it provides the small ZMQ peers of
tests/pipeline/test_netns.py (``python -m tests.pipeline.netns learner|generator|rogue``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

SUBNET = "10.213.0"  # /24, only ever configured inside our own namespaces
PREFIX = "lrltest-"
REPO = Path(__file__).resolve().parents[2]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found (apt-get install -y iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> None:
    """Delete namespaces an earlier, killed test run left behind (its pid is gone)."""
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _ip("netns", "del", name, check=False)


class Lab:
    """Namespaces for ``nodes`` on one bridge; a context manager that always cleans up."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.hub = f"{self.tag}-hub"
        self.ns = {n: f"{self.tag}-{n}" for n in nodes}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(nodes)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def up(self) -> Lab:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, (node, ns) in enumerate(self.ns.items()):
                self._add(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip(
                    "-n",
                    self.hub,
                    "link",
                    "add",
                    f"v{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"v{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns[node], *argv]

    def spawn(
        self, node: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``node`` (own session, output to ``log``); stopped by down()."""
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
        with open(log, "ab") as out:
            p = subprocess.Popen(
                self.argv(node, argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=REPO,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def eth0_bytes(self, node: str) -> tuple[int, int]:
        """(rx, tx) bytes of ``node``'s eth0: proof that traffic crossed the bridge."""
        stats = Path("/sys/class/net/eth0/statistics")
        r = subprocess.run(
            self.argv(node, ["cat", str(stats / "rx_bytes"), str(stats / "tx_bytes")]),
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        rx, tx = r.stdout.split()
        return int(rx), int(tx)

    @staticmethod
    def stop(p: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
        """SIGTERM the process group we started with ``p`` (by its pid), SIGKILL after
        ``timeout_s``; returns the exit code."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        rc = p.wait(10)
        try:  # children left behind in the group (reward workers, ...)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return rc

    def down(self) -> None:
        for p in self.procs:
            self.stop(p, timeout_s=10.0)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def wait_for(pred: Any, timeout_s: float, what: str, procs: Sequence[Any] = ()) -> None:
    """Poll ``pred()`` until true; fail early when one of ``procs`` has exited."""
    end = time.monotonic() + timeout_s
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: pid {p.pid} exited with {p.returncode}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


# -- peers run inside the namespaces (python -m tests.pipeline.netns ROLE ...) ---------------
def _fast() -> Any:
    from pipeline.net.transport.config import TransportConfig

    return TransportConfig(
        heartbeat_interval_s=0.2,
        peer_timeout_s=5.0,
        hello_retry_s=0.1,
        hello_retry_max_s=0.5,
        reconnect_ivl_ms=50,
        reconnect_ivl_max_ms=200,
    )


def _learner(a: argparse.Namespace, out: IO[str]) -> None:
    from pipeline.net.security import ServerCurve
    from pipeline.net.transport.zmq import ZmqLearnerEndpoint
    from proto.records import Hello, Welcome

    ep = ZmqLearnerEndpoint(
        _fast(), control=a.control, weights=a.weights, security=ServerCurve.from_dir(a.keys)
    )
    hellos: dict[str, int] = {}
    end = time.monotonic() + a.seconds
    try:
        print(json.dumps({"bound": ep.endpoints}), file=out, flush=True)
        while time.monotonic() < end:
            inc = ep.recv(0.1)
            if inc is not None and isinstance(inc.record, Hello):
                hellos[inc.peer] = inc.record.pid
                ep.send(inc.peer, Welcome("netns", inc.peer, 0, 0.2, {"numerics": "fast"}))
            if len(hellos) >= a.expect and ep.stats.unauthenticated >= a.unauthenticated:
                end = min(end, time.monotonic() + 1.0)  # answer heartbeats a little longer
        print(json.dumps({"hellos": hellos, "stats": vars(ep.stats)}), file=out, flush=True)
    finally:
        ep.close()


def _generator(a: argparse.Namespace, out: IO[str]) -> None:
    from pipeline.net.security import ClientCurve, generator_id_for
    from pipeline.net.transport.zmq import ZmqGeneratorConnection
    from proto.records import Hello

    hello = Hello(
        generator_id_for(a.key_name, a.id), "netns", os.getpid(), ["huginn"], 1, -1, time.time()
    )
    curve = ClientCurve.from_dir(a.keys, a.key_name)
    conn = ZmqGeneratorConnection(
        _fast(), hello, control=a.control, weights=a.weights, security=curve
    )
    end = time.monotonic() + a.seconds
    try:
        while time.monotonic() < end and conn.welcome is None:
            conn.recv(0.1)
        w = conn.welcome
        print(json.dumps({"welcome": None if w is None else w.generator_id}), file=out, flush=True)
    finally:
        conn.close("done")


def _rogue(a: argparse.Namespace, out: IO[str]) -> None:
    """A CURVE client with a key the learner never admitted: it must hear nothing."""
    import zmq
    import zmq.auth

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    s.curve_publickey, s.curve_secretkey = public, secret
    s.curve_serverkey = zmq.auth.load_certificate(a.learner_key)[0]
    s.linger = 0
    s.connect(a.control)
    s.send(b"not a frame", zmq.NOBLOCK)
    got = bool(s.poll(int(a.seconds * 1000)))
    print(json.dumps({"got_reply": got}), file=out, flush=True)
    s.close(0)
    ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.pipeline.netns")
    sub = p.add_subparsers(dest="role", required=True)
    lp = sub.add_parser("learner")
    lp.add_argument("--expect", type=int, default=2)
    lp.add_argument("--unauthenticated", type=int, default=0)
    gp = sub.add_parser("generator")
    gp.add_argument("--id", required=True)
    gp.add_argument("--key-name", required=True)
    rp = sub.add_parser("rogue")
    rp.add_argument("--learner-key", required=True)
    for q in (lp, gp, rp):
        q.add_argument("--control", required=True)
        q.add_argument("--weights", default="")
        q.add_argument("--keys", default="")
        q.add_argument("--seconds", type=float, default=30.0)
        q.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with open(a.out, "w") as out:
        {"learner": _learner, "generator": _generator, "rogue": _rogue}[a.role](a, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
