"""Loop-aware RL through the whole system: a run with a tiny Ouro and one real vLLM
generator drawing every token's exit from the gate (rollout.exit_policy sampled_gate), per-loop
credit (objective.loop_weighting), the exit term and a depth cost, in each learner policy; then
`looprl replay` of its stream reaches the same weights, version by version.

Before this, per-loop credit with a sampled exit stopped the learner at its first step (the
per-loop forwards gave no exit log-probs: a KeyError); tests/learner/test_policies_ragged.py
checks the two policies agree bit for bit on these terms."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from learner.shaping import depth_fraction
from models.random_init import init_checkpoint
from pipeline.commands.replay_main import replay
from pipeline.core.metrics import read_metrics
from pipeline.core.recorder import read_rollouts, read_steps
from tests.pipeline.e2e_utils import check_run, run, small_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COST = 0.3


@pytest.mark.parametrize(("backend", "weighting", "cost_in", "packed"), [
    ("megatron", "exit_pdf", "reward", 512), ("reference", "learned", "advantage", 0)])  # fmt: skip
def test_loop_credit_with_a_sampled_exit_and_a_depth_cost(
    tmp_path: Path, backend: str, weighting: str, cost_in: str, packed: int
) -> None:
    """``packed``: learner.max_tokens_per_micro (megatron: the per-loop and sampled-exit
    forwards on packed rows, in the run and in its replay)."""
    model = init_checkpoint("ouro", "tiny", tmp_path / "ouro")
    live = tmp_path / "live"
    cfg = small_config(live, f"model.path={model}", "steps=3", "generators.count=1",
                       "staleness.max_staleness=1", f"backend={backend}",
                       "rollout.exit_policy={kind: sampled_gate}", "objective.exit_coef=0.5",
                       "objective.exit_entropy_coef=0.01", f"objective.depth_cost={COST}",
                       f"objective.loop_weighting={weighting}", "objective.kl_coef=0.01",
                       f"objective.depth_cost_in={cost_in}",
                       "learner.backprop_depth=0",
                       f"learner.max_tokens_per_micro={packed}")  # fmt: skip
    run(cfg)
    rows = check_run(live, 4, 3, max_staleness=1)
    by_id = {r.rollout_id: r for _, r in read_rollouts(live / "stream")}
    depths = {int(d) for r in by_id.values() for d in r.exit_depths}
    assert depths == {1, 2, 3, 4}, depths  # sampled: every exit of the 4-loop model occurs
    for row, step in zip(rows, read_steps(live / "steps.jsonl")):
        assert row["refused_total"] == 0, row  # the learner's recomputation matches the claims
        assert row["train/exit_entropy"] > 0.1 and math.isfinite(row["train/exit_loss"]), row
        # per-loop credit: the credited loop's mean sits below the exit loop (weights over 1..e_t)
        assert 1.0 <= row["train/loop_depth_mean"] < 4.0, row
        # the depth cost in the reward: each reward minus COST x mean exit depth / 4, what the
        # update trained on; in the advantage: the rewards untouched (the cost is in A)
        trained = [by_id[i] for i in step.rollout_ids]
        c = COST if cost_in == "reward" else 0.0
        want = sum(float(r.reward or 0.0) - c * depth_fraction(r) for r in trained)
        assert math.isclose(row["train/reward_mean"], want / len(trained), abs_tol=1e-6), row
        assert min(depth_fraction(r) for r in trained) < 1.0
    res = replay(live / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want_d, got_d) in res.items():
        assert want_d == got_d, f"v{version}: live {want_d} != replay {got_d}"
    assert read_metrics(live / "metrics.jsonl")[-1]["step"] == 3
