"""models.kernels.noise.latent_noise_cuda: Huginn's latent noise in one Triton kernel, bit for
bit the CPU specification (`models.noise.latent_noise`, docs/NOISE.md) and the torch-op version
(`latent_noise_torch`). CUDA only (scripts/gpu_check.sh runs it on the H200); on the CPU the
function is latent_noise_torch itself, which tests/learner/test_device_noise.py covers."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from models.kernels.noise import HAVE_TRITON, latent_noise_cuda
from models.noise import latent_noise, latent_noise_torch
from tests.models.test_noise_contract import BLOCK_SHA256, ELEMENTS, ROW_SHA256, VECTORS

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and Triton"
)


def _noise(seed: int, positions: list[int] | torch.Tensor, h: int) -> torch.Tensor:
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cuda()
    s = seed - 2**64 if seed >= 2**63 else seed
    return latent_noise_cuda(torch.full_like(pos, s), pos, h).cpu()


def test_pinned_vectors() -> None:
    for (seed, pos), expected in VECTORS.items():
        row = _noise(seed, [pos], 64)
        got = " ".join(f"{int(b):08x}" for b in row[0, :8].numpy().view(np.uint32))
        assert got == expected, (seed, pos)
        assert hashlib.sha256(row.numpy().tobytes()).hexdigest() == ROW_SHA256[(seed, pos)]
    for (seed, pos, e), expected in ELEMENTS.items():
        got = int(_noise(seed, [pos], e + 1)[0, e:].numpy().view(np.uint32)[0])
        assert f"{got:08x}" == expected
    block = _noise(3, torch.arange(1024), 5280).numpy()
    assert hashlib.sha256(block.tobytes()).hexdigest() == BLOCK_SHA256


def test_random_seeds_and_positions_bit_identical() -> None:
    gen = torch.Generator().manual_seed(12)
    seeds = torch.randint(-(2**63), 2**63 - 1, (600,), dtype=torch.int64, generator=gen)
    seeds[:4] = torch.tensor([-1, 0, 2**63 - 1, -(2**63)])
    pos = torch.randint(0, 1 << 40, (600,), dtype=torch.int64, generator=gen)
    want = latent_noise(seeds, pos, 777)
    got = latent_noise_cuda(seeds.cuda(), pos.cuda(), 777)
    assert got.dtype == torch.float32 and got.shape == (600, 777) and got.is_cuda
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert float(want.abs().max()) > 2.9  # the tail branch ran
    # a training-sized block against the torch-op version on the device (4 M elements)
    s2 = torch.randint(-(2**63), 2**63 - 1, (2048,), dtype=torch.int64, generator=gen).cuda()
    p2 = torch.arange(2048, dtype=torch.int64).cuda()
    a, b = latent_noise_cuda(s2, p2, 2048), latent_noise_torch(s2, p2, 2048)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_bad_arguments_are_refused() -> None:
    z64 = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="int64"):
        latent_noise_cuda(z64.int(), z64, 4)
    with pytest.raises(ValueError, match=">= 0"):
        latent_noise_cuda(z64, z64 - 1, 4)
    with pytest.raises(ValueError, match="hidden_size"):
        latent_noise_cuda(z64, z64, 0)
