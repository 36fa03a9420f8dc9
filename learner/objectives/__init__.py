"""The learner's RL objectives: one entry point per network (policy, critic).

    policy_loss(cfg, batch: LossBatch) -> (loss, metrics)   kind: KIND_REGISTRY[cfg.kind]
    value_loss(cfg, batch: ValueBatch) -> (loss, metrics)   clipped critic regression

A kind is a `Kind` (learner/objectives/kind.py): its per-token surrogate and the inputs it
needs, one file each (clip.py: ppo, grpo, dppo; flow_dppo.py; divergence_ppo.py), one line in
`KIND_REGISTRY`. A loss term every kind gets (the reference KL, the entropy bonus) is a `Term`
(terms.py), one line in `TERMS`. `policy_loss` composes them:

    tokens = validated inputs, invalid tokens 0        (batch.py: LossBatch -> Tokens)
    l      = kind.surrogate(cfg, tokens) x w           (w: behaviour weight, when applied)
    l     += term(cfg, tokens) for term in TERMS
    loss   = aggregate(l, mask, cfg.aggregation, batch.normalizer)

Pure PyTorch on [B, T] token tensors; independent of megatron and of the model. The
advantages come precomputed (`learner.batching.step_advantages`), once over the whole step's
batch before it is cut into micro-batches. Formulas: docs/OBJECTIVES.md.

A token whose provided current/proximal/behaviour/reference log-prob or KL that the objective
uses is not finite (e.g. -inf: the token is outside a top-k/top-p support) is invalid: it
contributes exactly 0 to every loss term and to the gradient, still counts in the token_mean
denominator, and is reported in `invalid_frac`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from learner.config import DEFAULT_VOCAB_CHUNK
from learner.losses import (
    aggregate,
    masked_mean,
    ratio_from_log,
    value_loss_terms,
)
from learner.objective_config import KINDS, ObjectiveConfig
from learner.objectives import clip, divergence_ppo, flow_dppo, terms
from learner.objectives.batch import LossBatch, Tokens, ValueBatch
from learner.objectives.correction import Correction, rollout_correction
from learner.objectives.exit_term import exit_term, uses_exit_term
from learner.objectives.kind import Kind, Metrics, Term
from learner.vocab_ops import token_stats

__all__ = [
    "KIND_REGISTRY",
    "TERMS",
    "behaviour_weighted",
    "policy_loss",
    "value_loss",
]

KIND_REGISTRY: dict[str, Kind] = {
    "ppo": clip.PPO,
    "grpo": clip.GRPO,
    "dppo": clip.DPPO,
    "flow_dppo": flow_dppo.FLOW_DPPO,
    "divergence_ppo": divergence_ppo.DIVERGENCE_PPO,
}
"""objective.kind -> its Kind (learner.objective_config.KINDS names the same keys)."""
TERMS: tuple[Term, ...] = (terms.KL_REFERENCE, terms.ENTROPY, terms.KL_OLD_METRIC)
"""The terms added to every kind's loss, in this order."""
assert set(KIND_REGISTRY) == set(KINDS), "learner.objective_config.KINDS and KIND_REGISTRY differ"


def behaviour_weighted(cfg: ObjectiveConfig) -> bool:
    """The objective applies the behaviour weight (dppo always, every kind with is_cap)."""
    return KIND_REGISTRY[cfg.kind].always_weighted or cfg.is_cap is not None


_TOKEN_INPUTS = ("logp", "behav_logp", "prox_logp", "kl", "entropy", "ref_logp")


def _token_tensor(x: Any, key: str, shape: torch.Size) -> Tensor | None:
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
    batch: LossBatch, mask: Tensor, temperature: float, vocab_chunk: int
) -> dict[str, Tensor]:
    """logp, entropy (and prox_logp, kl with old_logits) [B, T] from batch logits."""
    logits = batch.logits
    assert logits is not None
    b, t = mask.shape
    if logits.dim() != 3 or logits.shape[:2] != (b, t):
        raise ValueError(f"batch['logits']: expected [{b}, {t}, V], got {tuple(logits.shape)}")
    targets = _require(
        _token_tensor(batch.targets, "targets", mask.shape), "targets", "with logits"
    )
    old = batch.old_logits
    if batch.logp is not None or (old is not None and (batch.prox_logp is not None
                                                       or batch.kl is not None)):  # fmt: skip
        raise ValueError("batch: give either logits or logp/prox_logp/kl, not both")
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


def _to_floats(metrics: Metrics, lazy: bool = False) -> dict[str, Any]:
    """All metrics to Python floats with one device synchronisation; ``lazy``: as float32 0-d
    tensors instead, the same values unread (learner.step_metrics.StepMetrics reads them once
    a step)."""
    values = [m.detach().float().reshape(()) for m in metrics.values()]
    if lazy:
        return dict(zip(metrics, values, strict=True))
    return dict(zip(metrics, torch.stack(values).tolist(), strict=True))


def _advantages(cfg: ObjectiveConfig, adv: Any, shape: torch.Size) -> Tensor:
    if cfg.kind == "grpo" and isinstance(adv, Tensor) and adv.shape == shape[:1]:
        adv = adv[:, None].expand(shape)
    if not isinstance(adv, Tensor) or adv.shape != shape:
        got = tuple(adv.shape) if isinstance(adv, Tensor) else adv
        want = f"{tuple(shape)} (or [B] for grpo)" if cfg.kind == "grpo" else f"{tuple(shape)}"
        raise ValueError(f"batch['advantages']: required, shape {want}, got {got}")
    return adv.detach().float()


def _tokens(
    cfg: ObjectiveConfig,
    kind: Kind,
    batch: LossBatch,
    temperature: float,
    vocab_chunk: int,
    correction: Correction | None = None,
) -> tuple[Tokens, Correction | None]:
    """The validated, cleaned inputs (`Tokens`) and the rollout correction when it applies."""
    mask = batch.mask
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError("batch['mask']: required, a [B, T] float tensor")
    shape = mask.shape
    tok: dict[str, Tensor | None] = {
        k: _token_tensor(getattr(batch, k), k, shape) for k in _TOKEN_INPUTS
    }
    if batch.logits is not None:
        tok.update(_from_logits(batch, mask, temperature, vocab_chunk))
    logp_in = _require(tok["logp"], "logp", "(or logits + targets)")
    weighted = behaviour_weighted(cfg)
    for key in kind.needs:
        _require(tok[key], key, f"for {cfg.kind} (or old_logits with logits)")
    if weighted:
        _require(tok["behav_logp"], "behav_logp", "for dppo and whenever is_cap is set")
        _require(tok["prox_logp"], "prox_logp", "for dppo and whenever is_cap is set")
    if kind.base is not None:  # the kind's own ratio base (divergence_ppo: the anchor)
        key = kind.base(cfg)
        base_in = _require(tok[key], key, f"for {cfg.kind} (anchor {cfg.anchor})")
    else:
        prox_in = tok["prox_logp"]
        base_in = (prox_in if prox_in is not None
                   else _require(tok["behav_logp"], "behav_logp", "(or prox_logp)"))  # fmt: skip
    validates: list[str] = list(kind.needs) + (["behav_logp", "prox_logp"] if weighted else [])
    for term in TERMS:
        for key, why in term.needs(cfg).items():
            _require(tok[key], key, why)
        validates += term.validates(cfg)

    # Valid tokens: in the mask, with every input this objective uses finite. Everything
    # below works on copies where invalid tokens hold 0.
    live = mask > 0
    valid = live.clone()
    for x in [logp_in, base_in] + [tok[k] for k in validates]:
        assert x is not None
        valid &= torch.isfinite(x.detach())

    def clean(x: Tensor | None, grad: bool = False) -> Tensor | None:
        if x is None:
            return None
        keep = valid & torch.isfinite(x.detach())  # == valid for the validated inputs
        return torch.where(keep, x.float() if grad else x.detach().float(), 0.0)

    logp, base = clean(logp_in, grad=True), clean(base_in)
    assert logp is not None and base is not None
    adv = torch.where(valid, _advantages(cfg, batch.advantages, shape), 0.0)
    log_ratio = logp - base
    if cfg.ratio_level == "sequence":  # GSPO: s_b = exp(mean_t log r), gradient s_b grad logp_t
        with torch.no_grad():
            m = torch.where(valid, mask.float(), 0.0)
            seq = (m * log_ratio).sum(-1) / m.sum(-1).clamp_min(1e-12)
        ratio = ratio_from_log(logp - logp.detach() + seq[:, None])
    else:
        ratio = ratio_from_log(log_ratio)
    tokens = Tokens(
        mask=mask, live=live, valid=valid, logp=logp, base=base, advantages=adv,
        log_ratio=log_ratio, ratio=ratio, behav=clean(tok["behav_logp"]),
        prox=clean(tok["prox_logp"]), ref=clean(tok["ref_logp"]), kl=clean(tok["kl"]),
        entropy=clean(tok["entropy"], grad=True),
    )  # fmt: skip
    corr = correction
    if weighted and corr is None:  # from the raw log-probs: the step computes the same
        prox_in, behav_in = tok["prox_logp"], tok["behav_logp"]
        assert prox_in is not None and behav_in is not None
        corr = rollout_correction(cfg, mask, prox_in, behav_in)
    return tokens, corr


def _behaviour_weight(
    cfg: ObjectiveConfig, tok: Tokens, corr: Correction, metrics: Metrics
) -> Tensor:
    """w on valid tokens (learner.objectives.correction); is_* metrics."""
    w = tok.where_valid(corr.weight)
    metrics["is_weight_mean"] = masked_mean(w, tok.mask)
    metrics["is_masked_frac"] = masked_mean((corr.masked & tok.valid).float(), tok.mask)
    metrics["is_truncated_frac"] = masked_mean((corr.truncated & tok.valid).float(), tok.mask)
    if cfg.is_veto is not None:
        metrics["is_vetoed_frac"] = masked_mean((corr.vetoed & tok.valid).float(), tok.mask)
    return w


def _token_loss(
    cfg: ObjectiveConfig,
    kind: Kind,
    tok: Tokens,
    corr: Correction | None,
    metrics: Metrics,
    norm: float | Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(pg, total, agg): the weighted surrogate, + the TERMS, per token [B, T], and the mask
    the aggregation counts (rejected tokens out when is_rejected_in_denominator is false)."""
    w = None if corr is None else _behaviour_weight(cfg, tok, corr, metrics)
    pg = kind.surrogate(cfg, tok, metrics)
    if w is not None:
        pg = pg * w
    pg = tok.where_valid(pg)
    mask, length = tok.mask, cfg.loss_scale_length
    agg = mask  # rejected tokens out of the denominator too (the step's normalizer agrees)
    if corr is not None and not cfg.is_rejected_in_denominator:
        agg = torch.where(corr.rejected, 0.0, mask)
    metrics["pg_loss"] = aggregate(pg.detach(), agg, cfg.aggregation, norm, length)
    total = pg
    for term in TERMS:
        extra = term.add(cfg, tok, metrics)
        if extra is not None:
            total = total + extra
    return pg, total, agg


def _loop_input(x: Tensor | None, key: str, shape: torch.Size) -> Tensor | None:
    if x is None:
        return None
    if x.dim() != 3 or x.shape[:2] != shape[:2] or x.shape[2] < shape[2]:
        raise ValueError(f"batch[{key!r}]: expected [B, T, >= K] = {tuple(shape)}, "
                         f"got {tuple(x.shape)}")  # fmt: skip
    return x[..., : shape[2]]


def _exit_tokens(cfg: ObjectiveConfig, lb: LossBatch) -> Tokens:
    """The token view the exit term reads under per-loop credit (mask, valid, advantages):
    a token is valid for its exit when it is live and its exit readout's current and ratio-base
    log-probs are finite (the proximal one when given, else the behaviour one; both with a
    behaviour weight), as `last` validates the same token."""
    mask = lb.mask
    assert isinstance(mask, Tensor)
    live = mask > 0
    cur = _require(lb.logp, "logp", "(the exit readout's) with loop_weight")
    valid = live & torch.isfinite(cur.detach())
    bases = [lb.prox_logp if lb.prox_logp is not None else lb.behav_logp]
    bases += [lb.behav_logp, lb.prox_logp] if behaviour_weighted(cfg) else []
    for x in bases:
        if isinstance(x, Tensor):
            valid &= torch.isfinite(x.detach())
    zero = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    adv = torch.where(valid, _advantages(cfg, lb.advantages, mask.shape), 0.0)
    return Tokens(mask=mask, live=live, valid=valid, logp=zero, base=zero, advantages=adv,
                  log_ratio=zero, ratio=zero + 1.0)  # fmt: skip


def _loop_policy_loss(
    cfg: ObjectiveConfig, kind: Kind, lb: LossBatch, lazy: bool = False
) -> tuple[Tensor, dict[str, Any]]:
    """Per-loop credit (docs/OBJECTIVES.md "Per-loop credit"):

        l_t = sum_k w_tk l_t(logp_tk, base_tk, ...),   loss = aggregate(l, mask)

    the kind's surrogate and every TERM at loop k with that loop's current / proximal /
    reference log-probs and entropy; the behaviour weight (and its rejections) once per token
    from the exit loop's proximal log-prob (`prox_logp`; the behaviour log-prob exists there
    only). A token is read at loop k when w_tk > 0. Weights with a gradient (a ``loop_weight``
    that requires grad: learned, exit_pdf with exit_pdf_gradient) get RLTT's policy-gradient
    term as their loss, l_t += sum_k (w_tk -
    sg(w_tk)) sg(-A_t logp_tk): 0 in value and in every other gradient (every ratio
    surrogate's own w-gradient vanishes at the proximal point, where each loop's ratio is 1).
    A sampled exit's term (exit_coef, exit_entropy_coef) is added once per token, not per
    loop: the exit e_t is one decision per token whatever loops its token term credits
    (`_exit_tokens`). Metrics: w-weighted means over
    (token, loop) pairs; pg_loss aggregated like the loss; loop_depth_mean: the token mean of
    sum_k k w_tk (e_t for last)."""
    mask = lb.mask
    w_all = lb.loop_weight
    assert w_all is not None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or w_all.shape[:2] != mask.shape:
        raise ValueError("batch['loop_weight']: expected [B, T, K] over the [B, T] mask")
    shape = w_all.shape
    logp = _loop_input(lb.loop_logp, "loop_logp", shape)
    if logp is None:
        raise ValueError("batch['loop_logp']: required with loop_weight")
    ent = _loop_input(lb.loop_entropy, "loop_entropy", shape)
    prox = _loop_input(lb.loop_prox, "loop_prox", shape)
    ref = _loop_input(lb.loop_ref, "loop_ref", shape)
    learned = w_all.requires_grad  # learned, or exit_pdf_gradient (learner.objectives.loops)
    w_grad = w_all.float()
    w_all = w_grad.detach()
    corr = None
    if behaviour_weighted(cfg):
        prox_e = _require(lb.prox_logp, "prox_logp", "(the exit loop's) with loop_weight")
        behav = _require(lb.behav_logp, "behav_logp", "for the behaviour weight")
        corr = rollout_correction(cfg, mask, prox_e, behav)
    sums: dict[str, Tensor] = {}
    total = pg = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    live = mask > 0
    for k in range(shape[2]):
        wk = w_all[..., k]
        if not bool((live & (wk > 0)).any()):
            continue
        mk = torch.where(wk > 0, mask.float(), 0.0)
        part = LossBatch(
            mask=mk * wk, advantages=lb.advantages, logp=logp[..., k],
            entropy=None if ent is None else ent[..., k], behav_logp=lb.behav_logp,
            prox_logp=None if prox is None else prox[..., k],
            ref_logp=None if ref is None else ref[..., k], normalizer=lb.normalizer,
        )  # fmt: skip
        tok, _ = _tokens(cfg, kind, part, 1.0, DEFAULT_VOCAB_CHUNK, correction=corr)
        m: Metrics = {}
        pg_k, total_k, _ = _token_loss(cfg, kind, tok, corr, m, lb.normalizer)
        pg, total = pg + wk * pg_k, total + wk * total_k
        if learned:  # + (w - sg(w)) sg(-A logp_k): value 0, the weights' RLTT gradient
            rltt = torch.where(mk > 0, -lb.advantages * logp[..., k], 0.0).detach()
            total = total + (w_grad[..., k] - wk) * rltt
        with torch.no_grad():
            m["ratio_mean"] = masked_mean(tok.ratio, tok.mask)
            lr = tok.log_ratio
            m["approx_kl"] = masked_mean(ratio_from_log(-lr) - 1.0 + lr, tok.mask)
            m["invalid_frac"] = masked_mean((tok.live & ~tok.valid).float(), tok.mask)
            share = torch.where(live, mk * wk, 0.0).sum()
            for key, v in m.items():
                sums[key] = sums.get(key, 0.0) + v.float() * share
    exit_m: Metrics = {}
    if uses_exit_term(cfg) or lb.exit_entropy is not None:  # once per token, not per loop
        total = total + exit_term(cfg, lb, _exit_tokens(cfg, lb), exit_m)
    agg = mask
    if corr is not None and not cfg.is_rejected_in_denominator:
        agg = torch.where(corr.rejected, 0.0, mask)
    norm, length = lb.normalizer, cfg.loss_scale_length
    loss = aggregate(total, agg, cfg.aggregation, norm, length)
    n = torch.where(live, mask.float(), 0.0).sum().clamp_min(1e-12)
    metrics: Metrics = {k: v / n for k, v in sums.items() if k != "pg_loss"} | exit_m
    metrics["pg_loss"] = aggregate(pg.detach(), agg, cfg.aggregation, norm, length)
    loop_no = torch.arange(1, shape[2] + 1, dtype=torch.float32, device=w_all.device)
    metrics["loop_depth_mean"] = masked_mean((w_all * loop_no).sum(-1), mask)  # credited loop
    metrics["num_tokens"] = live.sum()
    metrics["loss"] = loss.detach()
    return loss, _to_floats(metrics, lazy)


def policy_loss(
    cfg: ObjectiveConfig,
    batch: LossBatch | Mapping[str, Any],
    *,
    temperature: float = 1.0,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    lazy: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """Policy loss of `cfg.kind` over a (micro-)batch (``temperature`` and ``vocab_chunk``: of
    the token statistics of batch logits); a mapping is read as `LossBatch.of(batch)`.
    ``lazy``: the metrics as float32 0-d tensors, not read off the device (`_to_floats`).

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
        all kinds:   l += kl_coef * k(logp, ref_logp) - entropy_coef * H   (TERMS)
        exit term:   l += exit_coef * clip_surrogate(exp(exit_logp - exit_base), A)
                     - exit_entropy_coef * H_exit   (ppo / grpo; learner.objectives.exit_term)
    loss = aggregate(l, mask, cfg.aggregation, batch.normalizer).

    Returns (scalar loss, metrics): mask-weighted token means of per-token quantities;
    fractions are of mask tokens.
    """
    lb = LossBatch.of(batch)
    kind = KIND_REGISTRY[cfg.kind]
    if lb.loop_weight is not None:
        return _loop_policy_loss(cfg, kind, lb, lazy)
    tok, corr = _tokens(cfg, kind, lb, temperature, vocab_chunk)
    metrics: Metrics = {}
    pg, total, agg = _token_loss(cfg, kind, tok, corr, metrics, lb.normalizer)
    if uses_exit_term(cfg) or lb.exit_entropy is not None:  # the exit as an action
        total = total + exit_term(cfg, lb, tok, metrics)
    mask, norm, length = tok.mask, lb.normalizer, cfg.loss_scale_length
    loss = aggregate(total, agg, cfg.aggregation, norm, length)
    with torch.no_grad():
        metrics["ratio_mean"] = masked_mean(tok.ratio, mask)
        lr = tok.log_ratio
        metrics["approx_kl"] = masked_mean(ratio_from_log(-lr) - 1.0 + lr, mask)
    metrics["invalid_frac"] = masked_mean((tok.live & ~tok.valid).float(), mask)
    metrics["num_tokens"] = tok.live.sum()
    metrics["loss"] = loss.detach()
    return loss, _to_floats(metrics, lazy)


def value_loss(
    cfg: ObjectiveConfig, batch: ValueBatch | Mapping[str, Any], *, lazy: bool = False
) -> tuple[Tensor, dict[str, Any]]:
    """Clipped critic loss over a `ValueBatch` (or a mapping of its keys); returns (scalar
    loss, metrics; ``lazy``: unread tensors, as `policy_loss`)."""
    vb = ValueBatch.of(batch)
    mask = vb.mask
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError("batch['mask']: required, a [B, T] float tensor")
    values = _require(_token_tensor(vb.values, "values", mask.shape), "values", "")
    old = _require(_token_tensor(vb.old_values, "old_values", mask.shape), "old_values", "")
    returns = _require(_token_tensor(vb.returns, "returns", mask.shape), "returns", "")
    live = mask > 0
    v = torch.where(live, values.float(), 0.0)
    o = torch.where(live, old.float().detach(), 0.0)
    r = torch.where(live, returns.float().detach(), 0.0)
    per_tok, clipped = value_loss_terms(v, o, r, cfg.value_clip)
    loss = aggregate(per_tok, mask, cfg.aggregation, vb.normalizer, cfg.loss_scale_length)
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_frac": masked_mean(clipped.float(), mask),
        "value_mean": masked_mean(v, mask),
        "return_mean": masked_mean(r, mask),
    }
    return loss, _to_floats(metrics, lazy)
