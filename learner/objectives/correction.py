"""Rollout correction: the behaviour -> proximal importance weight w and rejection, at token,
sequence or geometric-mean level (objective.is_cap, is_cap_low, is_mode, is_level, is_veto,
is_rejected_in_denominator; docs/OBJECTIVES.md "Rollout correction").

    token:     log w_bt = prox_logp_bt - behav_logp_bt
    sequence:  log w_b  = sum_t log w_bt       (the ratio of the row's probabilities)
    geometric: log w_b  = mean_t log w_bt      (its per-token geometric mean)
    w = exp(clamp(log w, -20, 20)); truncate: clamp(w, is_cap_low, is_cap); mask: w = 0
    (rejected) outside [is_cap_low, is_cap]; veto: w = 0 on every token of a row with one
    token's exp(log w_bt) below is_veto.

Over the tokens with mask > 0 and both log-probs finite (the others get log w = 0 and are
zeroed by the objective). A function of (cfg, mask, prox_logp, behav_logp) only, so the step
computes the same rejection for the loss denominator as the loss (learner.step).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from learner.losses import behaviour_weight
from learner.objective_config import ObjectiveConfig

__all__ = ["Correction", "rollout_correction"]


class Correction(NamedTuple):
    """[B, T] outputs of `rollout_correction` (no gradient)."""

    weight: Tensor
    """w after its bounds, 0 where rejected."""
    masked: Tensor
    """bool: rejected by is_mode mask (outside [is_cap_low, is_cap])."""
    truncated: Tensor
    """bool: w truncated at a bound."""
    vetoed: Tensor
    """bool: a token of a row rejected by is_veto."""

    @property
    def rejected(self) -> Tensor:
        """bool: masked or vetoed."""
        return self.masked | self.vetoed


@torch.no_grad()
def rollout_correction(
    cfg: ObjectiveConfig, mask: Tensor, prox_logp: Tensor, behav_logp: Tensor
) -> Correction:
    """The weight and rejections of the module docstring."""
    ok = (mask > 0) & torch.isfinite(prox_logp) & torch.isfinite(behav_logp)
    log_w = torch.where(ok, prox_logp.float(), 0.0) - torch.where(ok, behav_logp.float(), 0.0)
    level = log_w
    if cfg.is_level != "token":
        level = log_w.sum(-1)
        if cfg.is_level == "geometric":
            level = level / ok.sum(-1).clamp_min(1)
        level = level[:, None].expand_as(log_w)
    w, masked, truncated = behaviour_weight(level, cfg.is_cap, cfg.is_mode, cfg.is_cap_low)
    vetoed = torch.zeros_like(ok)
    if cfg.is_veto is not None:
        bad = ok & (log_w < math.log(cfg.is_veto))
        vetoed = bad.any(-1, keepdim=True).expand_as(ok) & ok
        w = torch.where(vetoed, 0.0, w)
    return Correction(w, masked & ok, truncated & ok, vetoed)
