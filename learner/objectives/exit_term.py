"""The exit term: the exit loop as a trained decision (objective.exit_coef; a sampled exit,
models.exits.SampledGate; docs/OBJECTIVES.md "The exit as an action").

Under a sampled exit a response token's action is the pair (exit loop e_t, token y_t), with
log-probability log p(e_t) + log pi(y_t | e_t): the token's objective already trains the second
part; this term trains the first with the same advantage and the PPO clipped surrogate,

    l_t += exit_coef * max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A),
    r = exp(exit_logp - exit_base),  exit_base = exit_prox (the pre-update weights) if given,
                                                else exit_behav (the generator's claim),

and the exit distribution's entropy as a regulariser (Ouro trains its gate with an entropy
term against collapse): l_t -= exit_entropy_coef * H_t, H_t = sum over the iterations the gate
was asked of the Bernoulli entropy of sigmoid(g_k): the sequential decision's entropy along
the sampled path, whose expectation is the entropy of the exit distribution (the chain rule).

The two ratios are clipped apart (a factorised surrogate, like a policy with two heads), so a
large token ratio does not hide the gate's. With a behaviour weight (kind dppo, or is_cap set:
AReaL's decoupled PPO) the exit has its own, from its own log-probs and under the same rules
(learner.objectives.correction with exit_prox / exit_behav: is_cap, is_mode, is_level,
is_veto), and its ratio is measured against exit_prox:

    l_t += exit_coef * w_e,t * max(-r A, -clip(r, ...) A),  w_e = exp(exit_prox - exit_behav)

Kinds ppo, grpo and dppo (the clipped surrogate); flow_dppo and divergence_ppo are refused by
the config until their surrogate is defined for the exit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import clipped_surrogate, masked_mean, ratio_from_log
from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import LossBatch, Tokens
from learner.objectives.correction import rollout_correction
from learner.objectives.kind import Metrics

__all__ = ["exit_term", "uses_exit_term"]


def uses_exit_term(cfg: ObjectiveConfig) -> bool:
    """The loss has the exit term (exit_coef or exit_entropy_coef > 0)."""
    return cfg.exit_coef > 0 or cfg.exit_entropy_coef > 0


def _need(x: Tensor | None, key: str, shape: torch.Size) -> Tensor:
    if x is None:
        raise ValueError(f"batch[{key!r}]: required for objective.exit_coef / exit_entropy_coef")
    if x.shape != shape:
        raise ValueError(f"batch[{key!r}]: expected {tuple(shape)}, got {tuple(x.shape)}")
    return x


def exit_term(cfg: ObjectiveConfig, lb: LossBatch, tok: Tokens, metrics: Metrics) -> Tensor:
    """The per-token exit loss [B, T] (module doc), 0 on tokens that are not valid or whose
    exit inputs are not finite; metrics exit_loss (token mean), exit_ratio_mean,
    exit_clip_frac, exit_entropy, exit_logp."""
    shape = tok.mask.shape
    zero = torch.zeros(shape, dtype=torch.float32, device=tok.mask.device)
    total = zero
    valid = tok.valid
    if cfg.exit_coef > 0:
        cur = _need(lb.exit_logp, "exit_logp", shape).float()
        weighted = cfg.kind == "dppo" or cfg.is_cap is not None
        if weighted:  # decoupled: the ratio against the proximal exit, the exit's own weight
            base = _need(lb.exit_prox, "exit_prox", shape)
        else:
            key = "exit_prox" if lb.exit_prox is not None else "exit_behav"
            base = _need(lb.exit_prox if lb.exit_prox is not None else lb.exit_behav, key, shape)
        base = base.detach().float()
        ok = valid & torch.isfinite(cur.detach()) & torch.isfinite(base)
        log_ratio = torch.where(ok, cur - base, 0.0)
        ratio = ratio_from_log(log_ratio)
        surr = clipped_surrogate(ratio, tok.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
        loss = torch.where(ok, surr.loss, 0.0)
        if weighted:
            behav = _need(lb.exit_behav, "exit_behav", shape)
            corr = rollout_correction(cfg, torch.where(ok, tok.mask, 0.0), base, behav)
            loss = loss * corr.weight
            metrics["exit_is_weight_mean"] = masked_mean(torch.where(ok, corr.weight, 0.0),
                                                         tok.mask)  # fmt: skip
        total = total + cfg.exit_coef * loss
        with torch.no_grad():
            metrics["exit_loss"] = masked_mean(loss, tok.mask)
            metrics["exit_ratio_mean"] = masked_mean(torch.where(ok, ratio, 1.0), tok.mask)
            clipped = (surr.clipped_low | surr.clipped_high) & ok
            metrics["exit_clip_frac"] = masked_mean(clipped.float(), tok.mask)
            metrics["exit_logp"] = masked_mean(torch.where(ok, cur, 0.0), tok.mask)
    if lb.exit_entropy is not None or cfg.exit_entropy_coef > 0:
        ent = _need(lb.exit_entropy, "exit_entropy", shape).float()
        ent = torch.where(valid & torch.isfinite(ent.detach()), ent, 0.0)
        metrics["exit_entropy"] = masked_mean(ent.detach(), tok.mask)
        if cfg.exit_entropy_coef > 0:
            total = total - cfg.exit_entropy_coef * ent
    return total
