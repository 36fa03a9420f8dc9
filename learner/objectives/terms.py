"""Loss terms every kind gets (registry order: learner.objectives.TERMS): the reference KL
penalty, the entropy bonus, and the proximal-to-current KL metric."""

from __future__ import annotations

from torch import Tensor

from learner.losses import kl_penalty, masked_mean
from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import Tokens
from learner.objectives.kind import Metrics, Term

__all__ = ["ENTROPY", "KL_OLD_METRIC", "KL_REFERENCE"]


def _kl_reference(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> Tensor | None:
    """kl_coef x k(logp, ref_logp) (objective.kl_estimator, clamped at kl_cap); kl_ref."""
    if cfg.kl_coef <= 0:
        return None
    assert tok.ref is not None
    k = tok.where_valid(kl_penalty(tok.logp, tok.ref, cfg.kl_estimator, cfg.kl_cap))
    metrics["kl_ref"] = masked_mean(k, tok.mask)
    return cfg.kl_coef * k


def _entropy(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> Tensor | None:
    """-entropy_coef x H (the bonus); the entropy metric whenever H is given."""
    if tok.entropy is None:
        return None
    metrics["entropy"] = masked_mean(tok.entropy, tok.mask)
    return -(cfg.entropy_coef * tok.entropy) if cfg.entropy_coef > 0 else None


def _kl_old(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> None:
    """kl_old_new: the mean full-vocabulary KL(proximal || current) when given (no loss)."""
    if tok.kl is not None:
        metrics["kl_old_new"] = masked_mean(tok.kl, tok.mask)


KL_REFERENCE = Term(
    _kl_reference,
    needs=lambda cfg: {"ref_logp": "for kl_coef > 0"} if cfg.kl_coef > 0 else {},
    validates=lambda cfg: ("ref_logp",) if cfg.kl_coef > 0 else (),
)
ENTROPY = Term(
    _entropy,
    needs=lambda cfg: (
        {"entropy": "for entropy_coef > 0 (or logits)"} if cfg.entropy_coef > 0 else {}
    ),  # fmt: skip
)
KL_OLD_METRIC = Term(_kl_old)
