"""objective.dynamic_sampling with rollout.n=1 once dropped every group (one sample
always has one distinct reward), so no batch ever formed and the run waited out max_wait_s.
The run config now refuses the combination at load, in one line naming both keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.cli import main
from pipeline.config.run import load_config

BAD = ["rollout.n=1", "objective.dynamic_sampling=true"]


def test_load_config_refuses_dynamic_sampling_with_one_sample() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, BAD)
    msg = str(e.value)
    assert "\n" not in msg and "objective.dynamic_sampling" in msg and "rollout.n" in msg
    # either alone is fine, and so is dynamic sampling with two samples per prompt
    assert load_config(None, ["rollout.n=1"]).rollout.n == 1
    assert load_config(None, ["rollout.n=2", "objective.dynamic_sampling=true"]).rollout.n == 2


@pytest.mark.parametrize("cmd", ["learner", "run"])
def test_cli_exits_2_naming_both_keys(
    cmd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([cmd, f"run_dir={tmp_path / 'run'}", *BAD]) == 2
    assert not (tmp_path / "run").exists()  # refused before anything started
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "objective.dynamic_sampling" in err[0] and "rollout.n" in err[0]


def test_intake_refuses_it_too() -> None:
    from pipeline.core.intake import Intake

    with pytest.raises(ValueError, match="rollout.n=1"):
        Intake(ledger=None, gate=None, dispatcher=None, record=print, n=1, limits=None,  # type: ignore[arg-type]
               rules=None, quarantine=None, version=lambda: 0, dynamic_sampling=True)  # type: ignore[arg-type]  # fmt: skip
