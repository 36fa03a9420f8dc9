"""The run config -> the learner's typed configs, for both backends (one mapping).

A trainer receives these, never the RunConfig: `train_config` (learner.config.TrainConfig: the
step's batch, micro-batch, objective, sampling, numerics), `critic_optim` (the critic's
optimizer and schedule), and `check_reference` (model.reference_path must be the policy's
model). The run config's objective / optimizer / schedule / learner sections are learner.config's
own classes, handed over as they are.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from pipeline.config import ConfigError, RunConfig

__all__ = ["check_reference", "critic_optim", "micro_batch_size", "train_config"]


def train_config(cfg: RunConfig, batch: int | None = None) -> TrainConfig:
    """TrainConfig of ``cfg``: ``batch`` (default: the step's rollouts / objective.minibatches)
    sequences per optimizer update, learner.micro_batch_size (0: `micro_batch_size`) per
    forward/backward. Both backends step by it."""
    o, r, lr = cfg.objective, cfg.rollout, cfg.learner
    if batch is None:
        batch = r.prompts_per_step * r.n // o.minibatches  # one optimizer update each
    return TrainConfig(
        global_batch_size=batch, micro_batch_size=lr.micro_batch_size or micro_batch_size(batch, r.n),
        seed=cfg.seed, objective=o, sampling=r.sampling, recompute=lr.recompute,
        max_tokens=r.max_tokens,
        fused_token_stats=cfg.numerics == "fast", numerics=cfg.numerics,
    )  # fmt: skip


def micro_batch_size(batch: int, n: int) -> int:
    """Micro-batch size: the group size if it divides the batch (it does), at most 16."""
    m = min(n, 16)
    while batch % m:
        m -= 1
    return m


def critic_optim(cfg: RunConfig) -> tuple[OptimConfig, ScheduleConfig]:
    """The critic's optimizer (optimizer.critic_lr, its own clip) and its LR schedule (the
    run's, with min_lr no larger than the critic's LR)."""
    schedule = cfg.resolved_schedule()
    optim = cfg.optimizer.for_critic()
    return optim, dataclasses.replace(schedule, min_lr=min(schedule.min_lr, optim.lr))


def check_reference(ref_config: Any, config: Any, ref_dir: Path) -> None:
    """The reference policy must be the same model (family and shapes) as the policy."""
    if ref_config.to_hf_dict() != config.to_hf_dict():
        raise ConfigError(f"model.reference_path {ref_dir}: its config.json is not the policy's "
                          "(the reference policy must be the same model)")  # fmt: skip
