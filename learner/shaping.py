"""Reward shaping: the one place the rewards a step trains on are made from the rollouts'.

Applied by `learner.step.LearnerStep.step` (live training and `looprl replay` alike, both
policies), in this order:

1. **Failed rewards** (``reward`` None: the reward function raised or timed out) count as the
   worst reward of their group (0.0 when the whole group failed): `shape_rollouts`.
2. **Soft overlong penalty** (DAPO; ``objective.overlong_buffer`` > 0): a completion whose length
   L passes ``max_tokens - overlong_buffer`` loses ``overlong_penalty`` x (L - (max_tokens -
   overlong_buffer)) / overlong_buffer, the whole penalty at max_tokens: `shape_rollouts`.
3. **Depth cost** (``objective.depth_cost`` > 0; docs/OBJECTIVES.md): every completion's
   reward loses ``depth_cost`` x mean_t(exit_depths[t]) / D, D = the run's full depth (``Rollout.full_depth``;
   ``exit_depths[0]`` in older streams): compute spent as a fraction of the most the policy
   allows, so a cost c makes always thinking to D worth c of reward: `shape_rollouts`.
4. **KL penalty** (``objective.kl_in_reward``), once the frozen reference's log-probs exist (the
   step's pre-update pass): per sequence, the row's summed KL estimate comes off its reward and
   off the token reward at its last response position; per token, each response token's reward
   loses its own estimate and the row's reward their sum: `penalise_kl`.

The recorded stream keeps the generators' raw rewards, so a replay shapes them the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from learner.batching import TrainBatch
from proto.records import Rollout


def shape_rollouts(
    rolls: Sequence[Rollout],
    *,
    max_tokens: int,
    overlong_buffer: int = 0,
    overlong_penalty: float = 1.0,
    depth_cost: float = 0.0,
) -> tuple[list[Rollout], int]:
    """Steps 1 to 3 of the module docstring on ``rolls`` (new Rollout objects where a reward
    changes; the order kept). Returns (rollouts, how many rewards had failed)."""
    worst: dict[str, float] = {}
    for r in rolls:
        if r.reward is not None:
            worst[r.work_id] = min(worst.get(r.work_id, r.reward), r.reward)
    out, failed = [], 0
    for r in rolls:
        if r.reward is None:
            failed += 1
            r = dataclasses.replace(r, reward=worst.get(r.work_id, 0.0))
        out.append(r)
    if overlong_buffer > 0:
        if max_tokens < overlong_buffer:
            raise ValueError(f"overlong penalty: max_tokens ({max_tokens}) must be >= "
                             f"objective.overlong_buffer ({overlong_buffer})")  # fmt: skip
        start = max_tokens - overlong_buffer
        out = [
            dataclasses.replace(r, reward=float(r.reward or 0.0) - overlong_penalty
                                * min(model_tokens(r) - start, overlong_buffer) / overlong_buffer)
            if model_tokens(r) > start else r
            for r in out
        ]  # fmt: skip
    if depth_cost > 0:
        out = [dataclasses.replace(r, reward=float(r.reward or 0.0) - depth_cost * depth_fraction(r))
               if r.num_tokens else r for r in out]  # fmt: skip
    return out, failed


def model_tokens(r: Rollout) -> int:
    """Tokens the model sampled: all of a single-turn completion, a conversation's mask-1 ones
    (its environment tokens are not the model's length)."""
    return r.num_tokens if r.token_mask is None else int((r.token_mask == 1).sum())


def depth_fraction(r: Rollout) -> float:
    """mean_t exit_depths[t] / D over the model's tokens (D: ``full_depth``, or
    ``exit_depths[0]`` in older streams), in fp64; 0 for an empty completion."""
    if not r.num_tokens:
        return 0.0
    full = int(r.full_depth) or int(r.exit_depths[0])
    depths = r.exit_depths if r.token_mask is None else r.exit_depths[r.token_mask == 1]
    return float(depths.astype("float64").mean()) / full if depths.size else 0.0


def penalise_kl(batch: TrainBatch, pen: Tensor, coef: float, level: str = "sequence") -> float:
    """Step 4 of the module docstring, in place on ``batch``: ``pen`` is the KL estimator in
    fp64, [B] the per-row sum (``level`` sequence) or [B, L] per token, 0 off the response
    (``level`` token: verl's, AReaL's and TRL's PPO reward shaping; the row's rewards lose the
    row's sum, so the group estimators see the sequence level's rewards). Returns the mean
    per-token estimate (train/kl_ref)."""
    live = batch.mask > 0
    ntok = live.sum(dim=1).clamp_min(1)
    if level == "token":
        pen = torch.where(live, pen, 0.0)
        row = pen.sum(dim=1)
        batch.rewards = batch.rewards - (coef * row).float()
        batch.token_rewards = batch.token_rewards - (coef * pen).float()
        return float((row / ntok).mean())
    if level != "sequence":
        raise ValueError(f"kl penalty level: expected 'sequence' or 'token', got {level!r}")
    delta = (coef * pen).float()
    batch.rewards = batch.rewards - delta
    last = live.float().cumsum(dim=1).argmax(dim=1)
    tr = batch.token_rewards.clone()
    tr[torch.arange(batch.size), last] -= delta
    batch.token_rewards = tr
    return float((pen / ntok).mean())
