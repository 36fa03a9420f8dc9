"""CURVE keys (`looprl keys`), the bind rule, and authentication over tcp on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from pipeline.commands import keys_cli
from pipeline.config.run import load_config
from pipeline.net.security import (
    ClientCurve,
    InsecureBindError,
    SecurityError,
    ServerCurve,
    check_bind,
    is_loopback,
)
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
from proto.records import Hello, RolloutBatch, Welcome
from tests.pipeline import fast_zmq, hello, rollout

CFG = fast_zmq(peer_timeout_s=0.6)
REPO = Path(__file__).resolve().parents[2]


def keys(tmp_path: Path, n: int = 2) -> Path:
    parser = argparse.ArgumentParser()
    keys_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["keys", str(tmp_path / "keys"), "--generators", str(n)])
    assert args.func(args) == 0
    return tmp_path / "keys"


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:*", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/x.sock", True),
        ("inproc://x", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://learner.example.org:5555", False),
    ],
)
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_bind_rule(tmp_path: Path) -> None:
    with pytest.raises(InsecureBindError, match="looprl keys"):
        check_bind("tcp://0.0.0.0:5555", None, insecure=False)
    assert check_bind("tcp://0.0.0.0:5555", None, insecure=True) is False  # explicit opt-out
    assert check_bind("tcp://127.0.0.1:5555", None, insecure=False) is False
    server = ServerCurve.from_dir(keys(tmp_path))
    assert check_bind("tcp://0.0.0.0:5555", server, insecure=False) is True
    assert check_bind("tcp://127.0.0.1:5555", server, insecure=False) is False
    server.curve_on_loopback = True
    assert check_bind("tcp://127.0.0.1:5555", server, insecure=False) is True
    with pytest.raises(SecurityError, match="transport"):
        is_loopback("127.0.0.1:5555")
    # the endpoint refuses before binding anything
    with pytest.raises(InsecureBindError):
        ZmqLearnerEndpoint(CFG, control="tcp://*:0", weights="tcp://127.0.0.1:*")


def test_insecure_bind_names_the_config_keys_to_set(tmp_path: Path) -> None:
    """A learner told to bind every interface without keys (a real `looprl learner`) stops
    in one line naming the config keys a user sets: endpoints.keys (and the generators'
    --keys flag) or endpoints.insecure; both are real keys of the run config."""
    with pytest.raises(InsecureBindError) as err:
        check_bind("tcp://0.0.0.0:5555", None, insecure=False)
    for named in ("endpoints.keys=DIR", "endpoints.insecure=true", "looprl generator --keys DIR"):
        assert named in str(err.value), str(err.value)
    assert "insecure=True" not in str(err.value)
    cfg = load_config(None, ["endpoints.host=0.0.0.0", "endpoints.insecure=true",
                             f"endpoints.keys={keys(tmp_path)}"])  # fmt: skip
    assert cfg.endpoints.insecure and cfg.endpoints.keys

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "learner", "endpoints.host=0.0.0.0",
           f"run_dir={run_dir}", "metrics.progress=false", "metrics.tensorboard=false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    got = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr[-3000:]
    assert "Traceback" not in got.stderr
    errors = [ln for ln in got.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and got.stderr.rstrip().endswith(errors[0]), got.stderr[-3000:]
    line = errors[0]
    assert "refusing to bind tcp://0.0.0.0:" in line, line
    assert "set endpoints.keys=DIR" in line and "`looprl keys DIR`" in line, line
    assert "set endpoints.insecure=true" in line and "`looprl generator --keys DIR`" in line, line


def test_keys_cli_layout_and_modes(tmp_path: Path) -> None:
    d = keys(tmp_path, n=2)
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    assert files == [
        "allowed/generator-000.key",
        "allowed/generator-001.key",
        "generators/generator-000.key",
        "generators/generator-000.key_secret",
        "generators/generator-001.key",
        "generators/generator-001.key_secret",
        "learner.key",
        "learner.key_secret",
    ]
    for p in d.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    pub, sec = zmq.auth.load_certificate(d / "generators/generator-001.key_secret")
    assert zmq.auth.load_certificate(d / "allowed/generator-001.key")[0] == pub and sec
    with pytest.raises(SecurityError, match="--add"):
        keys_cli.create_keys(d, 1)
    learner = (d / "learner.key_secret").read_bytes()
    assert keys_cli.create_keys(d, 1, add=True) == [d / "generators/generator-002.key_secret"]
    assert (d / "learner.key_secret").read_bytes() == learner
    with pytest.raises(SecurityError, match="--add"):
        keys_cli.create_keys(tmp_path / "empty", 1, add=True)


def _client(ep: ZmqLearnerEndpoint, gid: str, curve: ClientCurve | None) -> ZmqGeneratorConnection:
    return ZmqGeneratorConnection(
        CFG,
        hello(gid),
        control=ep.endpoints["control"],
        weights=ep.endpoints["weights"],
        security=curve,
    )


def test_curve_admits_known_keys_and_refuses_others(tmp_path: Path) -> None:
    threads = threading.active_count()
    d = keys(tmp_path, n=1)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    _, stranger_secret = zmq.auth.create_certificates(stranger, "stranger")
    server = ServerCurve.from_dir(d, curve_on_loopback=True)
    ep = ZmqLearnerEndpoint(
        CFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*", security=server
    )
    assert threading.active_count() == threads + 1  # the ZAP authenticator thread
    good_curve = ClientCurve.from_dir(d, "generator-000", curve_on_loopback=True)
    wrong_server = ClientCurve(
        zmq.curve_keypair()[0], good_curve.public_key, good_curve.secret_key, True
    )
    conns = [
        _client(ep, "generator-000", good_curve),
        _client(ep, "nokey", None),
        _client(
            ep,
            "stranger",
            ClientCurve.from_files(d / "learner.key", stranger_secret, curve_on_loopback=True),
        ),  # fmt: skip
        _client(ep, "wrong-server", wrong_server),
    ]
    try:
        got = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            inc = ep.recv(0.05)
            if inc is not None:
                got.append((inc.peer, type(inc.record).__name__))
                if isinstance(inc.record, Hello):
                    ep.send(inc.peer, Welcome("run", inc.peer, 0, 0.1))
            for c in conns:
                c.recv(0)
        assert {p for p, _ in got} == {"generator-000"}  # nobody else got a single frame through
        assert ep.stats.unauthenticated >= 3  # each refused peer at least once (they retry)
        assert conns[0].ready and not any(c.ready for c in conns[1:])
        assert conns[0].send(RolloutBatch([rollout(gid="generator-000")]))  # still serving "good"
        end = time.monotonic() + 3
        while (inc := ep.recv(0.05)) is None or not isinstance(inc.record, RolloutBatch):
            assert time.monotonic() < end
    finally:
        for c in conns:
            c.close(None)
        ep.close()
    assert threading.active_count() == threads  # authenticator stopped


def _welcomed(ep: ZmqLearnerEndpoint, conns: list[ZmqGeneratorConnection], s: float) -> set[str]:
    """Serve Hellos for `s` seconds; the peers that got a frame through."""
    got, end = set(), time.monotonic() + s
    while time.monotonic() < end:
        inc = ep.recv(0.05)
        if inc is not None:
            got.add(inc.peer)
            if isinstance(inc.record, Hello):
                ep.send(inc.peer, Welcome("run", inc.peer, 0, 0.1))
        for c in conns:
            c.recv(0)
    return got


def test_keys_added_while_the_learner_runs_are_admitted(tmp_path: Path) -> None:
    """`looprl keys DIR --add` while the learner serves (a generator array job joining a
    running job): the new generator is welcomed without a restart, keyed to its own id; a
    key that was never added is still refused."""
    d = keys(tmp_path, n=1)
    server = ServerCurve.from_dir(d, curve_on_loopback=True)
    ep = ZmqLearnerEndpoint(
        CFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*", security=server
    )
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    _, stranger_secret = zmq.auth.create_certificates(stranger, "stranger")
    conns = [
        _client(
            ep, "generator-000", ClientCurve.from_dir(d, "generator-000", curve_on_loopback=True)
        )
    ]
    try:
        assert _welcomed(ep, conns, 0.8) == {"generator-000"}
        parser = argparse.ArgumentParser()
        keys_cli.add_parser(parser.add_subparsers())
        args = parser.parse_args(["keys", str(d), "--add", "--generators", "1"])
        assert args.func(args) == 0 and (d / "generators" / "generator-001.key_secret").is_file()
        conns += [
            _client(ep, "generator-001", ClientCurve.from_dir(d, "generator-001", curve_on_loopback=True)),
            _client(ep, "stranger", ClientCurve.from_files(d / "learner.key", stranger_secret,
                                                           curve_on_loopback=True)),
        ]  # fmt: skip
        assert _welcomed(ep, conns, 1.5) == {"generator-000", "generator-001"}
        assert conns[1].ready and not conns[2].ready
        assert ep.stats.unauthenticated >= 1  # the stranger, refused again after the re-read
    finally:
        for c in conns:
            c.close(None)
        ep.close()


def test_missing_keys_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="not found"):
        ServerCurve.from_dir(tmp_path)
    d = keys(tmp_path, n=1)
    with pytest.raises(SecurityError, match="not found"):
        ClientCurve.from_dir(d, "generator-007")
    with pytest.raises(SecurityError, match="no secret key"):
        ClientCurve.from_files(d / "learner.key", d / "allowed/generator-000.key")
