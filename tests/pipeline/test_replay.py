"""`looprl replay`: a recorded run trained again from its stream reaches the same weights.

test_replay_fake_free: a live run (real learner, megatron or reference backend, one real
generator process, 3 steps), then replay from its stream: every published version's
canonical digest equals the live one. (The 120-step quickstart replays identically too:
docs/PIPELINE.md.)
test_replay_errors: what replay refuses (a step log naming rollouts the stream lacks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.commands.replay_main import replay
from pipeline.config import ConfigError
from tests.pipeline.e2e_utils import check_run, run, small_config


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "reference"])
def test_replay_fake_free(tmp_path: Path, backend: str) -> None:
    live = tmp_path / "live"
    cfg = small_config(live, "steps=3", "generators.count=1", "staleness.max_staleness=1",
                       f"backend={backend}")  # fmt: skip
    s = run(cfg)
    check_run(live, 4, 3, max_staleness=1)
    res = replay(live / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
    assert res["3"][1] == s["final_digest"]


def test_replay_errors(tmp_path: Path) -> None:
    from pipeline.core.recorder import Recorder, StepRecord

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from pipeline.config import RunConfig, to_yaml

    (run_dir / "config.yaml").write_text(to_yaml(RunConfig(run_dir=str(run_dir))))
    rec = Recorder(run_dir)
    rec.log_step(StepRecord(1, 0, ["w0/0"], [False], 1))
    rec.close()
    with pytest.raises(ConfigError, match="not in the stream"):
        replay(run_dir / "stream", tmp_path / "out")
    (run_dir / "steps.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no training steps"):
        replay(run_dir / "stream", tmp_path / "out")
