"""Huginn's latent noise on CUDA in one Triton kernel, bit-identical to the CPU spec.

`models.noise.latent_noise_torch` computes the noise (docs/NOISE.md) with one torch
elementwise op per float64 step: ~80 kernels, each a full pass over [T, h] float64 (at the
~1B shape, 16 x 2,048 positions x 2,048: ~25 ms of a 510 ms training step on the H200).
`latent_noise_cuda` does the same steps, in the same order, in registers: one pass that writes
the fp32 result. What keeps the bits: every float64 operation is one correctly rounded IEEE
operation (add, sub, mul, div.rn, sqrt.rn), FMA contraction is off (`enable_fp_fusion=False`),
the float64 constants are read from a float64 table (a Python float literal in a Triton kernel
may be typed fp32), the integer hash wraps mod 2^64 like torch's int64, and the final
fp64 -> fp32 conversion rounds to nearest even. tests/models/test_kernels_noise.py checks the
docs/NOISE.md vectors and random seeds / positions bit for bit on CUDA (scripts/gpu_check.sh).

    z = latent_noise_cuda(seeds, positions, hidden)   # == latent_noise_torch(...) bit for bit
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from models import noise as spec

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the CPU hosts: latent_noise_torch only
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "latent_noise_cuda"]

# the float64 constant table: scalars, then the polynomial coefficients (Horner order)
_SCALARS = (spec.WIDTH, spec.LO, spec.R_CENTRAL, spec.SPLIT, spec.R_TAIL, spec.SQRT_HALF,
            spec.LN2_HI, spec.LN2_LO, 2.0**-53)  # fmt: skip
_POLYS = (spec.AS241_A, spec.AS241_B, spec.AS241_C, spec.AS241_D, spec.LOG_SERIES)
_OFF = [len(_SCALARS)]
for _p in _POLYS[:-1]:
    _OFF.append(_OFF[-1] + len(_p))
_M1, _M2, _GOLD = (spec._i64(x) for x in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, spec.GOLDEN))


@functools.cache
def _table(device: torch.device) -> Tensor:
    values = [*_SCALARS, *(c for p in _POLYS for c in p)]
    return torch.tensor(values, dtype=torch.float64, device=device)


if HAVE_TRITON:

    @triton.jit
    def _srl(z, k: tl.constexpr):  # logical shift right of an int64 holding a u64
        return (z >> k) & ((1 << (64 - k)) - 1)

    @triton.jit
    def _mix(z, m1: tl.constexpr, m2: tl.constexpr):
        z = (z ^ _srl(z, 30)) * m1
        z = (z ^ _srl(z, 27)) * m2
        return z ^ _srl(z, 31)

    @triton.jit
    def _horner(x, c_ptr, off: tl.constexpr, n: tl.constexpr):
        acc = x * tl.load(c_ptr + off)
        acc = acc + tl.load(c_ptr + off + 1)
        for k in tl.static_range(2, n):
            acc = acc * x
            acc = acc + tl.load(c_ptr + off + k)
        return acc

    @triton.jit
    def _noise_kernel(row_ptr, out_ptr, c_ptr, hidden, m1: tl.constexpr, m2: tl.constexpr,
                      gold: tl.constexpr, oa: tl.constexpr, ob: tl.constexpr, oc: tl.constexpr,
                      od: tl.constexpr, ol: tl.constexpr, block: tl.constexpr):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * block + tl.arange(0, block)
        live = j < hidden
        row = tl.load(row_ptr + i)
        bits = _mix(row + (j + 1).to(tl.int64) * gold, m1, m2)
        k = _srl(bits, 11) | 1
        u = k.to(tl.float64) * tl.load(c_ptr + 8)  # exact
        v = u * tl.load(c_ptr + 0)
        v = v + tl.load(c_ptr + 1)
        # ppnd (models.noise._ppnd_t): both branches, then a select
        q = v - 0.5
        r = tl.load(c_ptr + 2) - q * q
        x = _horner(r, c_ptr, oa, 8)
        x = x * q
        x = x / _horner(r, c_ptr, ob, 8)
        neg = q < 0.0
        w = tl.where(neg, v, 1.0 - v)
        # _log_t: frexp by bit manipulation
        wb = w.to(tl.int64, bitcast=True)
        e = (((wb >> 52) & 0x7FF) - 1022).to(tl.float64)
        m = ((wb & ((1 << 52) - 1)) | (1022 << 52)).to(tl.float64, bitcast=True)
        small = m < tl.load(c_ptr + 5)
        m = tl.where(small, m + m, m)
        e = tl.where(small, e - 1.0, e)
        f = m - 1.0
        s = f / (m + 1.0)
        z = s * s
        t = _horner(z, c_ptr, ol, 10)
        t = t * z
        t = t * s
        log_m = (s + s) + t
        log_w = (e * tl.load(c_ptr + 6)) + ((e * tl.load(c_ptr + 7)) + log_m)
        rt = tl.sqrt(-log_w)  # fp64: lowered to sqrt.rn.f64 (the tests check the bits)
        rt = rt - tl.load(c_ptr + 4)
        xt = _horner(rt, c_ptr, oc, 8) / _horner(rt, c_ptr, od, 8)
        out = tl.where(tl.abs(q) > tl.load(c_ptr + 3), tl.where(neg, -xt, xt), x)
        out = tl.minimum(tl.maximum(out, -3.0), 3.0)
        tl.store(out_ptr + i * hidden + j, out.to(tl.float32), mask=live)


def latent_noise_cuda(seeds: Tensor, positions: Tensor, hidden_size: int,
                      nonnegative: bool = False, *, check: bool = True) -> Tensor:  # fmt: skip
    """`models.noise.latent_noise_torch(seeds, positions, hidden_size)` (same arguments and
    checks, fp32 [T, hidden_size] on the tensors' CUDA device) in one Triton kernel; falls back
    to latent_noise_torch off CUDA or without Triton. ``nonnegative``: the caller knows the
    positions are >= 0 (`models.noise.check_noise_args`: no read of the card); ``check=False``:
    no argument checks at all (latent_noise_torch's: a CUDA graph's decode step, which the
    torch engine captures after eager warm-up calls have compiled the kernel)."""
    if not (HAVE_TRITON and seeds.is_cuda):
        return spec.latent_noise_torch(seeds, positions, hidden_size, check=check)
    if check:
        spec.check_noise_args(seeds, positions, hidden_size, nonnegative)
    assert spec.TRUNCATION == 3.0  # the kernel's clamp
    row = spec._mix_t(spec._mix_t(seeds ^ spec.NOISE_DOMAIN) ^ positions).contiguous()
    out = torch.empty((seeds.numel(), hidden_size), dtype=torch.float32, device=seeds.device)
    if out.numel() == 0:
        return out
    block = 512
    grid = (seeds.numel(), triton.cdiv(hidden_size, block))
    _noise_kernel[grid](
        row, out, _table(seeds.device), hidden_size, _M1, _M2, _GOLD, *_OFF, block=block,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
