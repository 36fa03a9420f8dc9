"""objective.depth_cost: reward minus cost x mean exit depth / full depth."""

from __future__ import annotations

import numpy as np
import pytest

from learner.objective_config import ObjectiveConfig
from learner.shaping import depth_fraction, shape_rollouts
from proto.records import Rollout


def _rollout(i: int, depths: list[int], full: int, reward: float | None) -> Rollout:
    n = len(depths)
    return Rollout(f"w/{i}", "w", "p", i, "g", 5, prompt_tokens=np.array([1, 2], np.int32),
                   tokens=np.arange(3, 3 + n, dtype=np.int32),
                   logprobs=np.full(n, -1.0, np.float32), exit_depths=np.array(depths, np.uint8),
                   reward=reward, full_depth=full)  # fmt: skip


def test_depth_cost_takes_the_mean_depth_over_the_full_depth() -> None:
    rolls = [
        _rollout(0, [1, 2, 4, 1], 4, 1.0),  # mean 2 of D = 4: loses 0.5 c
        _rollout(1, [4, 4], 0, 0.5),  # an older stream: D = exit_depths[0] = 4, loses c
        _rollout(2, [], 4, 0.25),  # nothing generated: no compute, no cost
        _rollout(3, [2, 2], 8, None),  # a failed reward: the group's worst (0.25), then the cost
    ]
    assert [depth_fraction(r) for r in rolls] == [0.5, 1.0, 0.0, 0.25]
    out, failed = shape_rollouts(rolls, max_tokens=16, depth_cost=0.2)
    assert failed == 1
    assert [r.reward for r in out] == pytest.approx([0.9, 0.3, 0.25, 0.2], abs=1e-12)
    same, _ = shape_rollouts(rolls, max_tokens=16)  # depth_cost 0: the rewards as before
    assert [r.reward for r in same] == [1.0, 0.5, 0.25, 0.25]


def test_depth_cost_is_checked() -> None:
    assert ObjectiveConfig(depth_cost=0.1).depth_cost == 0.1
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="depth_cost"):
            ObjectiveConfig(depth_cost=bad)


def _advantages(rewards: list[float], depths: list[list[int]], cost: float, where: str,
                normalize_std: bool = True) -> list[float]:  # fmt: skip
    """One group's per-row advantage through the step's own path: shaping, then
    learner.batching.step_advantages with the objective's options."""
    import torch

    from learner.batching import build_batch, sort_rollouts, step_advantages

    obj = ObjectiveConfig(depth_cost=cost, depth_cost_in=where, normalize_std=normalize_std)
    rolls = [_rollout(i, d, 4, r) for i, (r, d) in enumerate(zip(rewards, depths))]
    shaped, _ = shape_rollouts(rolls, max_tokens=16,
                               depth_cost=cost if where == "reward" else 0.0)  # fmt: skip
    batch = build_batch(shaped)
    frac = torch.tensor([depth_fraction(r) for r in sort_rollouts(shaped)], dtype=torch.float64)
    batch.extra["depth_fraction"] = frac[:, None].expand(batch.size, batch.length)
    adv, _ = step_advantages(batch, None, **obj.advantage_options())
    return [float(adv[i][batch.mask[i] > 0][0]) for i in range(batch.size)]


DEPTHS = [[4, 4], [2, 2], [1, 1], [1, 1]]  # f = 1, 0.5, 0.25, 0.25; group mean 0.5


def test_in_the_reward_the_std_normalisation_erases_the_cost_scale() -> None:
    """A group whose samples all score 0: in the reward, the depth cost is all the group's
    spread, and GRPO's std normalisation makes the advantages the same for any cost (the
    collapse benchmarks/loop_credit.py measured); in the advantage it stays in reward units."""
    a = _advantages([0.0] * 4, DEPTHS, 0.2, "reward")
    b = _advantages([0.0] * 4, DEPTHS, 0.05, "reward")
    assert a == pytest.approx(b, rel=1e-3) and abs(a[0]) > 1.0  # a 4x cost: equal but for eps
    for cost in (0.2, 0.05):
        got = _advantages([0.0] * 4, DEPTHS, cost, "advantage")
        assert got == pytest.approx([-cost * 0.5, 0.0, cost * 0.25, cost * 0.25], abs=1e-7)


def test_in_the_advantage_the_task_part_is_grpos_own() -> None:
    """Mixed rewards: GRPO's normalised advantage of the task reward alone, minus cost x the
    centred depth fraction; a group of one gets no cost."""
    r = [1.0, 0.0, 0.0, 1.0]
    task = _advantages(r, DEPTHS, 0.0, "reward")
    got = _advantages(r, DEPTHS, 0.3, "advantage")
    want = [t - 0.3 * (f - 0.5) for t, f in zip(task, [1.0, 0.5, 0.25, 0.25])]
    assert got == pytest.approx(want, abs=1e-6)
    assert task[0] == pytest.approx(0.5 / (1 / 3) ** 0.5, rel=1e-4)  # the group std, n - 1
    assert _advantages([1.0], [[4, 1]], 0.3, "advantage") == [0.0]


def test_depth_cost_in_is_checked() -> None:
    for kw, why in (
        ({"depth_cost_in": "tokens", "depth_cost": 0.1}, "must be one of"),
        ({"depth_cost_in": "advantage"}, "depth_cost > 0 only"),
        ({"depth_cost_in": "advantage", "depth_cost": 0.1, "kind": "ppo"}, "group estimator"),
        ({"depth_cost_in": "advantage", "depth_cost": 0.1, "advantage_estimator": "reinforce_pp"},
         "group estimator"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            ObjectiveConfig(**kw)  # type: ignore[arg-type]
