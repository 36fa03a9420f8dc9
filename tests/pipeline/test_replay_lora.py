"""`looprl replay` of a LoRA run (learner.lora.rank > 0) in numerics exact: the live run (real
learner, megatron or reference backend, one real generator process, 3 steps) published merged
weights (docs/LEARNER.md "LoRA"), and replay from its stream reaches every version's digest bit
for bit, the adapters' included (a published weight is its base plus (alpha / r) B A)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.commands.learner_main import resolve_config
from pipeline.commands.replay_main import replay
from tests.pipeline.e2e_utils import check_run, run, small_config


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "reference"])
def test_lora_replay_reaches_the_live_digests(tmp_path: Path, backend: str) -> None:
    live = tmp_path / "live"
    cfg = small_config(live, "steps=3", "generators.count=1", "staleness.max_staleness=1",
                       f"backend={backend}", "numerics=exact", "learner.lora.rank=4",
                       "optimizer.lr=3e-2")  # fmt: skip
    s = run(cfg)
    check_run(live, 4, 3, max_staleness=1)
    assert resolve_config(None, str(live), []).learner.lora.rank == 4  # what replay rebuilds
    res = replay(live / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
    assert res["3"][1] == s["final_digest"]
    assert len({want for want, _ in res.values()}) == 3  # every version moved the weights
