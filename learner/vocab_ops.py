"""Per-token full-vocabulary statistics, computed a vocabulary chunk at a time.

`token_stats` is the one place the learner touches whole [tokens, vocab] logits for the
objectives: the log-prob of the sampled token, the entropy of the current policy, and the
exact KL(old || new) over the full vocabulary (categorical Flow-DPPO's trust region).

Memory contract. The forward never materialises a full [N, V] tensor: it makes two passes
over the vocabulary in slices of `chunk` columns (pass 1: log-sum-exp per chunk, combined
with a log-sum-exp over the chunks; pass 2: entropy and KL sums with the final
normalisers). The backward allocates exactly one [N, V] tensor, the gradient w.r.t.
`logits_new` in `logits_new`'s dtype, and fills it chunk by chunk, recomputing the
softmax of each chunk from the saved inputs and the saved per-token normalisers.
Peak extra memory is therefore one [N, V] gradient plus O(N * chunk) fp32 temporaries.

Numerics. Arithmetic is fp32 for fp32/bf16/fp16 logits (fp64 stays fp64, which lets
`torch.autograd.gradcheck` verify the backward); the per-chunk partial sums of entropy
and KL accumulate in fp64, so the chunk width changes results only by fp32 rounding
inside a chunk. Entries whose probability is exactly 0 (logit -inf, e.g. outside a
top-k/top-p support) contribute exactly 0 to the entropy and to the KL, and nothing NaN
reaches the gradient. A row whose logits are all -inf is an empty distribution: entropy
0, KL 0, log-prob of the target -inf. An entry with old probability > 0 and new logit
-inf makes the KL +inf (it is infinite); the objectives then treat the token as invalid.

Gradient formulas (z = logits / temperature, p = softmax(z_new), q = softmax(z_old),
H = entropy of p), per row, for vocabulary entry j:
    d logp_target / d z_j = [j == target] - p_j
    d H / d z_j           = -p_j * (log p_j + H)
    d KL(q || p) / d z_j  = p_j - q_j
and d/d logits = (d/d z) / temperature. `logits_old` and `targets` get no gradient.

The signature is what a fused GPU kernel (Triton) must reproduce; this module is the
PyTorch reference it is checked against.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from learner.config import DEFAULT_VOCAB_CHUNK

__all__ = ["TokenStats", "contract_token_stats", "token_stats"]


class TokenStats(NamedTuple):
    """Per-token outputs of `token_stats`, each [N] in the compute dtype (fp32 unless fp64 in).

    logp: log pi_new(target), differentiable w.r.t. logits_new.
    entropy: H(pi_new) over the full vocabulary, differentiable w.r.t. logits_new.
    kl: KL(pi_old || pi_new) over the full vocabulary, differentiable w.r.t. logits_new;
        None when logits_old is None.
    logp_old: log pi_old(target) (-inf where the old policy gives the target probability 0),
        no gradient; None when logits_old is None.
    """

    logp: Tensor
    entropy: Tensor
    kl: Tensor | None
    logp_old: Tensor | None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled(logits: Tensor, start: int, stop: int, inv_t: float, dtype: torch.dtype) -> Tensor:
    """logits[:, start:stop] / temperature as a fresh tensor in the compute dtype."""
    return logits[:, start:stop].to(dtype).mul(inv_t)


def _log_normaliser(logits: Tensor, inv_t: float, chunk: int, dtype: torch.dtype) -> Tensor:
    """Row-wise log-sum-exp of logits / temperature, [N]; 0 for an all -inf row."""
    n, v = logits.shape
    per_chunk = torch.empty(n, (v + chunk - 1) // chunk, dtype=dtype, device=logits.device)
    for i, start in enumerate(range(0, v, chunk)):
        per_chunk[:, i] = torch.logsumexp(_scaled(logits, start, start + chunk, inv_t, dtype), -1)
    lse = torch.logsumexp(per_chunk, -1)
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _target_logp(logits: Tensor, targets: Tensor, lse: Tensor, inv_t: float) -> Tensor:
    picked = logits.gather(1, targets[:, None]).squeeze(1).to(lse.dtype)
    return picked * inv_t - lse


class _TokenStatsFn(torch.autograd.Function):
    """Chunked forward/backward of (logp, entropy, kl, logp_old); see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits_new: Tensor,
        logits_old: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dtype = _compute_dtype(logits_new.dtype)
        inv_t = 1.0 / temperature
        n, v = logits_new.shape
        lse_new = _log_normaliser(logits_new, inv_t, chunk, dtype)
        # Chunk partial sums accumulate in fp64 so the result does not depend on the
        # number of chunks beyond fp32 rounding of each chunk's own sum.
        acc = torch.float64
        entropy = torch.zeros(n, dtype=acc, device=logits_new.device)
        has_old = logits_old is not None
        kl = torch.zeros(n if has_old else 0, dtype=acc, device=logits_new.device)
        lse_old = (
            _log_normaliser(logits_old, inv_t, chunk, dtype)
            if logits_old is not None
            else lse_new[:0]
        )
        for start in range(0, v, chunk):
            logp_c = _scaled(logits_new, start, start + chunk, inv_t, dtype).sub_(lse_new[:, None])
            p_c = logp_c.exp()
            entropy -= torch.where(p_c > 0, p_c * logp_c, 0.0).sum(-1)
            if logits_old is not None:
                logq_c = _scaled(logits_old, start, start + chunk, inv_t, dtype)
                logq_c.sub_(lse_old[:, None])
                q_c = logq_c.exp()
                kl += torch.where(q_c > 0, q_c * (logq_c - logp_c), 0.0).sum(-1)
        entropy, kl = entropy.to(dtype), kl.to(dtype)
        logp = _target_logp(logits_new, targets, lse_new, inv_t)
        if logits_old is not None:
            logp_old = _target_logp(logits_old, targets, lse_old, inv_t)
            saved_old = logits_old
        else:
            logp_old = torch.zeros(0, dtype=dtype, device=logits_new.device)
            saved_old = logp_old
        ctx.save_for_backward(logits_new, saved_old, targets, lse_new, lse_old, entropy)
        ctx.has_old = has_old
        ctx.inv_t = inv_t
        ctx.chunk = chunk
        ctx.mark_non_differentiable(logp_old)
        return logp, entropy, kl, logp_old

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: Tensor, g_ent: Tensor, g_kl: Tensor, _g_logp_old: Tensor
    ) -> tuple[Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits_new, logits_old, targets, lse_new, lse_old, entropy = ctx.saved_tensors
        inv_t: float = ctx.inv_t
        chunk: int = ctx.chunk
        dtype = lse_new.dtype
        n, v = logits_new.shape
        grad = torch.empty_like(logits_new)
        # Coefficient of p_j that does not depend on j: -g_logp (+ g_kl when there is a KL).
        p_coef = (g_kl - g_logp) if ctx.has_old else -g_logp
        rows = torch.arange(n, device=logits_new.device)
        for start in range(0, v, chunk):
            stop = min(start + chunk, v)
            logp_c = _scaled(logits_new, start, stop, inv_t, dtype).sub_(lse_new[:, None])
            p_c = logp_c.exp()
            # dH/dz_j = -p_j (log p_j + H); 0 where p_j == 0 (log p_j may be -inf there).
            ent_term = torch.where(p_c > 0, p_c * (logp_c + entropy[:, None]), 0.0)
            g_c = p_c.mul_(p_coef[:, None]).sub_(ent_term.mul_(g_ent[:, None]))
            del ent_term, logp_c
            if ctx.has_old:
                q_c = _scaled(logits_old, start, stop, inv_t, dtype).sub_(lse_old[:, None]).exp_()
                g_c.sub_(q_c.mul_(g_kl[:, None]))
                del q_c
            local = targets - start
            hit = (local >= 0) & (local < stop - start)
            g_c[rows[hit], local[hit]] += g_logp[hit]
            grad[:, start:stop] = g_c.mul_(inv_t)
        return grad, None, None, None, None


def token_stats(
    logits_new: Tensor,
    logits_old: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_VOCAB_CHUNK,
) -> TokenStats:
    """Selected log-prob, entropy and exact KL(old || new) per token, in vocabulary chunks.

    Args:
        logits_new: [N, V] current-policy logits, any float dtype; the only input that gets a
            gradient.
        logits_old: [N, V] old-policy logits (the proximal policy recomputed by the learner
            before the update), or None to skip the KL. -inf entries (outside a truncated
            sampling support) are allowed and contribute exactly 0.
        targets: [N] integer token ids in [0, V), the sampled tokens.
        temperature: > 0; both logit tensors are divided by it (the distribution actually
            sampled from, docs/CONTRACTS.md 4).
        chunk: >= 1, vocabulary columns processed at once; need not divide V.

    Returns:
        TokenStats(logp, entropy, kl, logp_old), each [N] in fp32 (fp64 for fp64 logits).

    Raises:
        ValueError: on a bad shape, dtype, temperature or chunk.
    """
    if logits_new.dim() != 2 or not logits_new.is_floating_point():
        raise ValueError(
            f"logits_new: expected a floating [N, V] tensor, got {tuple(logits_new.shape)} "
            f"{logits_new.dtype}"
        )
    if logits_old is not None:
        if logits_old.shape != logits_new.shape or not logits_old.is_floating_point():
            raise ValueError(
                f"logits_old: expected a floating tensor of shape {tuple(logits_new.shape)}, "
                f"got {tuple(logits_old.shape)} {logits_old.dtype}"
            )
        logits_old = logits_old.detach()
    if targets.shape != logits_new.shape[:1] or targets.is_floating_point():
        raise ValueError(
            f"targets: expected integer ids of shape ({logits_new.shape[0]},), got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk}")
    logp, entropy, kl, logp_old = _TokenStatsFn.apply(
        logits_new, logits_old, targets.long(), float(temperature), int(chunk)
    )
    if logits_old is None:
        return TokenStats(logp, entropy, None, None)
    return TokenStats(logp, entropy, kl, logp_old)


def nucleus_rows(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """``logits`` [N, V] (full vocabulary) with the entries outside the top-p nucleus of
    softmax(logits / temperature) set to -inf (vLLM's rule, models.reference.top_p_filter),
    so that token_stats renormalises over the nucleus (contract 4). Differentiable in the kept
    entries. Full rows only: tensor-parallel vocabulary shards are refused by the run config."""
    from models.reference import top_p_filter

    with torch.no_grad():
        kept = torch.isfinite(top_p_filter(logits.float() / temperature, top_p))
    return logits.masked_fill(~kept, float("-inf"))


def contract_token_stats(
    rows: Tensor, old: Tensor | None, targets: Tensor, temperature: float, top_p: float,
    mode: str,
) -> dict[str, Tensor]:  # fmt: skip
    """Token statistics of logit rows [N, V] exactly as docs/CONTRACTS.md 4 defines the sampled-from
    distribution (models.reference.behaviour_logprobs in ``mode``, the nucleus included):
    {"logp", "entropy"} [N] and, with the proximal rows ``old``, {"kl": KL(old || new),
    "prox_logp"}. The megatron learner in numerics exact and the reference backend (always)
    compute them through it, so their per-token statistics are the same operations."""
    from models.reference import behaviour_logprobs, entropy

    v = rows.shape[-1]
    idx = targets.long()[:, None]
    lp = behaviour_logprobs(rows, v, temperature, top_p, mode)
    res = {"logp": lp.gather(-1, idx)[:, 0], "entropy": entropy(lp)}
    if old is not None:
        olp = behaviour_logprobs(old.to(rows.dtype), v, temperature, top_p, mode)
        fin = torch.isfinite(olp) & torch.isfinite(lp)
        kl = (torch.where(fin, olp.exp(), 0.0) * torch.where(fin, olp - lp, 0.0)).sum(-1)
        res["kl"] = kl
        res["prox_logp"] = olp.gather(-1, idx)[:, 0]
    return res
