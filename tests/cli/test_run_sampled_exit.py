"""A sampled exit through the whole system: `looprl run` with a tiny Ouro,
rollout.exit_policy kind sampled_gate and the exit term, backend reference, one real vLLM
generator. The generator draws every token's exit from the gate and claims its log-prob; the
door admits only rollouts that carry the claims; the learner recomputes them (no honest
rollout is refused) and trains the gate with the exit term."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from models.random_init import init_checkpoint
from pipeline.core.recorder import read_rollouts
from tests.cli.test_run_llama import looprl_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_run_trains_a_sampled_exit(tmp_path: Path) -> None:
    model = init_checkpoint("ouro", "tiny", tmp_path / "ouro")
    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(
        run_dir, f"model.path={model}", "steps=4", "generators.count=1", "backend=reference",
        "rollout.exit_policy={kind: sampled_gate}", "objective.exit_coef=0.5",
        "objective.exit_entropy_coef=0.01", timeout_s=600,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    rolls = [r for _, r in read_rollouts(run_dir / "stream")]
    assert len(rolls) >= 4 * 16 * 8 // 2
    depths: set[int] = set()
    for r in rolls:  # every rollout claims its exits, one finite log-prob <= 0 per token
        assert r.exit_logprobs is not None and r.exit_logprobs.shape == r.tokens.shape
        assert all(math.isfinite(x) and x <= 0 for x in r.exit_logprobs.tolist())
        depths |= set(r.exit_depths.tolist())
    assert depths == {1, 2, 3, 4}, depths  # sampled: every exit of the 4-loop model occurs
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["refused_total"] == 0, r  # the learner's recomputation agrees with the claims
        assert r["train/exit_entropy"] > 0.1 and r["train/exit_logp"] < 0, r
        assert math.isfinite(r["train/exit_loss"]) and 0.5 < r["train/exit_ratio_mean"] < 2.0
    print(f"\nsampled exit run: 4 steps in {wall:.0f} s, {len(rolls)} rollouts, exit entropy "
          f"{rows[0]['train/exit_entropy']:.3f} -> {rows[-1]['train/exit_entropy']:.3f}")  # fmt: skip
