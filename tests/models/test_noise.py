"""The latent-noise contract: seeds, invariance to batching, distribution, pinned values."""

from __future__ import annotations

import math
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from models import noise
from models.noise import derive_latent_seed, latent_noise


def test_derive_latent_seed() -> None:
    s = derive_latent_seed(7, 3, 0)
    assert s == derive_latent_seed(7, 3, 0) and 0 <= s < 2**64
    others = {derive_latent_seed(7, 3, 1), derive_latent_seed(7, 4, 0), derive_latent_seed(8, 3, 0)}
    assert s not in others and len(others) == 3
    assert derive_latent_seed(7, "prompt-a", 0) != derive_latent_seed(7, "prompt-b", 0)
    assert derive_latent_seed(0, 0, 0) == 0x7FD1E9BF2553AF67  # pinned: the hash is a contract
    with pytest.raises(ValueError, match="run_seed"):
        derive_latent_seed(-1, 0, 0)
    with pytest.raises(ValueError, match="sample_index"):
        derive_latent_seed(0, 0, 2**64)


def test_mix_matches_integer_reference() -> None:
    zs = [0, 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    arr = noise._mix(np.array(zs, dtype=np.uint64))
    assert [int(v) for v in arr] == [noise._mix_int(z) for z in zs]


def test_noise_depends_only_on_seed_and_position() -> None:
    seed = derive_latent_seed(1, 2, 3)
    full = latent_noise(seed, torch.arange(40), 96)
    assert full.dtype == torch.float32 and full.shape == (40, 96)
    # any subset, order or chunking of positions gives the same rows
    perm = torch.tensor([39, 0, 17, 5])
    assert torch.equal(latent_noise(seed, perm, 96), full[perm])
    chunks = torch.cat([latent_noise(seed, torch.arange(a, a + 8), 96) for a in range(0, 40, 8)])
    assert torch.equal(chunks, full)
    # per-token seeds (mixed batch) equal the one-seed rows
    other = latent_noise(seed + 1, torch.arange(3), 96)
    mixed = latent_noise([seed, seed + 1, seed], torch.tensor([4, 1, 30]), 96)
    assert torch.equal(mixed[0], full[4]) and torch.equal(mixed[1], other[1])
    assert torch.equal(mixed[2], full[30])
    # int64 tensors of seeds read as two's complement
    big = 2**64 - 5
    as_t = torch.tensor([big - 2**64], dtype=torch.int64)
    assert torch.equal(latent_noise(as_t, [3], 8), latent_noise(big, [3], 8))
    # element e of a row does not depend on hidden_size
    assert torch.equal(latent_noise(seed, [2], 16), full[2:3, :16])
    assert not torch.equal(full[0], full[1])


def test_noise_distribution_and_pinned_values() -> None:
    z = latent_noise(12345, torch.arange(512), 256).double()
    assert float(z.abs().max()) <= 3.0
    assert abs(float(z.mean())) < 0.01
    assert abs(float(z.std()) - 0.9866) < 0.01  # std of N(0, 1) truncated to [-3, 3]
    head = latent_noise(123, torch.arange(2), 4)
    expected = torch.tensor([[-0.3286, 0.2933, 0.4089, 0.4715], [-0.3713, -2.0501, 0.4009, 0.1239]])
    assert torch.allclose(head, expected, atol=1e-4)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        latent_noise(1, [-1], 4)


def test_uniform_is_exact_and_inside_the_open_interval() -> None:
    """u = f64((bits >> 11) | 1) 2^-53: exact odd multiples of 2^-53, never 0 or 1."""
    extremes = [0, 1, (1 << 11) - 1, 1 << 11, 1 << 63, (1 << 64) - (1 << 11), (1 << 64) - 1]
    bits = np.array(extremes, dtype=np.uint64)
    k = (bits >> np.uint64(11)) | np.uint64(1)
    u = k.astype(np.float64) * 2.0**-53
    for b, x in zip(extremes, u.tolist(), strict=True):
        assert Fraction(x) == Fraction((b >> 11) | 1, 2**53)  # exact
        assert 0.0 < x < 1.0
    assert u.min() == 2.0**-53 and u.max() == 1.0 - 2.0**-53
    out = noise._uniform_to_noise(bits)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert out.min() >= -3.0 and out.max() <= 3.0
    assert out[0] == np.float32(-3.0) and out[-1] == np.float32(3.0)  # the ends round to +-3


def test_log_is_accurate() -> None:
    w = np.concatenate([np.geomspace(noise.LO * 0.99, 0.08, 20_001), 2.0 ** -np.arange(1, 11)])
    got = noise._log(w.copy())
    want = np.array([math.log(x) for x in w.tolist()])
    assert (np.abs(got - want) <= 2 * np.spacing(np.abs(want))).all()


def test_noise_is_fast_enough() -> None:
    latent_noise(1, torch.arange(8), 5280)  # warm up
    t = time.perf_counter()
    latent_noise(1, torch.arange(2048), 5280)  # Huginn width: ~0.25 s unloaded
    assert time.perf_counter() - t < 3.0
