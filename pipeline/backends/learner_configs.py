"""The run config -> the learner's typed configs, for both backends (one mapping).

A trainer receives these, never the RunConfig: `train_config` (learner.config.TrainConfig: the
step's batch, micro-batch, objective, sampling, numerics), `critic_optim` (the critic's
optimizer and schedule), and `check_reference` (model.reference_path must be the policy's
model). The run config's objective / optimizer / schedule / learner sections are learner.config's
own classes, handed over as they are.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from generator.rewards import synthetic_task_prompts
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from models.errors import ConfigError
from models.exits import SampledGate
from pipeline.config.run import RunConfig

__all__ = [
    "MICRO_BATCH_TOKENS", "check_reference", "critic_optim", "micro_batch_size", "row_tokens",
    "train_config",
]  # fmt: skip

log = logging.getLogger(__name__)
_warned: set[tuple[str, int]] = set()

MICRO_BATCH_TOKENS = 16384
"""The automatic micro-batch's bound: at most this many token positions (rows x the longest
row a run can produce) per forward/backward, so its activations and logits stay bounded."""


def train_config(cfg: RunConfig, batch: int | None = None) -> TrainConfig:
    """TrainConfig of ``cfg``: ``batch`` (default: the step's rollouts / objective.minibatches)
    sequences per optimizer update, learner.micro_batch_size (0: `micro_batch_size`) per
    forward/backward. Both backends step by it."""
    o, r, lr = cfg.objective, cfg.rollout, cfg.learner
    policy = r.parsed_policy
    if batch is None:
        batch = r.prompts_per_step * r.n // o.minibatches  # one optimizer update each
    dp = dist.get_world_size() // cfg.tp if dist.is_available() and dist.is_initialized() else 1
    longest = row_tokens(cfg)
    packed = lr.packed_tokens
    if packed and longest is not None and packed < longest:
        raise ConfigError(f"learner.max_tokens_per_micro={packed}: must hold "
                          f"the longest row the run can produce ({longest} tokens: the prompt "
                          "+ rollout.max_tokens)")  # fmt: skip
    # packed micro-batches are cut by tokens: micro_batch_size only has to divide the update
    mbs = lr.micro_batch_size or (
        1 if packed else micro_batch_size(batch // max(dp, 1), r.n, longest)
    )
    if not (lr.micro_batch_size or packed) and longest is None:
        _warn_row_rule(cfg, mbs, batch // max(dp, 1))
    return TrainConfig(
        global_batch_size=batch, micro_batch_size=mbs,
        max_tokens_per_micro=packed,
        seed=cfg.seed, objective=o, sampling=r.sampling, recompute=lr.recompute,
        max_tokens=r.max_tokens,
        fused_token_stats=cfg.numerics == "fast", numerics=cfg.numerics,
        exit_min_depth=policy.min_depth if isinstance(policy, SampledGate) else None,
    )  # fmt: skip


def _warn_row_rule(cfg: RunConfig, mbs: int, rows: int) -> None:
    """Once per (task kind, micro-batch): the automatic micro-batch fell back to the group
    size because the prompts' length is not in the config (on a GPU, 32 calls of 8 rows a
    step instead of one of 256 made loop_credit's learner 13x slower: docs/PERFORMANCE.md)."""
    key = (cfg.task.kind, mbs)
    if key in _warned:
        return
    _warned.add(key)
    log.warning(
        "learner.micro_batch_size=0 (automatic) with task.kind=%s and no task.max_prompt_tokens: "
        "the prompts' length is unknown, so each forward/backward takes %d of a rank's %d rows "
        "(the group size rule); set task.max_prompt_tokens to the longest prompt (tokens) for "
        "micro-batches of up to %d token positions, or set learner.micro_batch_size",
        cfg.task.kind, mbs, rows, MICRO_BATCH_TOKENS,
    )  # fmt: skip


def micro_batch_size(rows: int, n: int, row_len: int | None) -> int:
    """The automatic micro-batch of a rank's ``rows`` per update: the most rows that divide
    ``rows`` and hold at most MICRO_BATCH_TOKENS positions of ``row_len`` each (at least 1).
    ``row_len`` None (the prompts' length is not known from the config): the old rule, the
    group size ``n`` if it divides, at most 16."""
    m = max(1, min(rows, n, 16) if row_len is None else min(rows, MICRO_BATCH_TOKENS // row_len))
    while rows % m:
        m -= 1
    return m


def row_tokens(cfg: RunConfig) -> int | None:
    """The longest row (prompt + completion) the run can train on, from the config alone:
    rollout.max_tokens plus task.max_prompt_tokens, or the synthetic task's prompt length;
    None for a jsonl or dataset task without task.max_prompt_tokens."""
    t = cfg.task
    if t.max_prompt_tokens:
        prompt = t.max_prompt_tokens
    elif t.kind == "synthetic":  # bos + the shown symbols: the same for every prompt
        prompt = len(synthetic_task_prompts(1, 0, length=1)[0][0])
    else:
        return None
    return prompt + cfg.rollout.max_tokens


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
