"""NoiseAhead: the plugin's drawn-ahead latent noise equals `latent_noise` bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from generator.vllm_plugin.context import RequestSlice, StepBatch
from generator.vllm_plugin.noise import NoiseAhead
from models.noise import latent_noise


def _step(reqs: list[tuple[int, int]], pad: int = 0) -> tuple[StepBatch, np.ndarray]:
    """A step of requests (seed, [positions...]) in order, plus `pad` padding rows."""
    slices, seeds, pos, at = [], [], [], 0
    for seed, ps in reqs:
        slices.append(RequestSlice(f"r{seed}", at, at + len(ps), 5, seed, 1.0, 1.0))
        seeds += [seed] * len(ps)
        pos += list(ps)
        at += len(ps)
    seeds += [0] * pad
    pos += list(range(pad))
    big = np.iinfo(np.int64).max
    batch = StepBatch(slices, np.asarray(seeds, np.uint64), np.full(len(pos), big), at)
    return batch, np.asarray(pos, dtype=np.int64)


def test_rows_equal_latent_noise_over_prefill_decode_eviction_and_padding() -> None:
    ahead = NoiseAhead(64, ahead=4, max_bytes=20 * 64 * 4)  # a few blocks: evictions happen
    seeds = [7, 2**64 - 1, 12345, 7 + 2**40]
    steps = [
        [(seeds[0], range(0, 6)), (seeds[1], range(0, 3))],  # prefill chunks
        [(seeds[0], [6]), (seeds[1], range(3, 5)), (seeds[2], range(0, 4))],
        [(seeds[0], [7]), (seeds[1], [5]), (seeds[2], [4]), (seeds[3], [0, 1])],
        [(seeds[0], [8]), (seeds[1], [6]), (seeds[2], [5]), (seeds[3], [2])],
        [(seeds[0], [9]), (seeds[1], [3, 9]), (seeds[2], [6])],  # not consecutive: direct
        [(seeds[0], [10]), (seeds[2], [7]), (seeds[3], [3])],
        [(seeds[0], [2]), (seeds[2], [8])],  # behind the block (a recompute): drawn again
    ]
    for i, reqs in enumerate(steps):
        batch, pos = _step(reqs, pad=2 if i % 2 else 0)
        got = ahead.rows(batch, pos)
        want = latent_noise(batch.seeds, torch.from_numpy(pos), 64)
        assert got.dtype == torch.float32 and got.shape == (pos.shape[0], 64)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"step {i}"
    assert 0 < ahead._bytes <= ahead.max_bytes
