"""objective.depth_cost (issue 23 item 3): reward minus cost x mean exit depth / full depth."""

from __future__ import annotations

import numpy as np
import pytest

from learner.config import ObjectiveConfig
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
