"""flow_dppo (Categorical Flow-DPPO): the unclipped -r A, r = exp(logp - prox_logp), with the
updates that push further out of the full-vocabulary KL trust region dropped
(`learner.losses.flow_dppo_surrogate`; docs/OBJECTIVES.md)."""

from __future__ import annotations

from torch import Tensor

from learner.losses import flow_dppo_surrogate, masked_mean
from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import Tokens
from learner.objectives.kind import Kind, Metrics

__all__ = ["FLOW_DPPO"]


def flow_surrogate(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> Tensor:
    """drop_frac, kl_over_threshold_frac."""
    assert tok.kl is not None
    pg, dropped = flow_dppo_surrogate(tok.ratio, tok.advantages, tok.kl, cfg.kl_threshold)
    metrics["drop_frac"] = masked_mean((dropped & tok.valid).float(), tok.mask)
    over = (tok.kl > cfg.kl_threshold) & tok.valid
    metrics["kl_over_threshold_frac"] = masked_mean(over.float(), tok.mask)
    return pg


FLOW_DPPO = Kind(flow_surrogate, needs=("prox_logp", "kl"))
