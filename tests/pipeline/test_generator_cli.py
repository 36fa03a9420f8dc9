"""``looprl generator`` command line: options, config file validation, precedence (no vLLM)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from generator.config import GeneratorConfig
from models.errors import ConfigError
from models.exits import KL
from pipeline.commands.generator_cli import (
    add_parser,
    config_from_args,
    flag_name,
    run,
    weights_endpoint_for,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="looprl")
    add_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_help_lists_every_option_with_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["generator", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    names = [flag_name(f.name) for f in fields(GeneratorConfig)]
    for flag in ["--config", *names]:
        assert flag in text, flag
    for flag in ("--learner", "--model", "--generator-id", "--max-inflight", "--numerics",
                 "--keys", "--reward", "--reward-timeout"):  # fmt: skip
        assert flag in names  # the names the docs promise
    assert text.count("(default:") == len(names)  # every field's flag has help + default
    assert "{fast,exact}" in text


def test_bad_config_key_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "gen.yaml"
    cfg.write_text("learner: tcp://127.0.0.1:5555\nmax_inflite: 8\n")
    args = parser().parse_args(["generator", "--config", str(cfg)])
    with pytest.raises(ConfigError, match="unknown generator config key 'max_inflite'"):
        config_from_args(args)
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "max_inflite" in err and str(cfg) in err and "max_inflight" in err  # known keys


def test_bad_values_and_missing_learner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "gen.yaml"
    cfg.write_text("max_inflight: many\n")
    with pytest.raises(ConfigError, match="max_inflight"):
        config_from_args(parser().parse_args(["generator", "--config", str(cfg)]))
    with pytest.raises(ConfigError, match="reward_timeout_s"):
        config_from_args(parser().parse_args(["generator", "--reward-timeout", "0"]))
    assert run(parser().parse_args(["generator", "--model", "x"])) == 2
    assert "learner endpoint is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["generator", "--numerics", "approximate"])


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(
        "learner: tcp://a:1\nmax_inflight: 8\nreward: numeric\ncurve_on_loopback: true\n"
    )
    args = parser().parse_args(
        ["generator", "--config", str(cfg), "--max-inflight", "3", "--no-curve-on-loopback",
         "--reward-timeout", "2.5", "--exit-policy", '{"kind": "kl", "threshold": 0.1}']
    )  # fmt: skip
    got = config_from_args(args)
    assert (got.learner, got.max_inflight, got.reward) == ("tcp://a:1", 3, "numeric")
    assert got.reward_timeout_s == 2.5 and got.curve_on_loopback is False
    assert got.exit_policy == KL(0.1)
    assert config_from_args(parser().parse_args(["generator"])) == GeneratorConfig()


def test_weights_endpoint_default() -> None:
    assert weights_endpoint_for("tcp://10.0.0.5:5555") == "tcp://10.0.0.5:5556"
    assert weights_endpoint_for("tcp://[::1]:7000") == "tcp://[::1]:7001"
    assert weights_endpoint_for("ipc:///tmp/learner") == "ipc:///tmp/learner-weights"
    with pytest.raises(ConfigError, match="HOST:PORT"):
        weights_endpoint_for("tcp://host")


def test_connection_without_welcome_reports_then_times_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The generator side of the transport: no Welcome -> one line naming the target every
    second (timeout 2 s), then ConnectTimeout from recv; a Welcome ends the watch."""
    import time

    from pipeline.net.transport.config import ConnectTimeout, TransportConfig
    from pipeline.net.transport.memory import MemoryNetwork
    from proto.records import Hello

    net = MemoryNetwork()
    conn = net.connect("learner", Hello("g0", "host", 1, ["llama"], 1, 0, 0.0), TransportConfig())
    conn.watch_connect(2.0, "mem://learner", "; maybe the cause")
    t0 = time.monotonic()
    with caplog.at_level("WARNING"), pytest.raises(ConnectTimeout, match="mem://learner") as e:
        while time.monotonic() - t0 < 10:
            conn.recv(0.1)
    assert 2.0 <= time.monotonic() - t0 < 3.0
    assert "no answer from mem://learner after 2s (no reply to Hello); maybe the cause" in str(
        e.value
    )
    lines = [
        r.getMessage() for r in caplog.records if "no answer from mem://learner" in r.getMessage()
    ]
    assert len(lines) >= 1 and all("; still trying" in x for x in lines)

    net = MemoryNetwork()
    ep = net.bind("learner")  # a learner that answers: no timeout after its Welcome
    conn2 = net.connect("learner", Hello("g1", "host", 1, ["llama"], 1, 0, 0.0), TransportConfig())
    conn2.watch_connect(1.0, "mem://learner")
    inc = ep.recv(1.0)
    assert inc is not None and inc.peer == "g1"
    from proto.records import Welcome

    ep.send("g1", Welcome("run", "g1", 0, 2.0, {}))
    t1 = time.monotonic()
    while time.monotonic() - t1 < 2.0:
        conn2.recv(0.1)
    assert conn2.ready


def test_a_pruned_version_is_superseded_not_a_reason_to_stop(tmp_path: Path) -> None:
    """A shared_fs announce whose directory was pruned while the generator was paused is
    refused without stopping it (a newer v<N> stands beside it); a directory the generator
    cannot see at all (no shared filesystem) still stops it."""
    from pipeline.commands.generator_engine import superseded

    weights = tmp_path / "weights"
    (weights / "v5").mkdir(parents=True)
    assert superseded(str(weights / "v2"), 2)
    assert not superseded(str(weights / "v7"), 7)  # missing, but nothing newer: a real failure
    (weights / "v2").mkdir()
    assert not superseded(str(weights / "v2"), 2)  # present: its load error is real
    assert not superseded(str(tmp_path / "elsewhere" / "weights" / "v2"), 2)
    assert not superseded("", 2)  # a set in memory: no directory to miss
