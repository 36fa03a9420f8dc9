"""Decode attention for the torch generator engine: one query per row against the KV cache, in
one Triton kernel (fast numerics, CUDA, inside `models.numerics.fused_generation`).

`models.numerics.attention` computes softmax attention of q [B, S, H, D] over a cache slot
k / v [B, T, G, D] with a boolean mask [B, S, T]. For decode (S = 1) on CUDA, SDPA gets the
cache through a transposed view ([B, G, T, D] with the T stride G * D) and an explicit mask:
the profiled step spent ~133 us a call in cuDNN there, 132 calls a step at the Huginn-0125
shape (docs/PERFORMANCE.md). A decode query reads each key and value once: this kernel does
exactly that, one program per (row, query head) walking the cache positions up to the row's
last visible key (the slot may be longer: allocated for the longest row) in blocks with
an online softmax (running max, rescaled sums) in fp32, keys and values read in the cache's
layout and dtype, the mask's invisible positions skipped as -inf (every row sees at least one
key: `models.engine.chunk._key_mask`). Query head h reads kv head h // (H / G). Output in q's dtype.

Not bit-equal to SDPA (another summation order; within fp32 rounding before the cast): fast
mode only, and only where the torch engine asks for it (`fused_generation`), so the learner's
and the reference's forwards keep SDPA. tests/models/test_engine_attention.py checks it
against the exact recipe under Triton's CPU interpreter and, on CUDA, on the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover  (no Triton: numerics.attention keeps SDPA)
    triton = None  # type: ignore[assignment]


def available(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Whether `decode_attention` takes these inputs: Triton, CUDA (or the interpreter), one
    query position, head_dim <= 256, unit-stride head_dim."""
    return (
        triton is not None
        and q.shape[1] == 1
        and q.shape[-1] <= 256
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and q.stride(-1) == 1
        and mask.dtype == torch.bool
    )


if triton is not None:

    @triton.jit
    def _decode_kernel(
        Q, K, V, M, Out, R, SL, L, scale,
        s_qb, s_qh, s_kb, s_kt, s_kg, s_vb, s_vt, s_vg, s_mb, s_mt, s_ob, s_oh, s_ks, s_vs,
        REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
        ROWS: tl.constexpr, SLOTS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        kb = tl.load(R + b) if ROWS else b  # the cache row this query reads
        k_off = kb * s_kb
        v_off = kb * s_vb
        if SLOTS:  # and the slot (core iteration) of that row
            sl = tl.load(SL + b)
            k_off += sl * s_ks
            v_off += sl * s_vs
        g = h // REP
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(Q + b * s_qb + h * s_qh + d, mask=dm, other=0.0).to(tl.float32)
        m_i = tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_T], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        n = tl.load(L + b)  # this query's keys end here: nothing past them is read
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < n
            vis = tl.load(M + b * s_mb + t * s_mt, mask=tm, other=0) != 0
            kv_m = tm[:, None] & dm[None, :]
            k = tl.load(K + k_off + t[:, None] * s_kt + g * s_kg + d[None, :], mask=kv_m,
                        other=0.0).to(tl.float32)  # fmt: skip
            s = tl.sum(k * q[None, :], 1) * scale
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing seen
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe)
            v = tl.load(V + v_off + t[:, None] * s_vt + g * s_vg + d[None, :], mask=kv_m,
                        other=0.0).to(tl.float32)  # fmt: skip
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        out = acc / l_i
        tl.store(Out + b * s_ob + h * s_oh + d, out.to(Out.dtype.element_ty), mask=dm)


def key_ends(mask: Tensor) -> Tensor:
    """[B] int32: each query's last visible key + 1, for mask [B, 1, T] bool (a cache slot is
    allocated for the longest row, and the keys past a row's own are never read: at 256 rows of
    512-token responses they were half of every decode step's K/V reads). Two kernels over the
    mask; a decode step's layers share its mask, so the step computes this once
    (`models.engine.chunk._Rows.ends`) rather than each of its ~20 attention calls (on the H100
    at 1b: 2 x 10,400 calls, 0.12 s of a 3.8 s batch)."""
    length = mask.shape[-1]
    return (mask[:, 0] * torch.arange(1, length + 1, device=mask.device, dtype=torch.int32)).amax(
        -1
    )


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, block_t: int = 32,
                     num_warps: int = 1, num_stages: int = 2,
                     rows: Tensor | None = None, slots: Tensor | None = None,
                     ends: Tensor | None = None) -> Tensor:  # fmt: skip
    """Softmax attention of one query position: q [B, 1, H, D], k / v [B, T, G, D] (H % G ==
    0), mask [B, 1, T] bool (True = visible; each row sees a key). Returns [B, 1, H * D] in
    q's dtype (module doc). ``block_t``, ``num_warps``, ``num_stages``: the launch
    (benchmarks/decode_attention.py times them; one warp a program read 0.845 of the H100's
    bandwidth at the 1b run's shape, batch 256 x 16 heads of 128 over 544 positions, two
    warps 0.698: docs/PERFORMANCE.md). ``rows`` [B] int64: query b reads the cache's
    row rows[b] (k / v then [R, T, G, D], any R), so a subset of a cache's rows attends without
    gathering their keys and values (mask stays [B, 1, T], one per query). ``slots`` [B] int64
    (with ``rows``): k / v are [S, R, T, G, D] (S slots, e.g. the core iterations' caches of
    one layer) and query b reads k[slots[b], rows[b]] (decode by ticks: each row at its own
    iteration, `models.engine.tickgraph`). ``ends`` [B] int32: `key_ends(mask)` when the caller
    has it (computed here otherwise)."""
    bsz, _, heads, dim = q.shape
    if slots is not None:
        if rows is None or slots.shape != (bsz,) or slots.dtype != torch.int64 or k.dim() != 5:
            raise ValueError(f"slots must be int64 [{bsz}] with rows, k / v [S, R, T, G, D]")
        s_ks, s_vs = k.stride(0), v.stride(0)
        k, v = k[0], v[0]  # (the slot's offset is added in the kernel)
    else:
        s_ks = s_vs = 0
    groups = k.shape[2]
    if rows is not None and (rows.shape != (bsz,) or rows.dtype != torch.int64):
        raise ValueError(f"rows must be int64 [{bsz}] (one cache row per query)")
    if heads % groups:
        raise ValueError(f"query heads {heads} not a multiple of kv heads {groups}")
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    m = mask[:, 0].view(torch.uint8)
    if ends is None:
        ends = key_ends(mask)
    elif ends.shape != (bsz,) or ends.dtype != torch.int32:
        raise ValueError(f"ends must be int32 [{bsz}] (key_ends of the mask)")
    block_d = max(16, triton.next_power_of_2(dim))
    _decode_kernel[(bsz, heads)](
        q, k, v, m, out, rows if rows is not None else m, slots if slots is not None else m,
        ends, 1.0 / math.sqrt(dim),
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), s_ks, s_vs,
        REP=heads // groups, D=dim, BLOCK_D=block_d, BLOCK_T=block_t, ROWS=rows is not None,
        SLOTS=slots is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out.view(bsz, 1, heads * dim)


__all__ = ["available", "decode_attention", "key_ends"]
