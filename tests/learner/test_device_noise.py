"""models.noise.latent_noise_torch: the latent noise on the learner's device, bit-identical to
the CPU specification (`latent_noise`, docs/NOISE.md). Runs on the CPU here and, where CUDA is
present (scripts/gpu_check.sh on the H200), on the GPU too: docs/NOISE.md's pinned vectors,
its 1024 x 5280 block digest, the ppnd intermediates and random seeds / positions (tails
included) must come out with the same float32 bits."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from models.noise import _ppnd_t, latent_noise, latent_noise_torch
from tests.models.test_noise_contract import (
    BLOCK_SHA256,
    ELEMENTS,
    PPND_VECTORS,
    ROW_SHA256,
    VECTORS,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _noise(seed: int, positions: list[int] | torch.Tensor, h: int, device: str) -> torch.Tensor:
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).to(device)
    s = seed - 2**64 if seed >= 2**63 else seed
    seeds = torch.full_like(pos, s)
    return latent_noise_torch(seeds, pos, h).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_pinned_vectors_on_device(device: str) -> None:
    for (seed, pos), expected in VECTORS.items():
        row = _noise(seed, [pos], 64, device)
        got = " ".join(f"{int(b):08x}" for b in row[0, :8].numpy().view(np.uint32))
        assert got == expected, (device, seed, pos)
        assert hashlib.sha256(row.numpy().tobytes()).hexdigest() == ROW_SHA256[(seed, pos)]
    for (seed, pos, e), expected in ELEMENTS.items():
        assert (
            f"{int(_noise(seed, [pos], e + 1, device)[0, e:].numpy().view(np.uint32)[0]):08x}"
            == expected
        )
    block = _noise(3, torch.arange(1024), 5280, device).numpy()
    assert hashlib.sha256(block.tobytes()).hexdigest() == BLOCK_SHA256
    for v, z in PPND_VECTORS.items():
        x = torch.tensor([float.fromhex(v)], dtype=torch.float64, device=device)
        assert float(_ppnd_t(x)[0]).hex() == z, (device, v)


@pytest.mark.parametrize("device", DEVICES)
def test_random_seeds_and_positions_bit_identical(device: str) -> None:
    gen = torch.Generator().manual_seed(12)
    seeds = torch.randint(-(2**63), 2**63 - 1, (500,), dtype=torch.int64, generator=gen)
    seeds[:4] = torch.tensor([-1, 0, 2**63 - 1, -(2**63)])
    pos = torch.randint(0, 1 << 40, (500,), dtype=torch.int64, generator=gen)
    want = latent_noise(seeds, pos, 777)
    got = latent_noise_torch(seeds.to(device), pos.to(device), 777, chunk_elems=10_001).cpu()
    assert got.dtype == torch.float32 and got.shape == (500, 777)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert float(want.abs().max()) > 2.9  # the tail branch ran


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="int64"):
        latent_noise_torch(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=">= 0"):
        latent_noise_torch(torch.zeros(1, dtype=torch.int64), torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="hidden_size"):
        latent_noise_torch(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0)
