"""divergence_ppo (Qi et al. 2026, the binary approximation): the unclipped -r A,
r = pi / mu against the anchor (objective.anchor), tokens whose binary TV / KL beyond the
threshold pushes further out dropped (`learner.losses.divergence_surrogate`)."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import divergence_surrogate, masked_mean
from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import Tokens
from learner.objectives.kind import Kind, Metrics

__all__ = ["DIVERGENCE_PPO"]


def divergence_loss(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> Tensor:
    """drop_frac, divergence_mean."""
    pg, dropped, div = divergence_surrogate(
        tok.ratio, tok.logp, tok.base, tok.advantages, cfg.divergence, cfg.divergence_threshold,
        cfg.divergence_threshold_low, cfg.divergence_is_cap,
    )  # fmt: skip
    metrics["drop_frac"] = masked_mean((dropped & tok.valid).float(), tok.mask)
    metrics["divergence_mean"] = masked_mean(torch.where(tok.valid, div, 0.0), tok.mask)
    return pg


def _anchor(cfg: ObjectiveConfig) -> str:
    return "behav_logp" if cfg.anchor == "behaviour" else "prox_logp"


DIVERGENCE_PPO = Kind(divergence_loss, base=_anchor)
