"""`looprl learner / run / replay / generator` are registered; bad settings exit 2 naming
the key, before anything heavy starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import build_parser, main


def test_subcommands_registered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for cmd in ("learner", "run", "replay", "generator", "stream", "keys", "model"):
        assert cmd in out


@pytest.mark.parametrize("cmd", ["learner", "run"])
def test_bad_config_exits_2(cmd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  grop_size: 3\n")
    assert main([cmd, "--config", str(bad)]) == 2
    assert "rollout.grop_size" in capsys.readouterr().err
    assert main([cmd, "staleness.policy=sometimes"]) == 2
    assert "staleness.policy" in capsys.readouterr().err


def test_resume_without_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["learner", "--resume", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_replay_without_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--stream", str(tmp_path / "stream")]) == 2
    assert "error" in capsys.readouterr().err
