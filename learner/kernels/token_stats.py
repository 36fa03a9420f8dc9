"""Fused Triton kernels for `learner.vocab_ops.token_stats` (log-prob, entropy, KL(old || new)).

`token_stats_triton` has the signature, return type and semantics of
`learner.vocab_ops.token_stats`, which stays the reference it is tested against
(tests/learner/test_kernels_token_stats.py on the CPU interpreter, benchmarks/token_stats_gpu.py
on a GPU). `token_stats_auto` picks the Triton path for CUDA tensors when Triton imports, and
the PyTorch path otherwise; this module imports on a machine without a GPU (and without Triton).

Forward: one streaming pass over each row, tile by tile (BLOCK_V columns), with online
(running-max) accumulators, so no [N, V] intermediate exists. With z = logits / T, per tile:
m' = max(m, max z), alpha = exp(m - m'), and
    s = sum exp(z - m)                        -> lse = m + log s
    a = sum exp(z - m) (z - m)                -> H = log s - a / s
    d = sum exp(zq - mq) (zq - z)  (old)      -> KL = d / sq + lse - lse_q
(a is rescaled as a' = alpha (a - (m' - m) s), s and d as alpha * s, alpha * d). The shifted
forms keep a tiny entropy or KL free of the cancellation of E[z] against lse. For few rows,
the vocabulary is split over several programs per row, whose partial accumulators a second
small kernel merges (with the target gather and the final formulas).

Backward: one tile per program, recomputing p (and q) from the saved per-row normalisers, and
writing d logits_new in logits_new's dtype (the only [N, V] allocation); formulas as in
`learner.vocab_ops`. Arithmetic is fp32 throughout for fp16 / bf16 / fp32 logits; fp64
logits go to the PyTorch path (`token_stats_auto`) or are refused (`token_stats_triton`).

-inf logits: old entries at -inf contribute exactly 0 to the KL, new entries at -inf exactly
0 to the entropy; an all -inf row has entropy 0, KL 0 and target log-prob -inf; an entry with
old probability > 0 and new logit -inf makes the KL +inf; no NaN reaches the gradient. The
running max starts at a finite sentinel (-1e30) so that rescaling never computes -inf - -inf.

The CPU interpreter (`TRITON_INTERPRET=1`, set before Triton is imported) runs these kernels
on CPU tensors; without it, `token_stats_triton` needs CUDA tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from learner.config import DEFAULT_VOCAB_CHUNK
from learner.vocab_ops import TokenStats, token_stats

try:  # Triton is optional: CPU hosts may lack it, and the PyTorch path needs none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = [
    "HAS_TRITON",
    "TritonConfig",
    "token_stats_auto",
    "token_stats_triton",
    "triton_usable",
]

HAS_TRITON = triton is not None


class TritonConfig:
    """Launch parameters. Defaults from benchmarks/token_stats_gpu.py's sweep on an H200
    (N=4096 bf16, V=151936 and 32768): 2048 columns x 4 warps was the fastest forward at both
    sizes and within noise of the fastest backward (docs/PERFORMANCE.md, "GPU")."""

    fwd_block: int = 2048
    fwd_warps: int = 4
    bwd_block: int = 2048
    bwd_warps: int = 4
    min_programs: int = 264
    """The forward splits each row's vocabulary until N * splits reaches this (2 x 132 SMs)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t: Tensor) -> bool:
    """True when the Triton kernels can run on `t`'s device (CUDA, or CPU under the
    interpreter) for its dtype."""
    if not HAS_TRITON or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return t.is_cuda or (t.device.type == "cpu" and _interpreting())


if HAS_TRITON:

    @triton.jit
    def _fwd_kernel(
        new_ptr,
        old_ptr,
        part_ptr,
        stride_new,
        stride_old,
        n_vocab,
        seg_len,
        n_split,
        inv_t,
        HAS_OLD: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        lo = split * seg_len
        hi = tl.minimum(lo + seg_len, n_vocab)
        new_row = new_ptr + row * stride_new
        old_row = old_ptr + row * stride_old
        m = tl.full([], -1.0e30, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        a = tl.full([], 0.0, tl.float32)
        mq = tl.full([], -1.0e30, tl.float32)
        sq = tl.full([], 0.0, tl.float32)
        dq = tl.full([], 0.0, tl.float32)
        for start in range(lo, hi, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inside = cols < hi
            z = tl.load(new_row + cols, mask=inside, other=-float("inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = m_new - m
            alpha = tl.exp(-shift)
            u = z - m_new
            e = tl.exp(u)
            eu = tl.where(e > 0, e * u, 0.0)
            a = tl.where(alpha > 0, alpha * (a - shift * s), 0.0) + tl.sum(eu, 0)
            s = alpha * s + tl.sum(e, 0)
            m = m_new
            if HAS_OLD:
                zq = (
                    tl.load(old_row + cols, mask=inside, other=-float("inf")).to(tl.float32) * inv_t
                )
                mq_new = tl.maximum(mq, tl.max(zq, 0))
                alpha_q = tl.exp(mq - mq_new)
                eq = tl.exp(zq - mq_new)
                dterm = tl.where(eq > 0, eq * (zq - z), 0.0)
                dq = tl.where(alpha_q > 0, alpha_q * dq, 0.0) + tl.sum(dterm, 0)
                sq = alpha_q * sq + tl.sum(eq, 0)
                mq = mq_new
        out = part_ptr + (row * n_split + split) * 6
        tl.store(out + 0, m)
        tl.store(out + 1, s)
        tl.store(out + 2, a)
        tl.store(out + 3, mq)
        tl.store(out + 4, sq)
        tl.store(out + 5, dq)

    @triton.jit
    def _combine_kernel(
        part_ptr,
        new_ptr,
        old_ptr,
        tgt_ptr,
        logp_ptr,
        ent_ptr,
        kl_ptr,
        logp_old_ptr,
        lse_ptr,
        stride_new,
        stride_old,
        n_split,
        inv_t,
        HAS_OLD: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_S)
        valid = ks < n_split
        base = part_ptr + (row * n_split + ks) * 6
        m_k = tl.load(base + 0, mask=valid, other=-1.0e30)
        s_k = tl.load(base + 1, mask=valid, other=0.0)
        a_k = tl.load(base + 2, mask=valid, other=0.0)
        m = tl.max(m_k, 0)
        w = tl.exp(m_k - m)
        s = tl.sum(w * s_k, 0)
        a = tl.sum(tl.where(w > 0, w * (a_k - (m - m_k) * s_k), 0.0), 0)
        has_p = s > 0
        s_safe = tl.where(has_p, s, 1.0)
        log_s = tl.log(s_safe)
        lse = tl.where(has_p, m + log_s, 0.0)
        target = tl.load(tgt_ptr + row)
        z_t = tl.load(new_ptr + row * stride_new + target).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, z_t - lse)
        tl.store(ent_ptr + row, tl.where(has_p, log_s - a / s_safe, 0.0))
        tl.store(lse_ptr + row * 2, lse)
        if HAS_OLD:
            mq_k = tl.load(base + 3, mask=valid, other=-1.0e30)
            sq_k = tl.load(base + 4, mask=valid, other=0.0)
            dq_k = tl.load(base + 5, mask=valid, other=0.0)
            mq = tl.max(mq_k, 0)
            wq = tl.exp(mq_k - mq)
            sq = tl.sum(wq * sq_k, 0)
            dq = tl.sum(tl.where(wq > 0, wq * dq_k, 0.0), 0)
            has_q = sq > 0
            sq_safe = tl.where(has_q, sq, 1.0)
            lse_q = tl.where(has_q, mq + tl.log(sq_safe), 0.0)
            zq_t = tl.load(old_ptr + row * stride_old + target).to(tl.float32) * inv_t
            tl.store(kl_ptr + row, tl.where(has_q, dq / sq_safe + lse - lse_q, 0.0))
            tl.store(logp_old_ptr + row, zq_t - lse_q)
            tl.store(lse_ptr + row * 2 + 1, lse_q)

    @triton.jit
    def _bwd_kernel(
        new_ptr,
        old_ptr,
        grad_ptr,
        tgt_ptr,
        lse_ptr,
        ent_ptr,
        g_logp_ptr,
        g_ent_ptr,
        g_kl_ptr,
        stride_new,
        stride_old,
        stride_grad,
        n_vocab,
        inv_t,
        HAS_OLD: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = cols < n_vocab
        lse = tl.load(lse_ptr + row * 2)
        ent = tl.load(ent_ptr + row)
        g_logp = tl.load(g_logp_ptr + row)
        g_ent = tl.load(g_ent_ptr + row)
        target = tl.load(tgt_ptr + row)
        z = tl.load(new_ptr + row * stride_new + cols, mask=inside, other=-float("inf"))
        logp = z.to(tl.float32) * inv_t - lse
        p = tl.exp(logp)
        ent_term = tl.where(p > 0, p * (logp + ent), 0.0)
        if HAS_OLD:
            g_kl = tl.load(g_kl_ptr + row)
            lse_q = tl.load(lse_ptr + row * 2 + 1)
            zq = tl.load(old_ptr + row * stride_old + cols, mask=inside, other=-float("inf"))
            q = tl.exp(zq.to(tl.float32) * inv_t - lse_q)
            g = p * (g_kl - g_logp) - g_ent * ent_term - g_kl * q
        else:
            g = -p * g_logp - g_ent * ent_term
        g = g + tl.where(cols == target, g_logp, 0.0)
        g = g * inv_t
        out = grad_ptr + row * stride_grad + cols
        tl.store(out, g.to(grad_ptr.dtype.element_ty), mask=inside)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _TritonTokenStatsFn(torch.autograd.Function):
    """Triton forward/backward of (logp, entropy, kl, logp_old); see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits_new: Tensor, logits_old: Tensor | None, targets: Tensor, temperature: float
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cfg = TritonConfig
        n, v = logits_new.shape
        dev = logits_new.device
        new = _rows(logits_new)
        has_old = logits_old is not None
        old = _rows(logits_old) if logits_old is not None else new
        inv_t = 1.0 / temperature
        n_tiles = triton.cdiv(v, cfg.fwd_block)
        want = triton.cdiv(cfg.min_programs, max(n, 1)) if dev.type == "cuda" else 2
        n_split = max(1, min(n_tiles, want))
        seg_len = triton.cdiv(n_tiles, n_split) * cfg.fwd_block
        n_split = triton.cdiv(v, seg_len)
        part = torch.empty(n, n_split, 6, dtype=torch.float32, device=dev)

        def f32(*shape: int) -> Tensor:
            return torch.empty(*shape, dtype=torch.float32, device=dev)

        logp, entropy = f32(n), f32(n)
        kl, logp_old = f32(n if has_old else 0), f32(n if has_old else 0)
        lse = f32(n, 2)  # per row: lse_new, lse_old (the backward's normalisers)
        if n > 0:
            _fwd_kernel[(n, n_split)](
                new,
                old,
                part,
                new.stride(0),
                old.stride(0),
                v,
                seg_len,
                n_split,
                inv_t,
                HAS_OLD=has_old,
                BLOCK_V=cfg.fwd_block,
                num_warps=cfg.fwd_warps,
            )
            _combine_kernel[(n,)](
                part,
                new,
                old,
                targets,
                logp,
                entropy,
                kl if has_old else logp,
                logp_old if has_old else logp,
                lse,
                new.stride(0),
                old.stride(0),
                n_split,
                inv_t,
                HAS_OLD=has_old,
                BLOCK_S=max(triton.next_power_of_2(n_split), 2),
                num_warps=1,
            )
        ctx.save_for_backward(new, old if has_old else new.new_zeros(0), targets, lse, entropy)
        ctx.has_old = has_old
        ctx.inv_t = inv_t
        ctx.mark_non_differentiable(logp_old)
        return logp, entropy, kl, logp_old

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: Tensor, g_ent: Tensor, g_kl: Tensor, _g_logp_old: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        new, old, targets, lse, entropy = ctx.saved_tensors
        n, v = new.shape
        old = old if ctx.has_old else new
        g_logp = g_logp.float().contiguous()
        g_ent = g_ent.float().contiguous()
        g_kl = g_kl.float().contiguous() if ctx.has_old else g_logp
        grad = torch.empty_like(new)
        cfg = TritonConfig
        if n > 0:
            _bwd_kernel[(n, triton.cdiv(v, cfg.bwd_block))](
                new,
                old,
                grad,
                targets,
                lse,
                entropy,
                g_logp,
                g_ent,
                g_kl,
                new.stride(0),
                old.stride(0),
                grad.stride(0),
                v,
                ctx.inv_t,
                HAS_OLD=ctx.has_old,
                BLOCK_V=cfg.bwd_block,
                num_warps=cfg.bwd_warps,
            )
        return grad, None, None, None


def _check(
    logits_new: Tensor, logits_old: Tensor | None, targets: Tensor, temperature: float, chunk: int
) -> None:
    """The argument checks of `learner.vocab_ops.token_stats` (same ValueErrors)."""
    if logits_new.dim() != 2 or not logits_new.is_floating_point():
        raise ValueError(
            f"logits_new: expected a floating [N, V] tensor, got {tuple(logits_new.shape)} "
            f"{logits_new.dtype}"
        )
    if logits_old is not None and (
        logits_old.shape != logits_new.shape or not logits_old.is_floating_point()
    ):
        raise ValueError(
            f"logits_old: expected a floating tensor of shape {tuple(logits_new.shape)}, "
            f"got {tuple(logits_old.shape)} {logits_old.dtype}"
        )
    if targets.shape != logits_new.shape[:1] or targets.is_floating_point():
        raise ValueError(
            f"targets: expected integer ids of shape ({logits_new.shape[0]},), got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk}")


def token_stats_triton(
    logits_new: Tensor,
    logits_old: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_VOCAB_CHUNK,
) -> TokenStats:
    """`learner.vocab_ops.token_stats` through the fused Triton kernels.

    Same arguments, outputs (fp32) and errors; `chunk` is checked but unused (the kernels tile
    the vocabulary by `TritonConfig`). Needs Triton, fp32 / bf16 / fp16 logits, and CUDA
    tensors (CPU tensors only under TRITON_INTERPRET=1); raises RuntimeError otherwise.
    """
    _check(logits_new, logits_old, targets, temperature, chunk)
    for t in (logits_new, logits_old):
        if t is not None and not triton_usable(t):
            raise RuntimeError(
                f"token_stats_triton: cannot run on a {t.dtype} tensor on {t.device} "
                f"(triton {'present' if HAS_TRITON else 'missing'}); use token_stats_auto"
            )
    if logits_old is not None:
        logits_old = logits_old.detach()
    logp, entropy, kl, logp_old = _TritonTokenStatsFn.apply(
        logits_new, logits_old, targets.long().contiguous(), float(temperature)
    )
    if logits_old is None:
        return TokenStats(logp, entropy, None, None)
    return TokenStats(logp, entropy, kl, logp_old)


def token_stats_auto(
    logits_new: Tensor,
    logits_old: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_VOCAB_CHUNK,
) -> TokenStats:
    """`token_stats_triton` for CUDA tensors when Triton imports, else
    `learner.vocab_ops.token_stats` (CPU tensors, fp64 logits, no Triton)."""
    usable = logits_new.is_cuda and triton_usable(logits_new)
    if usable and logits_old is not None:
        usable = logits_old.is_cuda and triton_usable(logits_old)
    if usable:
        return token_stats_triton(logits_new, logits_old, targets, temperature, chunk)
    return token_stats(logits_new, logits_old, targets, temperature, chunk)
