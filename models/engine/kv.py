"""K/V cache writes of the fixed-shape decodes (the ticks of `models.engine.tickgraph`, the
fixed-depth step of `models.engine.chunk._stack`), as Triton kernels on CUDA: one program per
row (and kv head), no advanced-index kernels.

The ticks write one position per row per layer into a slot that differs per row, and a readout
copies an exited row's K/V of its exit iteration into every later slot (docs/CONTRACTS.md 3,
last_exited). As torch indexing (`dst[slot, rows, pos] = x`; a gather, `where` and scatter over
[D, layers, 2, B, G, head_dim]) these took ~30 us a write and ~1 ms a readout in torch's generic
index kernels on the H200 (the profile in docs/PERFORMANCE.md, "Depth batching"); a row's K/V
at one position is one contiguous [G, head_dim] block, so a kernel moves it with one load and
one store per program. Pure copies: the same bits as the torch ops, which run where the kernel
does not (the CPU, no Triton); tests/models/test_engine_kv.py checks both against each other
under the interpreter and on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover  (no Triton: the torch ops)
    triton = None  # type: ignore[assignment]

INTERPRET = [False]
"""Tests: take the kernels on CPU tensors too (under TRITON_INTERPRET=1)."""


def _kernel_ok(*ts: Tensor) -> bool:
    return (
        triton is not None
        and (all(t.is_cuda for t in ts) or INTERPRET[0])
        and all(t.stride(-1) == 1 for t in ts)
    )


if triton is not None:
    # row b's [G, Dh] block of X at (slot S[b] if SLOT, else 0; row R[b]; position P[b]) of
    # Dst, and with NEXT its block of Y at the next slot (a layer's K, then its V)
    @triton.jit
    def _write_kernel(
        Dst, X, Y, S, R, P, s_ds, s_dr, s_dt, s_dg, s_xb, s_xg, s_yb, s_yg,
        D: tl.constexpr, BLOCK_D: tl.constexpr, SLOT: tl.constexpr, NEXT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        g = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        at = Dst + tl.load(R + b) * s_dr + tl.load(P + b) * s_dt + g * s_dg + d
        if SLOT:
            at += tl.load(S + b) * s_ds
        tl.store(at, tl.load(X + b * s_xb + g * s_xg + d, mask=m), mask=m)
        if NEXT:
            tl.store(at + s_ds, tl.load(Y + b * s_yb + g * s_yg + d, mask=m), mask=m)

    @triton.jit
    def _carry_kernel(
        C, W, E, R, P, s_cs, s_cl, s_ck, s_cr, s_ct, s_cg, G, DEPTH,
        D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        q = tl.program_id(1)  # (layer, k / v, kv head)
        g = q % G
        lk = q // G
        w = tl.load(W + b)
        e = tl.load(E + b)
        if (w != 0) & (e < DEPTH):
            d = tl.arange(0, BLOCK_D)
            m = d < D
            r = tl.load(R + b)
            p = tl.load(P + b)
            base = C + (lk // 2) * s_cl + (lk % 2) * s_ck + r * s_cr + p * s_ct + g * s_cg + d
            v = tl.load(base + (e - 1) * s_cs, mask=m)
            for j in range(e, DEPTH):
                tl.store(base + j * s_cs, v, mask=m)


def write_rows(dst: Tensor, slot: Tensor, rows: Tensor, pos: Tensor, x: Tensor) -> None:
    """dst[slot[b], rows[b], pos[b]] = x[b] for every b: dst [S, R, T, G, Dh] (one layer's k or
    v of the core cache), x [B, G, Dh]; slot, rows, pos int64 [B]."""
    if not _kernel_ok(dst, x):
        dst[slot, rows, pos] = x
        return
    bsz, groups, dim = x.shape
    _write_kernel[(bsz, groups)](
        dst, x, x, slot, rows, pos, dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3),
        x.stride(0), x.stride(1), 0, 0, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        SLOT=True, NEXT=False,
    )  # fmt: skip


def write_kv(dst: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """dst[0, rows[b], pos[b]] = k[b] and dst[1, rows[b], pos[b]] = v[b] for every b, in one
    launch: dst [2, R, T, G, Dh] (one layer's K and V slots), k / v [B, G, Dh] in dst's dtype;
    rows, pos int64 [B]. The fixed-depth decode's write of every row at every layer pass (two
    torch index kernels before: 2 x 10,400 a 3.8 s batch on the H100 at 1b, 0.13 s)."""
    if not _kernel_ok(dst, k, v) or k.dtype != dst.dtype or v.dtype != dst.dtype:
        dst[0, rows, pos] = k
        dst[1, rows, pos] = v
        return
    bsz, groups, dim = k.shape
    _write_kernel[(bsz, groups)](
        dst, k, v, rows, rows, pos, dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), D=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), SLOT=False, NEXT=True,
    )  # fmt: skip


def carry_exits(core: Tensor, w: Tensor, exit_at: Tensor, rows: Tensor, pos: Tensor,
                depth: int) -> None:  # fmt: skip
    """last_exited's copies of the rows ``w`` that exited after iteration ``exit_at`` [B]:
    core[j, :, :, rows[b], pos[b]] = core[exit_at[b] - 1, :, :, rows[b], pos[b]] for
    exit_at[b] <= j < depth. core [S >= depth, L, 2, R, T, G, Dh]."""
    if not _kernel_ok(core):
        src = core[(exit_at - 1).clamp(min=0), :, :, rows, pos]  # [B, L, 2, G, Dh]
        later = torch.arange(depth, device=rows.device)[:, None] >= exit_at[None, :]  # [D, B]
        cond = (later & w[None, :])[:, None, None, :, None, None]
        part = core[:depth]
        part[:, :, :, rows, pos] = torch.where(cond, src.permute(1, 2, 0, 3, 4)[None],
                                               part[:, :, :, rows, pos])  # fmt: skip
        return
    layers, groups, dim = core.shape[1], core.shape[5], core.shape[6]
    _carry_kernel[(rows.shape[0], layers * 2 * groups)](
        core, w.view(torch.uint8), exit_at, rows, pos, core.stride(0), core.stride(1),
        core.stride(2), core.stride(3), core.stride(4), core.stride(5), groups, depth,
        D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip


__all__ = ["carry_exits", "write_kv", "write_rows"]
