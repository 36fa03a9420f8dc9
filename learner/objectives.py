"""The learner's RL objectives: one entry point per network (policy, critic).

    policy_loss(cfg, batch) -> (loss, metrics)   kind in {ppo, grpo, dppo, flow_dppo}
    value_loss(cfg, batch)  -> (loss, metrics)   clipped critic regression (PPO only)

Pure PyTorch on [B, T] token tensors; independent of megatron and of the model. The
advantages come precomputed (`learner/advantages.py`: `gae` for ppo, `group_advantages`
for grpo), computed once over the whole step's batch before it is cut into micro-batches.
Formulas: docs/OBJECTIVES.md.

Batch keys (all [B, T] unless stated; fp32 or castable; absent = not provided):
    mask        float, > 0 on response tokens (a weight); required.
    advantages  [B, T], or [B] for grpo (broadcast over the tokens); required.
    logp        log pi_theta(token), differentiable: the current policy.
    logits      [B, T, V] current logits (instead of logp), with `targets` [B, T] int:
                logp, entropy (and, with `old_logits`, prox_logp and the full-vocab KL)
                are then computed by `learner.vocab_ops.token_stats` at ``temperature``.
    old_logits  [B, T, V] proximal logits (pre-update weights, recomputed); flow_dppo.
    behav_logp  log-prob under the behaviour policy (the generator), after temperature.
    prox_logp   log-prob under the proximal policy (the learner's pre-update weights).
    kl          KL(pi_prox || pi_theta) over the full vocabulary (flow_dppo without logits).
    entropy     entropy of pi_theta, differentiable (for entropy_coef > 0 without logits).
    ref_logp    log-prob under the reference policy (for kl_coef > 0).
    normalizer  float or 0-d tensor: replaces the aggregation denominator (see `aggregate`).

A token whose provided current/proximal/behaviour/reference log-prob or KL is not finite
(e.g. -inf: the token is outside a top-k/top-p support) is invalid: it contributes exactly 0 to every loss term and
to the gradient, still counts in the token_mean denominator, and is reported in
`invalid_frac`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from learner.config import KINDS, ObjectiveConfig
from learner.losses import (
    aggregate,
    behaviour_weight,
    clipped_surrogate,
    divergence_surrogate,
    flow_dppo_surrogate,
    kl_penalty,
    masked_mean,
    ratio_from_log,
    value_loss_terms,
)
from learner.vocab_ops import DEFAULT_CHUNK, token_stats

__all__ = ["KINDS", "ObjectiveConfig", "policy_loss", "value_loss"]


def _token_tensor(batch: dict[str, Any], key: str, shape: torch.Size) -> Tensor | None:
    x = batch.get(key)
    if x is None:
        return None
    if not isinstance(x, Tensor) or x.shape != shape:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"batch[{key!r}]: expected a tensor of shape {tuple(shape)}, got {got}")
    return x


def _require(x: Tensor | None, key: str, why: str) -> Tensor:
    if x is None:
        raise ValueError(f"batch[{key!r}]: required {why}")
    return x


def _from_logits(
    batch: dict[str, Any], mask: Tensor, temperature: float, vocab_chunk: int
) -> dict[str, Tensor]:
    """logp, entropy (and prox_logp, kl with old_logits) [B, T] from batch logits."""
    logits = batch["logits"]
    b, t = mask.shape
    if logits.dim() != 3 or logits.shape[:2] != (b, t):
        raise ValueError(f"batch['logits']: expected [{b}, {t}, V], got {tuple(logits.shape)}")
    targets = _require(_token_tensor(batch, "targets", mask.shape), "targets", "with logits")
    if "logp" in batch or ("old_logits" in batch and ("prox_logp" in batch or "kl" in batch)):
        raise ValueError("batch: give either logits or logp/prox_logp/kl, not both")
    old = batch.get("old_logits")
    if old is not None and old.shape != logits.shape:
        raise ValueError(
            f"batch['old_logits']: expected {tuple(logits.shape)}, got {tuple(old.shape)}"
        )
    v = logits.shape[-1]
    safe_targets = torch.where(mask > 0, targets.long(), 0).reshape(-1)
    stats = token_stats(
        logits.reshape(-1, v),
        None if old is None else old.reshape(-1, v),
        safe_targets,
        temperature,
        vocab_chunk,
    )
    out = {"logp": stats.logp.view(b, t), "entropy": stats.entropy.view(b, t)}
    if stats.kl is not None and stats.logp_old is not None:
        out["kl"] = stats.kl.view(b, t)
        out["prox_logp"] = stats.logp_old.view(b, t)
    return out


def _to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """All metrics to Python floats with one device synchronisation."""
    values = torch.stack([m.detach().float().reshape(()) for m in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))


def _advantages(cfg: ObjectiveConfig, batch: dict[str, Any], shape: torch.Size) -> Tensor:
    adv = batch.get("advantages")
    if cfg.kind == "grpo" and isinstance(adv, Tensor) and adv.shape == shape[:1]:
        adv = adv[:, None].expand(shape)
    if not isinstance(adv, Tensor) or adv.shape != shape:
        got = tuple(adv.shape) if isinstance(adv, Tensor) else adv
        want = f"{tuple(shape)} (or [B] for grpo)" if cfg.kind == "grpo" else f"{tuple(shape)}"
        raise ValueError(f"batch['advantages']: required, shape {want}, got {got}")
    return adv.detach().float()


def policy_loss(
    cfg: ObjectiveConfig,
    batch: dict[str, Any],
    *,
    temperature: float = 1.0,
    vocab_chunk: int = DEFAULT_CHUNK,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss of `cfg.kind` over a (micro-)batch; see the module docstring for keys
    (``temperature`` and ``vocab_chunk``: of the token statistics of batch logits).

    Per valid token (A: advantage, r: ratio, w: behaviour weight, H: entropy):
        ppo / grpo:  l = w * clip_surrogate(r = exp(logp - base), A)
                     (ratio_level sequence, GSPO: r_bt = exp(mean_t' log r_bt') with the
                     gradient of r_b * pi_bt / sg(pi_bt); dppo likewise)
                     base = prox_logp if given else behav_logp; w = 1 unless is_cap is set
        dppo:        l = w * clip_surrogate(r = exp(logp - prox_logp), A)
                     w = exp(prox_logp - behav_logp), capped/masked by is_cap/is_mode
        flow_dppo:   l = w * (0 if dropped else -r A),  r = exp(logp - prox_logp)
        divergence_ppo: l = 0 if dropped else -r A,  r = exp(logp - anchor_logp), dropped when
                     the binary TV / KL of the sampled token beyond the threshold pushes out;
                     r above divergence_is_cap C counts as C (value and gradient)
        all kinds:   l += kl_coef * k(logp, ref_logp) - entropy_coef * H
    loss = aggregate(l, mask, cfg.aggregation, batch.get("normalizer")).

    Returns (scalar loss, metrics): mask-weighted token means of per-token quantities;
    fractions are of mask tokens.
    """
    mask = batch.get("mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError("batch['mask']: required, a [B, T] float tensor")
    shape = mask.shape
    tok: dict[str, Tensor | None] = {
        k: _token_tensor(batch, k, shape)
        for k in ("logp", "behav_logp", "prox_logp", "kl", "entropy", "ref_logp")
    }
    if "logits" in batch:
        tok.update(_from_logits(batch, mask, temperature, vocab_chunk))
    logp_in = _require(tok["logp"], "logp", "(or logits + targets)")
    behav, prox, ref, kl_old = tok["behav_logp"], tok["prox_logp"], tok["ref_logp"], tok["kl"]
    weighted = cfg.kind == "dppo" or cfg.is_cap is not None
    if cfg.kind in ("dppo", "flow_dppo"):
        _require(prox, "prox_logp", f"for {cfg.kind} (or old_logits with logits)")
    if weighted:
        _require(behav, "behav_logp", "for dppo and whenever is_cap is set")
        _require(prox, "prox_logp", "for dppo and whenever is_cap is set")
    if cfg.kind == "flow_dppo":
        _require(kl_old, "kl", "for flow_dppo (or old_logits with logits)")
    if cfg.kind == "divergence_ppo":  # r = pi / mu against the configured anchor
        base_in = (_require(behav, "behav_logp", "for divergence_ppo (anchor behaviour)")
                   if cfg.anchor == "behaviour"
                   else _require(prox, "prox_logp", "for divergence_ppo (anchor proximal)"))  # fmt: skip
    else:
        base_in = prox if prox is not None else _require(behav, "behav_logp", "(or prox_logp)")
    if cfg.kl_coef > 0:
        _require(ref, "ref_logp", "for kl_coef > 0")
    if cfg.entropy_coef > 0:
        _require(tok["entropy"], "entropy", "for entropy_coef > 0 (or logits)")

    # Valid tokens: in the mask, with every input this objective uses finite. Everything
    # below works on copies where invalid tokens hold 0, so no inf/NaN enters a product
    # whose backward could turn 0 * inf into NaN.
    live = mask > 0
    used: list[Tensor | None] = [logp_in, base_in]
    used += [behav, prox] if weighted else []
    used += [ref] if cfg.kl_coef > 0 else []
    used += [kl_old] if cfg.kind == "flow_dppo" else []
    valid = live.clone()
    for x in used:
        assert x is not None
        valid &= torch.isfinite(x.detach())

    def clean(x: Tensor | None, grad: bool = False) -> Tensor | None:
        if x is None:
            return None
        keep = valid & torch.isfinite(x.detach())  # == valid for the inputs in `used`
        return torch.where(keep, x.float() if grad else x.detach().float(), 0.0)

    logp = clean(logp_in, grad=True)
    base, behav, prox = clean(base_in), clean(behav), clean(prox)
    ref, kl_old, entropy = clean(ref), clean(kl_old), clean(tok["entropy"], grad=True)
    assert logp is not None and base is not None
    adv = torch.where(valid, _advantages(cfg, batch, shape), 0.0)

    log_ratio = logp - base
    if cfg.ratio_level == "sequence":  # GSPO: s_b = exp(mean_t log r), gradient s_b grad logp_t
        with torch.no_grad():
            m = torch.where(valid, mask.float(), 0.0)
            seq = (m * log_ratio).sum(-1) / m.sum(-1).clamp_min(1e-12)
        ratio = ratio_from_log(logp - logp.detach() + seq[:, None])
    else:
        ratio = ratio_from_log(log_ratio)
    metrics: dict[str, Tensor] = {}
    w: Tensor | None = None
    if weighted:
        assert behav is not None and prox is not None
        w, is_masked, is_trunc = behaviour_weight(prox - behav, cfg.is_cap, cfg.is_mode)
        w = torch.where(valid, w, 0.0)
        metrics["is_weight_mean"] = masked_mean(w, mask)
        metrics["is_masked_frac"] = masked_mean((is_masked & valid).float(), mask)
        metrics["is_truncated_frac"] = masked_mean((is_trunc & valid).float(), mask)

    if cfg.kind == "flow_dppo":
        assert kl_old is not None
        pg, dropped = flow_dppo_surrogate(ratio, adv, kl_old, cfg.kl_threshold)
        metrics["drop_frac"] = masked_mean((dropped & valid).float(), mask)
        over = (kl_old > cfg.kl_threshold) & valid
        metrics["kl_over_threshold_frac"] = masked_mean(over.float(), mask)
    elif cfg.kind == "divergence_ppo":
        pg, dropped, div = divergence_surrogate(
            ratio, logp, base, adv, cfg.divergence, cfg.divergence_threshold,
            cfg.divergence_threshold_low, cfg.divergence_is_cap,
        )  # fmt: skip
        metrics["drop_frac"] = masked_mean((dropped & valid).float(), mask)
        metrics["divergence_mean"] = masked_mean(torch.where(valid, div, 0.0), mask)
    else:
        surr = clipped_surrogate(ratio, adv, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
        pg = surr.loss
        low, high = surr.clipped_low & valid, surr.clipped_high & valid
        metrics["clip_frac"] = masked_mean((low | high).float(), mask)
        metrics["clip_low_frac"] = masked_mean(low.float(), mask)
        metrics["clip_high_frac"] = masked_mean(high.float(), mask)
        if cfg.dual_clip is not None:
            metrics["dual_clip_frac"] = masked_mean((surr.dual_clipped & valid).float(), mask)
    if w is not None:
        pg = pg * w
    pg = torch.where(valid, pg, 0.0)
    normalizer = batch.get("normalizer")
    length = cfg.loss_scale_length
    metrics["pg_loss"] = aggregate(pg.detach(), mask, cfg.aggregation, normalizer, length)

    total = pg
    if cfg.kl_coef > 0:
        assert ref is not None
        k = torch.where(valid, kl_penalty(logp, ref, cfg.kl_estimator, cfg.kl_cap), 0.0)
        total = total + cfg.kl_coef * k
        metrics["kl_ref"] = masked_mean(k, mask)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * entropy
    if kl_old is not None:
        metrics["kl_old_new"] = masked_mean(kl_old, mask)

    loss = aggregate(total, mask, cfg.aggregation, normalizer, length)
    with torch.no_grad():
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["approx_kl"] = masked_mean(ratio_from_log(-log_ratio) - 1.0 + log_ratio, mask)
    metrics["invalid_frac"] = masked_mean((live & ~valid).float(), mask)
    metrics["num_tokens"] = live.sum()
    metrics["loss"] = loss.detach()
    return loss, _to_floats(metrics)


def value_loss(cfg: ObjectiveConfig, batch: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
    """Clipped critic loss; batch keys (all [B, T]): values (differentiable), old_values
    (the critic's values when the rollout was scored), returns (from `gae`), mask,
    optional normalizer. Returns (scalar loss, metrics)."""
    mask = batch.get("mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError("batch['mask']: required, a [B, T] float tensor")
    values = _require(_token_tensor(batch, "values", mask.shape), "values", "")
    old = _require(_token_tensor(batch, "old_values", mask.shape), "old_values", "")
    returns = _require(_token_tensor(batch, "returns", mask.shape), "returns", "")
    live = mask > 0
    v = torch.where(live, values.float(), 0.0)
    o = torch.where(live, old.float().detach(), 0.0)
    r = torch.where(live, returns.float().detach(), 0.0)
    per_tok, clipped = value_loss_terms(v, o, r, cfg.value_clip)
    loss = aggregate(per_tok, mask, cfg.aggregation, batch.get("normalizer"), cfg.loss_scale_length)
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_frac": masked_mean(clipped.float(), mask),
        "value_mean": masked_mean(v, mask),
        "return_mean": masked_mean(r, mask),
    }
    return loss, _to_floats(metrics)
