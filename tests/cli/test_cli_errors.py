"""Clear errors, no hangs: a generator with no learner to talk to, a busy port, a broken
model directory, a missing stream, and the generator command the learner prints."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.commands.learner_main import connect_host, generator_hint
from pipeline.config.run import load_config

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.random_init import init_checkpoint

    return Path(init_checkpoint("llama", "tiny", tmp_path_factory.mktemp("m") / "llama"))


def free_port() -> int:
    """A port with nothing listening on it or on port + 1."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no free port pair")


def generator_cmd(model: Path, learner: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "generator", "--learner", learner,
            "--model", str(model), "--reward-mode", "thread", "--connect-timeout", "4", *extra]  # fmt: skip


def _reports(text: str, endpoint: str) -> int:
    return len(re.findall(rf"waiting for the learner for \d+s at {re.escape(endpoint)}", text))


def _not_zmq(stop: threading.Event) -> tuple[int, threading.Thread, socket.socket]:
    """Something listening that is not a ZMQ peer (answers every connection with HTTP)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return int(srv.getsockname()[1]), t, srv


@pytest.fixture(scope="module")
def no_learner(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The three generators that find no learner, started together (each waits out its own
    4 s --connect-timeout; one after the other they took ~16 s): "closed" (nothing listens),
    "not_zmq" (an HTTP answerer on control and weights), "curve" (a CURVE learner, the
    generator without keys). Each test reads its own one's result (`finished`); every process
    is stopped by pid at the end."""
    from pipeline.net.security import ServerCurve
    from pipeline.net.transport.config import TransportConfig
    from pipeline.net.transport.zmq import ZmqLearnerEndpoint

    stop = threading.Event()
    http_port, server, srv = _not_zmq(stop)
    keys = tmp_path_factory.mktemp("curve") / "keys"
    assert main(["keys", str(keys), "-n", "1"]) == 0
    port = free_port()
    ctrl, wts = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    ep = ZmqLearnerEndpoint(TransportConfig(), control=ctrl, weights=wts,
                            security=ServerCurve.from_dir(keys, curve_on_loopback=True))  # fmt: skip
    closed, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{http_port}"
    cmds = {"closed": generator_cmd(model, closed),
            "not_zmq": generator_cmd(model, http, "--weights-endpoint", http),
            "curve": generator_cmd(model, ctrl)}  # fmt: skip
    procs: dict[str, tuple[subprocess.Popen[str], float]] = {}
    try:
        for name, cmd in cmds.items():
            procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True),
                           time.monotonic())  # fmt: skip
        yield {"procs": procs, "closed": closed, "not_zmq": http, "curve": (ctrl, wts),
               "keys": keys}  # fmt: skip
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        ep.close()
        stop.set()
        server.join(5)
        srv.close()


def finished(no_learner: dict[str, Any], name: str) -> tuple[subprocess.CompletedProcess, float]:
    """The generator ``name`` of `no_learner`, waited for: (its result, seconds it took)."""
    proc, t0 = no_learner["procs"][name]
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took


def test_generator_closed_port_says_so_and_exits_2(no_learner: dict[str, Any]) -> None:
    ep = no_learner["closed"]
    out, took = finished(no_learner, "closed")
    err = out.stderr
    assert out.returncode == 2, err[-3000:]
    assert _reports(err, ep) >= 2  # one line every second or so (timeout 4 s)
    assert f"no learner answered within 4s (--connect-timeout) at {ep} and" in err
    assert "connection refused" in err and "Traceback" not in err
    assert "CURVE" not in err  # nothing listens: keys are not the cause
    assert took < 60


def test_generator_wrong_port_says_handshake_failed(no_learner: dict[str, Any]) -> None:
    ep = no_learner["not_zmq"]
    out, _ = finished(no_learner, "not_zmq")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"no learner answered within 4s (--connect-timeout) at {ep}" in out.stderr
    assert "TCP connects but the ZMQ handshake fails (not a looprl learner" in out.stderr


def test_generator_without_keys_against_a_curve_learner(no_learner: dict[str, Any]) -> None:
    from pipeline.commands.generator_cli import probe_learner
    from pipeline.net.security import ClientCurve

    ctrl, wts = no_learner["curve"]
    out, _ = finished(no_learner, "curve")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"no learner answered within 4s (--connect-timeout) at {ctrl}" in out.stderr
    assert "this generator has no CURVE keys" in out.stderr and "--keys DIR" in out.stderr
    # the same learner answers a probe that has the keys
    client = ClientCurve.from_dir(no_learner["keys"], "generator-000", curve_on_loopback=True)
    t0 = time.monotonic()
    probe_learner({"control": ctrl, "weights": wts}, "g", client, timeout_s=10)
    assert time.monotonic() - t0 < 5


def test_learner_busy_port_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen(1)
        cmd = [sys.executable, "-m", "pipeline.cli", "learner", "backend=reference",
               "model.family=llama", f"endpoints.port={port}", f"run_dir={tmp_path / 'r'}"]  # fmt: skip
        out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ZMQError" not in out.stderr
    line = [x for x in out.stderr.splitlines() if "error:" in x]
    assert len(line) == 1 and f"tcp://127.0.0.1:{port}" in line[0]
    assert "Address already in use" in line[0]


@pytest.mark.parametrize(
    ("text", "want"),
    [("{}", "config field 'model_type' is missing"), ('{"model_type": "llama"', "not valid JSON"),
     ('{"model_type": "llama", "vocab_size": 8}', "is missing")],
)  # fmt: skip
def test_bad_model_config_names_file_and_field(
    text: str, want: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(text)
    import argparse

    from pipeline.commands.generator_cli import add_parser, run

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["generator", "--learner", "tcp://127.0.0.1:9", "--model", str(d)])
    assert run(args) == 2
    err = capsys.readouterr().err
    assert str(d / "config.json") in err and want in err, err
    assert (
        main(["learner", f"model.path={d}", f"run_dir={tmp_path / 'r'}", "backend=reference"]) == 2
    )
    err = capsys.readouterr().err
    assert str(d / "config.json") in err and want in err, err


def test_replay_missing_stream_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--stream", "/nonexistent/stream"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/stream: no such stream directory" in err
    (tmp_path / "stream").mkdir()
    assert main(["replay", "--stream", str(tmp_path / "stream")]) == 2
    assert f"{tmp_path / 'stream'}: not a looprl stream" in capsys.readouterr().err


def test_printed_generator_command_has_keys_and_a_reachable_address(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "-n", "1"]) == 0
    cfg = load_config(None, ["endpoints.host=0.0.0.0", f"endpoints.keys={keys}"])
    hint = generator_hint(cfg, "tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556", tmp_path / "m")
    there, why = connect_host("0.0.0.0")
    assert there not in ("0.0.0.0", "") and not there.startswith("127.")
    cmd = hint.splitlines()[1]
    assert f"--learner tcp://{there}:5555 --weights-endpoint tcp://{there}:5556" in cmd
    assert f"--keys {keys}" in cmd and "0.0.0.0" not in cmd
    assert hint.splitlines()[2] == f"  ({why})" and there in why
    loop = load_config(None, ["endpoints.host=127.0.0.1"])
    plain = generator_hint(loop, "tcp://127.0.0.1:7", "tcp://127.0.0.1:8", tmp_path)
    assert "--learner tcp://127.0.0.1:7 " in plain and "--keys" not in plain


def test_overrides_between_options_all_reach_the_command(capsys: pytest.CaptureFixture) -> None:
    """KEY=VALUE overrides in two runs around options (benchmarks/exit_pays.py's `looprl sft`
    call): both runs reach the config; a stray option is still argparse's error."""
    from pipeline.cli import parse

    a = parse(["sft", "--config", "c.yaml", "--out", "o", "model.size=tiny", "--lr=0.1",
               "warm_start.gate_lr=0.0003", "--steps", "2", "seed=4"])  # fmt: skip
    assert a.overrides == ["model.size=tiny", "warm_start.gate_lr=0.0003", "seed=4"]
    assert (a.lr, a.steps) == (0.1, 2)
    with pytest.raises(SystemExit) as e:
        parse(["sft", "--out", "o", "model.size=tiny", "--bogus", "seed=4"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes none
        parse(["model", "init", "--family", "llama", "out", "a=b"])
