"""Per-token loss terms and their aggregation; `learner/objectives/` composes them.

Every function here is elementwise over [B, T] tensors except `aggregate`. None of them
looks at a mask except `aggregate` and `masked_mean`: callers sanitise invalid tokens
first (`learner/objectives/` replaces every input of a token with a non-finite
log-prob by 0 before any `exp`, so no inf reaches a product in the backward pass).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from learner.objective_config import AGGREGATIONS, KL_CAP_DEFAULT, KL_ESTIMATORS, LENGTH_NORMED

__all__ = [
    "MAX_LOG_RATIO",
    "ClippedSurrogate",
    "aggregate",
    "behaviour_weight",
    "binary_kl",
    "clipped_surrogate",
    "divergence_surrogate",
    "flow_dppo_surrogate",
    "kl_penalty",
    "masked_mean",
    "ratio_from_log",
    "value_loss_terms",
]


MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to [-20, 20] before `exp` (ratios in [2e-9, 4.9e8]): only a
guard against inf, far outside any trust region; beyond it the ratio's gradient is 0."""


def ratio_from_log(log_ratio: Tensor) -> Tensor:
    """exp(clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))."""
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mask-weighted mean of x over [B, T] as a detached fp32 0-d tensor (0 for an empty
    mask). Returning a tensor lets callers turn all their metrics into floats at once."""
    with torch.no_grad():
        w = torch.where(mask > 0, mask.float(), 0.0)
        num = (torch.where(w > 0, x.float(), 0.0) * w).sum()
        return num / w.sum().clamp_min(1e-12)


def aggregate(
    loss_bt: Tensor,
    mask: Tensor,
    mode: str,
    normalizer: float | Tensor | None = None,
    length: int | None = None,
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    With m the mask (> 0 on tokens; a float weight) and n_b = sum_t m_bt:
        token_mean:         sum_bt m l / sum_bt m
        seq_mean:           (1/S) sum_b [ sum_t m l / n_b ]    S = #sequences with n_b > 0
        seq_mean_token_sum: (1/S) sum_b sum_t m l
        seq_mean_token_sum_norm, dr_grpo: (1/S) sum_b sum_t m l / L,  L = ``length``
    `normalizer`, when given, replaces the denominator (sum_bt m, or S): pass the count
    over the whole optimizer step so that micro-batches and data-parallel ranks each
    contribute their share of one global mean. An empty mask gives 0 (still connected
    to the graph). Positions with m <= 0 are excluded through `where`, so garbage there
    (even inf/NaN) does not leak.
    """
    if loss_bt.shape != mask.shape or loss_bt.dim() != 2:
        raise ValueError(
            f"loss, mask: expected equal [B, T] shapes, got {tuple(loss_bt.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {mode!r}")
    live = mask > 0
    w = torch.where(live, mask.to(loss_bt.dtype), 0.0)
    weighted = torch.where(live, loss_bt, 0.0) * w
    if mode == "token_mean":
        denom = w.sum() if normalizer is None else normalizer
        return weighted.sum() / torch.as_tensor(denom, dtype=loss_bt.dtype).clamp_min(1e-12)
    per_seq = weighted.sum(-1)
    n_b = w.sum(-1)
    if mode == "seq_mean":
        per_seq = per_seq / n_b.clamp_min(1e-12)
    n_seq = (n_b > 0).sum() if normalizer is None else normalizer
    out = per_seq.sum() / torch.as_tensor(n_seq, dtype=loss_bt.dtype).clamp_min(1)
    if mode in LENGTH_NORMED:
        if length is None or length < 1:
            raise ValueError(f"aggregation {mode}: needs length >= 1, got {length}")
        out = out / length
    return out


class ClippedSurrogate(NamedTuple):
    """Per-token outputs of `clipped_surrogate` ([B, T] each)."""

    loss: Tensor
    """-min(r A, clip(r) A), dual-clipped when configured."""
    clipped_low: Tensor
    """bool: the clipped branch is active with r < 1 - eps_low (gradient 0)."""
    clipped_high: Tensor
    """bool: the clipped branch is active with r > 1 + eps_high (gradient 0)."""
    dual_clipped: Tensor
    """bool: the dual clip -c A (A < 0) is active (gradient 0)."""


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> ClippedSurrogate:
    """PPO clipped surrogate per token, as a loss (to minimise).

        l = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)
        dual clip (A < 0 only): l = min(l, -c A)

    The dual clip bounds the loss of a negative-advantage token whose ratio has grown
    large (l = r |A| unbounded otherwise) at c |A|, c > 1.
    """
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        active = clipped > unclipped
        clipped_low = active & (ratio < 1.0 - eps_low)
        clipped_high = active & (ratio > 1.0 + eps_high)
    dual = torch.zeros_like(active)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        with torch.no_grad():
            dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return ClippedSurrogate(loss, clipped_low, clipped_high, dual)


@torch.no_grad()
def behaviour_weight(
    log_weight: Tensor, cap: float | None, mode: str, low: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Importance weight w = exp(log_weight) of the behaviour -> proximal mismatch.

    log_weight = prox_logp - behav_logp (per token, or a row's sum / mean broadcast over it:
    objective.is_level). With a cap C (and a lower bound c, ``low``):
        mode "truncate": w = min(w, C), max(w, c)      (truncated IS, TIS)
        mode "mask":     w = w if c <= w <= C else 0   (the token is rejected)
    cap None: w uncapped. No gradient flows through w.

    Returns (w, masked, truncated): [B, T] fp32 weights and the two bool indicators.
    """
    w = ratio_from_log(log_weight.float())
    over = torch.zeros_like(w, dtype=torch.bool) if cap is None else w > cap
    if cap is None:
        return w, over, over
    if low is not None:
        out = over | (w < low)
        if mode == "truncate":
            return w.clamp(low, cap), torch.zeros_like(out), out
        if mode == "mask":
            return torch.where(out, 0.0, w), out, torch.zeros_like(out)
    if mode == "truncate":
        return w.clamp_max(cap), torch.zeros_like(over), over
    if mode == "mask":
        return torch.where(over, 0.0, w), over, torch.zeros_like(over)
    raise ValueError(f"is_mode: expected 'truncate' or 'mask', got {mode!r}")


def flow_dppo_surrogate(
    ratio: Tensor, advantages: Tensor, kl: Tensor, threshold: float
) -> tuple[Tensor, Tensor]:
    """Categorical Flow-DPPO per-token loss: unclipped -r A with divergent updates dropped.

        drop = KL(old || new) > threshold  and  ((A > 0 and r > 1) or (A < 0 and r < 1))
        l    = 0 if drop else -r A

    A dropped token contributes 0 to the loss and exactly 0 to the gradient: its update
    already moved the policy outside the trust region in the direction the advantage
    pushes. Updates that move back (A > 0, r < 1 or A < 0, r > 1) are kept whatever
    the KL, and so is every update inside the trust region.

    Returns (loss [B, T], dropped [B, T] bool).
    """
    with torch.no_grad():
        pushing = ((advantages > 0) & (ratio > 1.0)) | ((advantages < 0) & (ratio < 1.0))
        dropped = pushing & (kl > threshold)
    loss = torch.where(dropped, 0.0, -ratio * advantages)
    return loss, dropped


def divergence_surrogate(
    ratio: Tensor,
    logp: Tensor,
    anchor_logp: Tensor,
    advantages: Tensor,
    divergence: str,
    threshold: float,
    threshold_low: float | None = None,
    is_cap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Divergence PPO (Qi et al. 2026, arXiv 2602.04879, the binary approximation): the
    unclipped -r A with r = pi / mu, where a token is dropped when the binary divergence
    between Bernoulli(mu(a)) and Bernoulli(pi(a)) of its sampled token exceeds ``threshold``
    and the update pushes further out (A > 0 and pi > mu, or A < 0 and pi < mu):

        tv:  |pi(a) - mu(a)|
        kl:  mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi))    (`binary_kl`, log space)

    mu is the anchor (behaviour or proximal policy), pi the current one. ``threshold_low``
    (None: ``threshold``) bounds the A < 0 updates, ``threshold`` the A > 0 ones. With
    ``is_cap`` C a kept token's r above C enters as r * C / sg(r): loss value -C A, gradient
    -C A grad(log pi) (verl's and TRL's truncated weight min(r, C)). Returns (loss [B, T],
    dropped [B, T] bool, divergence [B, T])."""
    with torch.no_grad():
        pi, mu = logp.detach().float().exp(), anchor_logp.detach().float().exp()
        if divergence == "tv":
            div = (pi - mu).abs()
        elif divergence == "kl":
            div = binary_kl(anchor_logp.detach().float(), logp.detach().float())
        else:
            raise ValueError(f"divergence: expected 'tv' or 'kl', got {divergence!r}")
        up, down = (advantages > 0) & (pi > mu), (advantages < 0) & (pi < mu)
        low = threshold if threshold_low is None else threshold_low
        dropped = (up & (div > threshold)) | (down & (div > low))
    if is_cap is not None:
        with torch.no_grad():
            over = ratio > is_cap
        ratio = torch.where(over, ratio * (is_cap / ratio.detach()), ratio)
    loss = torch.where(dropped, 0.0, -ratio * advantages)
    return loss, dropped, div


BINARY_LOGP_RANGE = (math.log(1e-12), -1e-12)
"""`binary_kl` clamps both log-probs into this range: probabilities in [1e-12, 1 - 1e-12],
held in log space, where fp32 resolves them (next to 1, fp32 probabilities step by 6e-8)."""


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2 (Maechler 2012)."""
    return torch.where(x > -math.log(2.0), (-torch.expm1(x)).log(), torch.log1p(-x.exp()))


def binary_kl(anchor_logp: Tensor, logp: Tensor) -> Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) of the sampled token, mu = exp(anchor_logp),
    pi = exp(logp), computed from the log-probs:

        mu (log mu - log pi) + (1 - mu) (log(1 - mu) - log(1 - pi)),  1 - mu = -expm1(log mu)

    Both log-probs are first clamped into `BINARY_LOGP_RANGE`, so every value is finite
    (at most about 27.6), for a confident token (log-prob 0 or within 3e-8 of it: there
    1 - exp(logp) rounds to 0 in fp32) as for -inf.
    """
    lo, hi = BINARY_LOGP_RANGE
    a, b = anchor_logp.clamp(lo, hi), logp.clamp(lo, hi)
    return a.exp() * (a - b) - torch.expm1(a) * (_log1mexp(a) - _log1mexp(b))


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, estimator: str, cap: float | None = KL_CAP_DEFAULT
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token, differentiable in logp.

    With d = ref_logp - logp (log of pi_ref / pi at the sampled token):
        k1 = -d
        k2 = d^2 / 2
        k3 = exp(d) - 1 - d      (>= 0, unbiased)
    then clamped to [-cap, cap] (gradient 0 outside; objective.kl_cap; None: unclamped).
    """
    d = ref_logp - logp
    if estimator == "k1":
        k = -d
    elif estimator == "k2":
        k = 0.5 * d * d
    elif estimator == "k3":
        k = ratio_from_log(d) - 1.0 - d
    else:
        raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
    return k if cap is None else k.clamp(-cap, cap)


def value_loss_terms(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Clipped critic loss per token.

        v_clip = old + clamp(v - old, -value_clip, value_clip)
        l      = 0.5 * max((v - R)^2, (v_clip - R)^2)       (0.5 (v - R)^2 without a clip)

    Returns (loss [B, T], clipped [B, T] bool: the clipped term is strictly larger).
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (v_clip - returns) ** 2
    with torch.no_grad():
        active = clipped > unclipped
    return 0.5 * torch.maximum(unclipped, clipped), active
