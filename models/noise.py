"""The latent-noise contract (DESIGN contract 1): seeds and the initial latent state's noise.

Every completion has a 64-bit `latent_seed = derive_latent_seed(run_seed, prompt_id,
sample_index)`. The noise of the token at absolute position p (0 = first prompt token) is
`latent_noise(latent_seed, [p], h)[0]`: a function of (latent_seed, p, h) alone, computed on
the CPU in integer and float64 arithmetic and rounded once to fp32. It does not depend on batch
composition, prefill chunking, process, device or compute dtype: callers draw it here (CPU),
then move / cast it. Callers multiply by their std and scale (Huginn: `models.huginn`).

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
        u    = ((bits >> 11) + 0.5) * 2^-53                 # float64, exact, in (0, 1)
        v    = LO + u * (HI - LO)                           # float64; LO = Phi(-3), HI = 1 - LO
        z    = ndtri(v)                                     # float64 inverse normal CDF
        out  = float32(clamp(z, -3, 3))                     # round to nearest even

i.e. a standard normal truncated to [-3, 3] by inversion, as the official Huginn init
(`trunc_normal_(std, a=-3 std, b=3 std)`) has it after dividing by std. `ndtri` is torch's
CPU float64 `torch.special.ndtri` (Cephes); any float64 implementation accurate to a few ulp
gives the same fp32 bits except on a set of inputs of probability ~1e-9, so a second
implementation should simply call this function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
NOISE_DOMAIN = 0x4C4F4F50524C4E5A
PHI_MINUS_3 = 0.0013498980316300946
"""Phi(-3) = 0.5 * erfc(3 / sqrt(2)) as the nearest float64."""
TRUNCATION = 3.0

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


def _u64(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MASK64:
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {value!r}")
    return value


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
    bits = _mix(row[:, None] + offs[None, :])  # [T, h]
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)
    lo, hi = PHI_MINUS_3, 1.0 - PHI_MINUS_3
    v = lo + u * (hi - lo)
    z = torch.special.ndtri(torch.from_numpy(v))
    return z.clamp_(-TRUNCATION, TRUNCATION).float()


__all__ = ["PHI_MINUS_3", "derive_latent_seed", "latent_noise"]
