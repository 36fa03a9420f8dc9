"""`looprl model init` and `looprl stream inspect` through the top-level CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.checkpoint import load_checkpoint
from models.config import config_from_hf_dict
from pipeline.cli import main
from proto.codec import Codec
from proto.records import Rollout, RolloutBatch
from proto.stream.writer import StreamWriter


@pytest.mark.parametrize("family", ["huginn", "ouro", "nanbeige", "llama"])
def test_model_init_writes_a_loadable_checkpoint(family: str, tmp_path: Path) -> None:
    out = tmp_path / family
    assert main(["model", "init", "--family", family, "--size", "tiny", str(out)]) == 0
    config_dict, state = load_checkpoint(out)
    config = config_from_hf_dict(config_dict)
    assert config.family == family
    assert config.head_dim == 32  # what vLLM's CPU attention needs
    assert (out / "tokenizer.json").is_file() and state


def test_model_init_unknown_family_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["model", "init", "--family", "gpt5", str(tmp_path / "x")])
    assert e.value.code == 2


def test_stream_inspect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    codec = Codec()
    with StreamWriter(tmp_path / "s") as w:
        for v in range(3):
            r = Rollout(
                rollout_id=f"w{v}/0", work_id=f"w{v}", prompt_id="p", sample_index=0,
                generator_id=f"gen-{v % 2}", latent_seed=v, prompt_tokens=np.arange(1, 5, dtype=np.int32),
                tokens=np.arange(64, dtype=np.int32), logprobs=np.full(64, -0.25, np.float32),
                exit_depths=np.full(64, 3, np.uint8), weight_version=v,
            )  # fmt: skip
            w.append(codec.encode(RolloutBatch([r])))
    assert main(["stream", "inspect", str(tmp_path / "s"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    text = json.dumps(summary)
    assert summary["frames"] == 3
    assert "gen-0" in text and "gen-1" in text
