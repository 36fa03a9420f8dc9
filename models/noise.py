"""The latent-noise contract (docs/CONTRACTS.md 1): seeds and the initial latent state's noise.

Every completion has a 64-bit `latent_seed = derive_latent_seed(run_seed, prompt_id,
sample_index)`. The noise of the token at absolute position p (0 = first prompt token) is
`latent_noise(latent_seed, [p], h)[0]`: a function of (latent_seed, p, h) alone, computed in
integer and float64 arithmetic and rounded once to fp32. It does not depend on batch
composition, prefill chunking, process, device, CPU kernel path or compute dtype: callers draw
it here (CPU), then move / cast it. Callers multiply by their std and scale (Huginn:
`models.huginn`). docs/NOISE.md is the normative, bit-exact specification.

Algorithm (all integers unsigned 64-bit, arithmetic mod 2^64):

    GOLDEN = 0x9E3779B97F4A7C15
    mix(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
             z = (z ^ (z >> 27)) * 0x94D049BB133111EB
             return z ^ (z >> 31)                          # the SplitMix64 finaliser

    derive_latent_seed(run_seed, prompt_id, sample_index):
        w = prompt_id                      if prompt_id is an int in [0, 2^64)
            int.from_bytes(sha256(prompt_id.encode("utf-8"))[:8], "little")   if a str
        s = mix(run_seed + 1 * GOLDEN)
        s = mix(s ^ mix(w + 2 * GOLDEN))
        s = mix(s ^ mix(sample_index + 3 * GOLDEN))
        return s

    latent_noise element (p, e) of seed s (e = 0 .. h-1):
        row  = mix(mix(s ^ 0x4C4F4F50524C4E5A) ^ p)         # 0x4C4F... = b"LOOPRLNZ"
        bits = mix(row + (e + 1) * GOLDEN)                  # SplitMix64 stream of `row`
        u    = f64((bits >> 11) | 1) * 2^-53                # = (2 (bits >> 12) + 1) 2^-53: exact
        v    = LO + u * W                                   # LO = Phi(-3), W = (1 - LO) - LO
        z    = ppnd(v)                                      # inverse normal CDF, see below
        out  = float32(clamp(z, -3, 3))                     # round to nearest even

i.e. a standard normal truncated to [-3, 3] by inversion, as the official Huginn init
(`trunc_normal_(std, a=-3 std, b=3 std)`) has it after dividing by std. `u` is exact: an
odd multiple of 2^-53 in (0, 1) (52 random bits; `u` and `1 - u` are equally likely).

`ppnd` is Wichura's AS241 (PPND16, relative error ~1e-16), with its tail's `log` computed by a
fixed range reduction and atanh series (`_log`). Every float64 step is ONE correctly rounded
IEEE-754 operation (+, -, *, /, sqrt, or an exact one: frexp, negation, comparison, min/max),
each a separate numpy elementwise call in a fixed order, so no library transcendental and no
FMA contraction enters, and no intermediate is subnormal: every IEEE-754 host (any SIMD path,
CUDA with `__dadd_rn`/`__dmul_rn`/`__ddiv_rn`/`__dsqrt_rn`, C with `-ffp-contract=off`)
computes the same float64 bits. The constants are exact hex literals; docs/NOISE.md lists
the operation sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from models.seeds import check_latent_seed as _u64
from models.seeds import seed_to_i64 as _i64
from proto.schema import U64_MAX as MASK64  # the wire format owns the 64-bit range

GOLDEN = 0x9E3779B97F4A7C15
NOISE_DOMAIN = 0x4C4F4F50524C4E5A
EXIT_DOMAIN = 0x4C4F4F5045584954  # b"LOOPEXIT": the sampled exit's uniforms (exit_uniform)
TRUNCATION = 3.0

_hex = float.fromhex

PHI_MINUS_3 = _hex("0x1.61de1f985b5d7p-10")
"""Phi(-3) = 0.00134989803163009452665181476759..., correctly rounded to float64 (evaluated
in high precision, e.g. mpmath; `0.5 * erfc(3 / sqrt(2))` in float64 gives a different,
wrong-by-5-ulp number). Use this literal, never recompute it."""
LO = PHI_MINUS_3
HI = _hex("0x1.ff4f10f033d25p-1")
"""1.0 - LO, rounded to nearest even (what float64 `1.0 - LO` gives)."""
WIDTH = _hex("0x1.fe9e21e067a4ap-1")
"""HI - LO, rounded to nearest even (what float64 `HI - LO` gives)."""

# AS241 (Wichura 1988, PPND16): float64 nearest to the paper's decimal coefficients, listed
# highest degree first (Horner order). Central region |q| <= 0.425, in r = 0.180625 - q^2:
# x = q A(r) / B(r). Tail, in r = sqrt(-log(min(p, 1 - p))) - 1.6: |x| = C(r) / D(r)
# (r <= 5 always holds for p >= LO, so AS241's far-tail branch is never needed).
AS241_A = tuple(map(_hex, (
    "0x1.39a296f7d925ep+11", "0x1.052d26b2e45e4p+15", "0x1.06c1c55b78f20p+16",
    "0x1.66c3e869b752ap+15", "0x1.ad1d8cd4ee71dp+13", "0x1.ece5d2213c0ccp+10",
    "0x1.0a4888b1a436ep+7", "0x1.b18d91e9eef75p+1",
)))  # fmt: skip
AS241_B = tuple(map(_hex, (
    "0x1.46a7eca984b69p+12", "0x1.c0e457cb1ae76p+14", "0x1.3317caa64f4bep+15",
    "0x1.4b772d5d65266p+14", "0x1.512322e75c89fp+12", "0x1.5797efdc8b3f7p+9",
    "0x1.5281b386e1ab5p+5", "0x1.0000000000000p+0",
)))  # fmt: skip
AS241_C = tuple(map(_hex, (
    "0x1.9615ac0b7ace9p-11", "0x1.744eb6c45ec67p-6", "0x1.ef2abb9b85c37p-3",
    "0x1.453cc085375b2p+0", "0x1.d2ecb1a3d02c4p+1", "0x1.713f71462256ap+2",
    "0x1.2857748cab19bp+2", "0x1.6c665fde9526ap+0",
)))  # fmt: skip
AS241_D = tuple(map(_hex, (
    "0x1.20d3f686439e4p-30", "0x1.1f18cbfdf2728p-11", "0x1.f207a7eab17bfp-7",
    "0x1.2f5123394f040p-3", "0x1.61292f23385c9p-1", "0x1.ad278e6526633p+0",
    "0x1.06cefbb46a449p+1", "0x1.0000000000000p+0",
)))  # fmt: skip
SPLIT = _hex("0x1.b333333333333p-2")  # 0.425
R_CENTRAL = _hex("0x1.71eb851eb851fp-3")  # 0.180625
R_TAIL = _hex("0x1.999999999999ap+0")  # 1.6

# log(w) = e LN2_HI + (e LN2_LO + log(m)), w = m 2^e, m in [sqrt(1/2), sqrt(2)):
# log(m) = 2 atanh(s) = 2 s + s (z L(z)), s = (m - 1) / (m + 1), z = s^2,
# L(z) = sum_{k=1..10} 2 / (2k + 1) z^(k-1). |s| <= 0.1716, so the series' remainder is
# < 1e-18 relative. LN2_HI has 21 trailing zero bits (e LN2_HI is exact); the fdlibm split.
SQRT_HALF = _hex("0x1.6a09e667f3bcdp-1")
LN2_HI = _hex("0x1.62e42fee00000p-1")
LN2_LO = _hex("0x1.a39ef35793c76p-33")
LOG_SERIES = tuple(map(_hex, (
    "0x1.8618618618618p-4", "0x1.af286bca1af28p-4", "0x1.e1e1e1e1e1e1ep-4",
    "0x1.1111111111111p-3", "0x1.3b13b13b13b14p-3", "0x1.745d1745d1746p-3",
    "0x1.c71c71c71c71cp-3", "0x1.2492492492492p-2", "0x1.999999999999ap-2",
    "0x1.5555555555555p-1",
)))  # fmt: skip  # 2/21, 2/19, ..., 2/5, 2/3

_BLOCK = 1 << 15
"""Elements converted per block (cache-sized). Elementwise: blocking does not change bits."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix_int(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def derive_latent_seed(run_seed: int, prompt_id: int | str, sample_index: int) -> int:
    """The 64-bit latent seed of sample `sample_index` of prompt `prompt_id` (see module doc)."""
    _u64(run_seed, "run_seed")
    _u64(sample_index, "sample_index")
    if isinstance(prompt_id, str):
        w = int.from_bytes(hashlib.sha256(prompt_id.encode("utf-8")).digest()[:8], "little")
    else:
        w = _u64(prompt_id, "prompt_id")
    s = _mix_int(run_seed + GOLDEN)
    s = _mix_int(s ^ _mix_int(w + 2 * GOLDEN))
    return _mix_int(s ^ _mix_int(sample_index + 3 * GOLDEN))


def _seed_array(latent_seed: int | Sequence[int] | np.ndarray | Tensor, n: int) -> np.ndarray:
    if isinstance(latent_seed, int) and not isinstance(latent_seed, bool):
        return np.full(n, _u64(latent_seed, "latent_seed"), dtype=np.uint64)
    if isinstance(latent_seed, Tensor):
        if latent_seed.dtype != torch.int64:
            raise ValueError(f"per-token seeds as a tensor must be int64, got {latent_seed.dtype}")
        arr = latent_seed.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    elif isinstance(latent_seed, np.ndarray):
        arr = latent_seed.astype(np.uint64) if latent_seed.dtype != np.uint64 else latent_seed
    elif isinstance(latent_seed, Sequence):
        arr = np.array([_u64(int(s), "latent_seed") for s in latent_seed], dtype=np.uint64)
    else:
        raise ValueError(f"latent_seed must be an int or per-token seeds, got {latent_seed!r}")
    if arr.shape != (n,):
        raise ValueError(f"per-token seeds must have shape ({n},), got {tuple(arr.shape)}")
    return arr


def _horner(x: np.ndarray, coefs: tuple[float, ...]) -> np.ndarray:
    """c[0] x^n + ... + c[n] by Horner: per step one RNE multiply, then one RNE add."""
    acc = x * coefs[0]
    acc += coefs[1]
    for c in coefs[2:]:
        acc *= x
        acc += c
    return acc


def _log(w: np.ndarray) -> np.ndarray:
    """Natural log of positive normal float64s with basic IEEE operations only (module doc)."""
    m, e_int = np.frexp(w)  # exact: w = m 2^e, m in [0.5, 1)
    e = e_int.astype(np.float64)  # exact (|e| < 1100)
    small = m < SQRT_HALF
    m = np.where(small, m + m, m)  # exact doubling: m in [sqrt(1/2), sqrt(2))
    e = np.where(small, e - 1.0, e)  # exact
    f = m - 1.0  # exact (Sterbenz)
    s = f / (m + 1.0)
    z = s * s
    t = _horner(z, LOG_SERIES)  # L(z)
    t *= z
    t *= s
    log_m = (s + s) + t
    return (e * LN2_HI) + ((e * LN2_LO) + log_m)


def ppnd(v: np.ndarray) -> np.ndarray:
    """The standard normal quantile of float64 probabilities v in [LO, HI] (AS241, module doc).

    Bit-reproducible: only correctly rounded IEEE operations, one per numpy call, fixed order.
    """
    q = v - 0.5
    r = R_CENTRAL - q * q
    x = _horner(r, AS241_A)
    x *= q
    x /= _horner(r, AS241_B)
    tail = np.abs(q) > SPLIT
    if tail.any():
        vt, qt = v[tail], q[tail]
        neg = qt < 0.0
        w = np.where(neg, vt, 1.0 - vt)  # 1 - v is exact for v >= 1/2
        rt = np.sqrt(-_log(w))
        rt -= R_TAIL
        xt = _horner(rt, AS241_C) / _horner(rt, AS241_D)
        x[tail] = np.where(neg, -xt, xt)
    return x


def _uniform_to_noise(bits: np.ndarray) -> np.ndarray:
    """uint64 counter outputs -> fp32 truncated standard normal (module doc, docs/NOISE.md)."""
    k = (bits >> np.uint64(11)) | np.uint64(1)  # odd, < 2^53
    u = k.astype(np.float64)  # exact
    u *= 2.0**-53  # exact: u in (0, 1)
    v = u * WIDTH
    v += LO
    z = ppnd(v)
    np.clip(z, -TRUNCATION, TRUNCATION, out=z)
    return z.astype(np.float32)  # one RNE rounding


def latent_noise(
    latent_seed: int | Sequence[int] | np.ndarray | Tensor,
    positions: Tensor | Sequence[int],
    hidden_size: int,
) -> Tensor:
    """Truncated-standard-normal noise, fp32 [T, hidden_size] on the CPU (see module doc).

    latent_seed: one seed for all rows, or T per-token seeds (ints in [0, 2^64), a uint64
    array, or an int64 tensor read as two's complement). positions: T absolute positions >= 0.
    """
    pos_t = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if pos_t.numel() and int(pos_t.min()) < 0:
        raise ValueError("positions must be >= 0")
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
    n = pos_t.numel()
    seeds = _seed_array(latent_seed, n)
    pos = pos_t.cpu().numpy().astype(np.uint64)
    row = _mix(_mix(seeds ^ np.uint64(NOISE_DOMAIN)) ^ pos)  # [T]
    offs = (np.arange(1, hidden_size + 1, dtype=np.uint64) * np.uint64(GOLDEN)).astype(np.uint64)
    out = np.empty((n, hidden_size), dtype=np.float32)
    rows = max(1, _BLOCK // hidden_size)
    for a in range(0, n, rows):
        bits = _mix(row[a : a + rows, None] + offs[None, :])  # [rows, h]
        out[a : a + rows] = _uniform_to_noise(bits)
    return torch.from_numpy(out)


# ---- the same function in torch ops, on any device ------------------------------------------
# int64 tensors hold the u64 values (two's complement: xor, + and * wrap mod 2^64 alike); a
# logical shift is an arithmetic shift then a mask. Every float64 step is one torch elementwise
# op (one kernel each, never fused or compiled: no FMA contraction), in numpy's order above, so
# CUDA's correctly rounded +, -, *, / and sqrt give the CPU bits (tests/models/test_noise.py;
# on CUDA: scripts/gpu_check.sh).


def _srl(z: Tensor, k: int) -> Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix_t(z: Tensor) -> Tensor:
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def _sqrt_t(x: Tensor) -> Tensor:
    """Correctly rounded sqrt: CUDA's double sqrt is (IEEE 754); torch's CPU kernel is not
    always (1 ulp off seen on x86), so the CPU takes numpy's."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sqrt(x.numpy()))
    return torch.sqrt(x)


def _horner_t(x: Tensor, coefs: tuple[float, ...]) -> Tensor:
    acc = x * coefs[0]
    acc = acc + coefs[1]
    for c in coefs[2:]:
        acc = acc * x
        acc = acc + c
    return acc


def _log_t(w: Tensor) -> Tensor:
    """`_log` in torch ops; frexp by bit manipulation (exact for positive normal w)."""
    bits = w.view(torch.int64)
    e = (((bits >> 52) & 0x7FF) - 1022).to(torch.float64)  # exact
    m = ((bits & ((1 << 52) - 1)) | (1022 << 52)).view(torch.float64)  # in [0.5, 1)
    small = m < SQRT_HALF
    m = torch.where(small, m + m, m)
    e = torch.where(small, e - 1.0, e)
    f = m - 1.0
    s = f / (m + 1.0)
    z = s * s
    t = _horner_t(z, LOG_SERIES)
    t = t * z
    t = t * s
    log_m = (s + s) + t
    return (e * LN2_HI) + ((e * LN2_LO) + log_m)


def _ppnd_t(v: Tensor) -> Tensor:
    """`ppnd` in torch ops: both branches on every element, then a select (elementwise, so
    each element's bits are those of its own branch)."""
    q = v - 0.5
    r = R_CENTRAL - q * q
    x = _horner_t(r, AS241_A)
    x = x * q
    x = x / _horner_t(r, AS241_B)
    neg = q < 0.0
    w = torch.where(neg, v, 1.0 - v)
    rt = _sqrt_t(-_log_t(w))
    rt = rt - R_TAIL
    xt = _horner_t(rt, AS241_C) / _horner_t(rt, AS241_D)
    return torch.where(q.abs() > SPLIT, torch.where(neg, -xt, xt), x)


def check_noise_args(seeds: torch.Tensor, positions: torch.Tensor, hidden_size: int,
                     nonnegative: bool = False) -> None:  # fmt: skip
    """ValueError unless seeds / positions are [T] int64 (positions >= 0) and hidden_size > 0:
    the arguments of every device implementation of the noise (torch, Triton). ``nonnegative``:
    the caller checked the positions already (on the host: no read of the card here)."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"seeds and positions must be int64, got {seeds.dtype}, {positions.dtype}")
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds {tuple(seeds.shape)} and positions must both be [T]")
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
    if not nonnegative and positions.numel() and bool((positions < 0).any()):
        raise ValueError("positions must be >= 0")


def latent_noise_torch(
    seeds: Tensor, positions: Tensor, hidden_size: int, *, chunk_elems: int = 1 << 24,
    check: bool = True,
) -> Tensor:  # fmt: skip
    """`latent_noise` computed with torch ops on the tensors' device, bit-identical to it.

    seeds: [T] int64 (u64 seeds as two's complement), positions: [T] int64 >= 0, same device.
    Returns fp32 [T, hidden_size] on that device; rows are done `chunk_elems` elements at a time.
    check=False skips the argument checks (they read positions back: not inside a CUDA graph).
    """
    if check:
        check_noise_args(seeds, positions, hidden_size)
    dev = seeds.device
    row = _mix_t(_mix_t(seeds ^ NOISE_DOMAIN) ^ positions)  # [T]
    e = torch.arange(1, hidden_size + 1, dtype=torch.int64, device=dev)
    offs = e * _i64(GOLDEN)
    out = torch.empty((seeds.numel(), hidden_size), dtype=torch.float32, device=dev)
    rows = max(1, chunk_elems // hidden_size)
    for a in range(0, seeds.numel(), rows):
        bits = _mix_t(row[a : a + rows, None] + offs[None, :])
        k = _srl(bits, 11) | 1  # odd, < 2^53
        u = k.to(torch.float64) * 2.0**-53  # both exact
        v = u * WIDTH
        v = v + LO
        z = _ppnd_t(v).clamp_(-TRUNCATION, TRUNCATION)
        out[a : a + rows] = z.to(torch.float32)  # one RNE rounding
    return out


def exit_uniform(seeds: Tensor, positions: Tensor, depth: int | Tensor, *, check: bool = True
                 ) -> Tensor:  # fmt: skip
    """The uniform a sampled exit (models.exits.SampledGate) compares with the exit gate's
    probability at core iteration ``depth`` (1-based) of the token at absolute position p of
    the completion with latent seed s: float64 [N] in (0, 1), on the tensors' device::

        row = mix(mix(s ^ 0x4C4F4F5045584954) ^ p)       # b"LOOPEXIT": not the noise's rows
        u   = f64((mix(row + depth * GOLDEN) >> 11) | 1) * 2^-53

    Integer ops and one exact conversion, so every device and process gets the same bits: the
    generator that sampled an exit and a learner that checks it agree on u.
    seeds: [N] int64 (u64 as two's complement), positions: [N] int64 >= 0, depth >= 1 (an int,
    or each row's own as [N] int64: decode by ticks; int64 products wrap mod 2^64, the same bits
    as the int's masked product). check=False skips the argument checks, which read values
    back to the host (inside a CUDA graph; the caller guarantees them)."""
    if check:
        if not isinstance(depth, Tensor) and depth < 1:
            raise ValueError(f"exit_uniform: depth must be >= 1, got {depth}")
        if isinstance(depth, Tensor) and depth.numel() and bool((depth < 1).any()):
            raise ValueError("exit_uniform: depths must be >= 1")
        check_noise_args(seeds, positions, 1)
    row = _mix_t(_mix_t(seeds ^ _i64(EXIT_DOMAIN)) ^ positions)
    if isinstance(depth, Tensor):
        bits = _mix_t(row + depth.to(row.device) * _i64(GOLDEN))
    else:
        bits = _mix_t(row + _i64((depth * GOLDEN) & MASK64))
    return (_srl(bits, 11) | 1).to(torch.float64) * 2.0**-53


__all__ = [
    "PHI_MINUS_3",
    "derive_latent_seed",
    "exit_uniform",
    "latent_noise",
    "latent_noise_torch",
    "ppnd",
]
