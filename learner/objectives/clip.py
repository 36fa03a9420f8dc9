"""ppo, grpo and dppo: the PPO clipped surrogate (`learner.losses.clipped_surrogate`).

    l = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A),  dual clip: min(l, -c A) for A < 0

ppo / grpo measure r against prox_logp when given, else behav_logp; dppo (AReaL decoupled
PPO) against prox_logp, always with the behaviour weight w = exp(prox_logp - behav_logp).
"""

from __future__ import annotations

from torch import Tensor

from learner.losses import clipped_surrogate, masked_mean
from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import Tokens
from learner.objectives.kind import Kind, Metrics

__all__ = ["DPPO", "GRPO", "PPO", "clip_surrogate"]


def clip_surrogate(cfg: ObjectiveConfig, tok: Tokens, metrics: Metrics) -> Tensor:
    """The clipped surrogate; clip_frac (= clip_low_frac + clip_high_frac), dual_clip_frac."""
    surr = clipped_surrogate(tok.ratio, tok.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    low, high = surr.clipped_low & tok.valid, surr.clipped_high & tok.valid
    metrics["clip_frac"] = masked_mean((low | high).float(), tok.mask)
    metrics["clip_low_frac"] = masked_mean(low.float(), tok.mask)
    metrics["clip_high_frac"] = masked_mean(high.float(), tok.mask)
    if cfg.dual_clip is not None:
        metrics["dual_clip_frac"] = masked_mean((surr.dual_clipped & tok.valid).float(), tok.mask)
    return surr.loss


PPO = Kind(clip_surrogate)
GRPO = Kind(clip_surrogate)
DPPO = Kind(clip_surrogate, needs=("prox_logp",), always_weighted=True)
