"""Advantage estimators: token-level GAE (PPO with a critic) and group-relative (GRPO).

Both run once per training step over the whole step's batch, before it is cut into
micro-batches (group statistics need every member of a group), under `torch.no_grad()`,
in fp32. Token tensors are [B, T], right- or left-padded, with a float `mask` (> 0 marks
a response token); values at masked positions are ignored, whatever they hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "broadcast_to_tokens",
    "discounted_returns",
    "gae",
    "group_advantages",
    "group_baseline",
    "normalize_advantages",
    "rloo_advantages",
    "whiten_tokens",
]


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a value in [0, 1], got {value}")


@torch.no_grad()
def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    last_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    The steps of a sequence are its masked-in tokens in order; masked-out positions
    (padding on either side, or holes such as tool output) are skipped, not treated as
    steps. With V(after the last step) = 0 (the episode ends; nothing is bootstrapped):

        delta_t = r_t + gamma * V(next step) - V_t
        A_t     = delta_t + gamma * lam * A(next step)
        R_t     = A_t + V_t   (the critic's regression target)

    Args:
        rewards: [B, T] per-token rewards (typically nonzero on the last token only).
        values: [B, T] critic values V_t of the pre-update critic.
        mask: [B, T] float, > 0 on response tokens.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].
        last_values: [B] V after each row's last step (bootstrapping a row cut at the length
            limit: objective.bootstrap_truncated, as AReaL); None = 0 for every row.

    Returns:
        (advantages, returns), both [B, T] fp32, exactly 0 at masked-out positions.
    """
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            "rewards, values, mask: expected equal [B, T] shapes, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    r = rewards.float()
    v = values.float()
    live = mask > 0
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0]) if last_values is None else last_values.float()
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = live[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = torch.where(step, delta + gamma * lam * next_adv, 0.0)
        adv[:, t] = a_t
        next_value = torch.where(step, v[:, t], next_value)
        next_adv = torch.where(step, a_t, next_adv)
    returns = torch.where(live, adv + v, 0.0)
    return adv, returns


@torch.no_grad()
def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
    singleton: str = "zero",
) -> Tensor:
    """Group-relative (GRPO) per-sample advantages.

    For sample i in group g with n_g members, mean m_g and sample standard deviation
    s_g (Bessel-corrected, n_g - 1 in the denominator, as `torch.std`):

        A_i = r_i - m_g                     (normalize_std=False, "Dr. GRPO")
        A_i = (r_i - m_g) / (s_g + eps)     (normalize_std=True)

    A group whose rewards are all equal gets exactly 0 (no signal, never 0/0), and so does a
    group of one sample with ``singleton="zero"``; ``"reward"`` gives it verl's mean 0 and
    std 1 instead: r / (1 + eps), or r without normalize_std. Group ids are arbitrary
    integers; members need not be adjacent.
    Statistics are computed in fp64.

    Args:
        rewards: [N] scalar reward per sample (completion).
        group_ids: [N] integer id of the prompt each sample answers.
        normalize_std: divide by the group's standard deviation.
        eps: >= 0, added to the standard deviation.

    Returns:
        [N] fp32 advantages; `broadcast_to_tokens` spreads them over each completion.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "rewards, group_ids: expected equal [N] shapes, got "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids: expected an integer tensor, got {group_ids.dtype}")
    if not eps >= 0.0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    r = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    zeros = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    mean = zeros.index_add(0, inv, r) / count
    dev = r - mean[inv]
    hi = zeros.scatter_reduce(0, inv, r, reduce="amax", include_self=False)
    lo = zeros.scatter_reduce(0, inv, r, reduce="amin", include_self=False)
    informative = (count[inv] > 1) & (hi[inv] > lo[inv])
    if normalize_std:
        var = zeros.index_add(0, inv, dev * dev) / (count - 1).clamp_min(1)
        dev = dev / (var.sqrt()[inv] + eps)
    out = torch.where(informative, dev, 0.0)
    if singleton == "reward":
        out = torch.where(count[inv] == 1, r / (1.0 + eps) if normalize_std else r, out)
    elif singleton != "zero":
        raise ValueError(f"singleton: expected 'zero' or 'reward', got {singleton!r}")
    return out.float()


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(r fp64 [N], member count [N], group sum [N]) of each sample's group."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape or group_ids.is_floating_point():
        raise ValueError(
            "rewards, group_ids: expected equal [N] shapes, integer ids, got "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)} {group_ids.dtype}"
        )
    r = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    zeros = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    return r, count[inv], zeros.index_add(0, inv, r)[inv]


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_ids: Tensor, singleton: str = "zero") -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the group's other samples
    = n / (n - 1) (r_i - m_g). A group of one: 0 (``singleton="zero"``) or r (``"reward"``,
    verl). [N] fp32, statistics in fp64."""
    r, n, total = _group_stats(rewards, group_ids)
    loo = r - (total - r) / (n - 1).clamp_min(1)
    if singleton not in ("zero", "reward"):
        raise ValueError(f"singleton: expected 'zero' or 'reward', got {singleton!r}")
    lone = r if singleton == "reward" else torch.zeros_like(r)
    return torch.where(n > 1, loo, lone).float()


@torch.no_grad()
def group_baseline(rewards: Tensor, group_ids: Tensor, singleton: str = "zero") -> Tensor:
    """REINFORCE++-baseline's first stage: r_i - m_g ([N] fp32). A group of one: 0
    (``"zero"``) or r (``"reward"``: verl's mean 0)."""
    r, n, total = _group_stats(rewards, group_ids)
    lone = r if singleton == "reward" else torch.zeros_like(r)
    return torch.where(n > 1, r - total / n, lone).float()


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++'s token returns G_t = r_t + gamma G(next step) over each row's masked-in
    tokens (masked-out positions skipped, as in `gae`; G after the last step 0). [B, T] fp32,
    0 at masked-out positions."""
    _check_unit_interval("gamma", gamma)
    r, live = rewards.float(), mask > 0
    out = torch.zeros_like(r)
    nxt = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        g = r[:, t] + gamma * nxt
        out[:, t] = torch.where(live[:, t], g, 0.0)
        nxt = torch.where(live[:, t], g, nxt)
    return out


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence advantages -> [B, T] per-token advantages, 0 where mask == 0."""
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            "advantages, mask: expected [B] and [B, T], got "
            f"{tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    return torch.where(mask > 0, advantages.float()[:, None], 0.0)


@torch.no_grad()
def normalize_advantages(advantages: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """Whiten token advantages over the masked-in tokens: (A - mean) / (std + eps).

    mean and std (population, n in the denominator) are mask-weighted over the batch;
    masked-out positions come back as exactly 0. Used with GAE for PPO.
    """
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages, mask: expected equal shapes, got {tuple(advantages.shape)}, "
            f"{tuple(mask.shape)}"
        )
    live = mask > 0
    w = torch.where(live, mask.double(), 0.0)
    a = torch.where(live, advantages.double(), 0.0)
    total = w.sum().clamp_min(torch.finfo(torch.float64).tiny)
    mean = (w * a).sum() / total
    var = (w * (a - mean) ** 2).sum() / total
    return torch.where(live, (a - mean) / (var.sqrt() + eps), 0.0).float()


@torch.no_grad()
def whiten_tokens(
    adv: Tensor,
    mask: Tensor,
    reduce: Callable[[Tensor], object] | None = None,
    std: str = "population",
) -> Tensor:
    """(A - mean) / (std + 1e-6) over the masked-in tokens, the sums in fp64; ``reduce`` (in
    place on [count, sum, sum of squares]) adds other ranks' shares. ``std``: population
    (n in the denominator) or bessel (n - 1, as verl's masked_whiten). Both trainer backends
    whiten through it (objective.whiten)."""
    w = torch.where(mask > 0, mask.double(), 0.0)
    a = adv.double()
    sums = torch.stack([w.sum(), (w * a).sum(), (w * a * a).sum()])
    if reduce is not None:
        reduce(sums)
    total = sums[0].clamp_min(torch.finfo(torch.float64).tiny)
    mean = sums[1] / total
    var = (sums[2] / total - mean * mean).clamp_min(0.0)
    if std == "bessel":
        var = var * total / (total - 1.0).clamp_min(torch.finfo(torch.float64).tiny)
    elif std != "population":
        raise ValueError(f"std: expected 'population' or 'bessel', got {std!r}")
    return torch.where(mask > 0, (a - mean) / (var.sqrt() + 1e-6), 0.0).float()
