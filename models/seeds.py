"""Latent seeds (docs/CONTRACTS.md 1) as code: one owner of their range and their int64 form,
which every consumer imports (the reference replay, the learner's batches, the vLLM plugin's
seed plumbing, the latent noise, the sampler).

A latent seed is a 64-bit unsigned integer. ``check_latent_seed`` validates one;
``seed_to_i64`` / ``seed_from_i64`` wrap it into the signed int64 that torch tensors hold and
back (two's complement, so the 64 bits are unchanged).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proto.schema import U64_MAX  # the wire format owns the 64-bit range

__all__ = ["check_latent_seed", "seed_from_i64", "seed_to_i64"]


def check_latent_seed(seed: Any, what: str = "latent seed") -> int:
    """``seed`` as an int, or ValueError unless it is an integer in [0, 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed <= U64_MAX:
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def seed_to_i64(seed: int) -> int:
    """The uint64 seed as the int64 with the same bits (for torch int64 tensors)."""
    s = check_latent_seed(seed)
    return s - (1 << 64) if s >= 1 << 63 else s


def seed_from_i64(x: int) -> int:
    """Inverse of ``seed_to_i64``."""
    return int(x) & U64_MAX
