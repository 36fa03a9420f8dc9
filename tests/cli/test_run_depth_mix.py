"""The mixed-depth task through the whole system: `looprl run --config configs/depth_mix.yaml`
(a tiny Ouro, one torch-engine generator drawing each token's exit from the gate) with
exit_pdf credit carrying the gate's gradient (objective.exit_pdf_gradient), in each learner
backend, with eval rounds at each fixed depth of eval.depths (their items run FixedDepth and
claim no exit log-probs: before, the door refused them on a sampled-exit run and dropped the
generator); then `looprl replay` of its stream reaches the same weights, version by version.
About a minute a backend on the 2-core host."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.commands.replay_main import replay
from pipeline.core.metrics import read_metrics
from pipeline.core.recorder import read_rollouts
from tests.cli.test_run_llama import REPO, looprl_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["megatron", "reference"])
def test_depth_mix_with_exit_pdf_gradient_replays(tmp_path: Path, backend: str) -> None:
    live = tmp_path / "live"
    code, err, _ = looprl_run(
        live, "steps=3", "generators.count=1", "generators.engine=torch",
        "warm_start.segments=[5]", "warm_start.gate_steps=2", "eval.every=3", "eval.limit=4", "rollout.prompts_per_step=4", "rollout.n=4",
        f"backend={backend}", "objective.loop_weighting=exit_pdf",
        "objective.exit_pdf_gradient=true", "rollout.exit_policy={kind: sampled_gate}",
        "objective.exit_coef=0.5", "learner.backprop_depth=0",
        timeout_s=600, config=REPO / "configs" / "depth_mix.yaml",
    )  # fmt: skip
    assert code == 0, err[-3000:]
    rows = read_metrics(live / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    rolls = [r for _, r in read_rollouts(live / "stream")]
    assert {int(d) for r in rolls for d in r.exit_depths} == {1, 2, 3, 4}  # sampled exits
    assert {float(r.reward or 0.0) for r in rolls} <= {0.0, 1.0}  # the task's reward
    for row in rows:
        assert row["refused_total"] == 0, row
        assert 1.0 <= row["train/loop_depth_mean"] < 4.0, row  # weights over 1..e_t
    for d in (1, 2, 3, 4):  # the config's eval.depths, each round (before step 1, after 3)
        assert rows[0][f"eval/mean_depth@{d}"] == rows[-1][f"eval/mean_depth@{d}"] == float(d)
    assert rows[-1]["eval/prompts"] == 4 and rows[-1]["eval/mean_depth"] < 4.0  # sampled
    res = replay(live / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
