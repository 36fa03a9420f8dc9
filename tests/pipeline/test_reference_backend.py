"""Every learner.* key is honoured by the reference backend or refused with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.config.run import load_config


def test_reference_refuses_the_checkpoints_truncated_backprop(tmp_path: Path) -> None:
    from models.random_init import init_checkpoint
    from pipeline.backends.reference_trainer import ReferenceTrainer

    init_checkpoint("huginn", "tiny", tmp_path / "m", seed=0)
    cfg_path = tmp_path / "m" / "config.json"
    d = json.loads(cfg_path.read_text())
    d["mean_backprop_depth"] = 2  # below the tiny model's depth
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="learner.backprop_depth=0"):
        ReferenceTrainer(load_config(None, ["backend=reference"]), tmp_path / "m")
    ReferenceTrainer(load_config(None, ["backend=reference", "learner.backprop_depth=0"]),
                     tmp_path / "m")  # fmt: skip
    for key in ("learner.precision=bf16", "learner.backprop_depth=2", "learner.compile=true"):
        with pytest.raises(ConfigError, match="backend=reference"):
            load_config(None, ["backend=reference", key])
