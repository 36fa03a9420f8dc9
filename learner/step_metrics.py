"""Per-step training metrics: sums, token-weighted means and maxima over DP ranks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from learner.batching import to_device


def all_reduce_(t: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a CPU tensor over `group`, through the current CUDA device when
    the group's backend is NCCL (which has no CPU tensors); returns `t`."""
    if dist.get_backend(group) == "nccl":
        dev = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(dev, op=op, group=group)
        t.copy_(dev.cpu())
    else:
        dist.all_reduce(t, op=op, group=group)
    return t


Number = float | torch.Tensor
"""A metric's value: a float, or a 0-d tensor on any device (read at `StepMetrics.reduce`)."""


class StepMetrics:
    """Sums, token-weighted means and maxima, reduced over the data-parallel group.

    A value may be a 0-d tensor on the card: sums accumulate there in float64 (the same bits
    as Python floats added in the same order: a float32 value converts to float64 exactly,
    as ``float(t)`` does) and the card is read once, at `reduce`, not once per value (learner.batching's "No device read on the way in")."""

    def __init__(self) -> None:
        self.sums: dict[str, Number] = {}
        self.weighted: dict[str, Number] = {}
        self.weights: dict[str, Number] = {}
        self.maxes: dict[str, list[Number]] = {}

    def add_sum(self, key: str, value: Number) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + _exact(value)

    def add_mean(self, key: str, value: Number, weight: Number) -> None:
        self.add_weighted(key, _exact(value) * _exact(weight), weight)

    def add_weighted(self, key: str, weighted_sum: Number, weight: Number) -> None:
        self.weighted[key] = self.weighted.get(key, 0.0) + _exact(weighted_sum)
        self.weights[key] = self.weights.get(key, 0.0) + _exact(weight)

    def add_max(self, key: str, value: Number) -> None:
        self.maxes.setdefault(key, []).append(_exact(value))

    def reduce(self, group: Any) -> dict[str, float]:
        sk, wk, mk = sorted(self.sums), sorted(self.weighted), sorted(self.maxes)
        flat = _floats([self.sums[k] for k in sk] + [self.weighted[k] for k in wk]
                       + [self.weights[k] for k in wk])  # fmt: skip
        each = _floats([v for k in mk for v in self.maxes[k]])
        peak, at = [], 0
        for k in mk:
            peak.append(max(each[at : at + len(self.maxes[k])]))
            at += len(self.maxes[k])
        packed = torch.tensor(flat, dtype=torch.float64)
        peaks = torch.tensor(peak, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            all_reduce_(packed, group)
            all_reduce_(peaks, group, dist.ReduceOp.MAX)
        vals, n = packed.tolist(), len(sk)
        out = dict(zip(sk, vals[:n], strict=True))
        for i, k in enumerate(wk):
            w = vals[n + len(wk) + i]
            out[k] = vals[n + i] / w if w > 0 else 0.0
        out.update(zip(mk, peaks.tolist(), strict=True))
        return out


def _exact(v: Number) -> Number:
    """A tensor value as float64 (exactly the float ``float(t)`` gives); a float stays one."""
    if isinstance(v, torch.Tensor):
        return v.detach().double()
    return float(v)


def _floats(values: list[Number]) -> list[float]:
    """The values as floats, reading each device once (one stack per device)."""
    out: list[float] = [v if isinstance(v, float) else math.nan for v in values]
    by: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by.setdefault(v.device, []).append(i)
    for idx in by.values():
        got = torch.stack([values[i].reshape(()) for i in idx]).tolist()  # type: ignore[union-attr]
        for i, x in zip(idx, got, strict=True):
            out[i] = float(x)
    return out


def record_policy(
    metrics: StepMetrics,
    m: Mapping[str, Number],
    mask: torch.Tensor,
    behav_logp: torch.Tensor,
    learner_logp: torch.Tensor | None,
    n_updates: int,
    rejected: torch.Tensor | None = None,
) -> None:
    """Add one micro-batch's policy_loss metrics ``m`` (shares of a global sum: a mean per
    update; the rest token-weighted) and, when ``learner_logp`` is given (the proximal pass,
    else the step's first update's forward), the behaviour vs learner log-prob statistics
    (`mismatch_stats`; ``rejected``: the rollout correction's rejected tokens [B, T] bool).
    Both trainer backends record through it, so their step metrics are the same bits."""
    weight = (mask > 0).sum()
    for k, v in m.items():
        if k in ("loss", "pg_loss", "num_tokens"):
            metrics.add_sum(k, _exact(v) / n_updates)
        else:
            metrics.add_mean(k, v, weight)
    if learner_logp is not None:
        mismatch_stats(metrics, mask, behav_logp, learner_logp, rejected)


def mismatch_stats(
    metrics: StepMetrics, mask: torch.Tensor, behav_logp: torch.Tensor,
    learner_logp: torch.Tensor, rejected: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The behaviour (mu) vs learner (pi) mismatch family over the live tokens (mask > 0, both
    log-probs finite), d = log pi - log mu per token, D_b = sum_t d over row b:

        logp_mismatch_mean / _max   mean / max |d|
        kl                          k3 per token: mean (e^d - 1 - d)   (KL(mu || pi) >= 0)
        mismatch_kl_token           k1 per token: mean (-d)            (KL(mu || pi), signed)
        mismatch_kl_seq             mean over rows with live tokens of -D_b
        mismatch_k3_seq             mean over those rows of e^D - 1 - D (D clamped to +-20)
        mismatch_masked_frac        tokens the rollout correction rejects (with ``rejected``)
    """
    live = (mask > 0) & torch.isfinite(behav_logp) & torch.isfinite(learner_logp)
    d = torch.where(live, learner_logp.float() - behav_logp.float(), 0.0)
    n = live.sum()  # (tensors: StepMetrics reads the card once a step, not once a value)
    metrics.add_weighted("logp_mismatch_mean", d.abs().sum(), n)
    metrics.add_weighted("kl", (d.clamp(-20, 20).exp() - 1 - d).sum(), n)
    metrics.add_max("logp_mismatch_max", d.abs().max() if d.numel() else 0.0)
    metrics.add_weighted("mismatch_kl_token", -d.sum(), n)
    rows = live.any(dim=1)
    seq = d.double().sum(dim=1)
    metrics.add_weighted("mismatch_kl_seq", torch.where(rows, -seq, 0.0).sum(), rows.sum())
    clamped = seq.clamp(-20, 20)
    k3 = torch.where(rows, clamped.exp() - 1 - clamped, 0.0)
    metrics.add_weighted("mismatch_k3_seq", k3.sum(), rows.sum())
    if rejected is not None:
        metrics.add_weighted("mismatch_masked_frac", (rejected & (mask > 0)).sum(),
                             (mask > 0).sum())  # fmt: skip


def record_value(
    metrics: StepMetrics, m: Mapping[str, Number], mask: torch.Tensor, n_updates: int
) -> None:
    """Add one micro-batch's value_loss metrics (value_loss: a share of a global sum)."""
    weight = (mask > 0).sum()
    for k, v in m.items():
        if k == "value_loss":
            metrics.add_sum(k, _exact(v) / n_updates)
        else:
            metrics.add_mean(k, v, weight)


def row_mismatch(
    out: torch.Tensor, row0: int, mask: torch.Tensor, behav_logp: torch.Tensor,
    learner_logp: torch.Tensor,
) -> None:  # fmt: skip
    """out[row0 : row0 + B] = max(itself, max over each row's live tokens of |learner -
    behaviour| log-prob); rows without a live token keep their value."""
    live = (mask > 0) & torch.isfinite(behav_logp) & torch.isfinite(learner_logp)
    d = torch.where(live, (learner_logp.float() - behav_logp.float()).abs(), 0.0)
    per = d.amax(dim=1).double() if d.numel() else torch.zeros(mask.shape[0], device=d.device)
    seen = live.any(dim=1)
    if per.device != out.device:  # (to a card without a sync; off one: a read)
        per, seen = to_device(per, out.device), to_device(seen, out.device)
    rows = out[row0 : row0 + per.shape[0]]
    rows.copy_(torch.where(seen, torch.maximum(rows, per), rows))


def exit_mismatch(out: torch.Tensor, row0: int, mb: Any, stats: dict[str, torch.Tensor],
                  first: bool) -> None:  # fmt: skip
    """A sampled exit's claim checked like the token's: max |learner - claimed| exit log-prob
    into the rows' mismatch (``row_mismatch``) of micro-batch ``mb`` (the proximal pass's
    when it ran, else this forward's at the step's starting weights: ``first``, the first
    update)."""
    claim = mb.extra.get("exit_behav")
    mine = mb.extra.get("exit_prox")
    if mine is None and first and "exit_logp" in stats:
        mine = stats["exit_logp"].detach()
    if claim is not None and mine is not None:
        row_mismatch(out, row0, mb.mask, claim, mine)
