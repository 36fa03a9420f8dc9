"""Latent noise of the plugin's steps, drawn ahead per request (Huginn's initial state).

`models.noise.latent_noise(seed, p, h)` is a function of (seed, position) alone, element by
element (docs/CONTRACTS.md 1, docs/NOISE.md): rows drawn in one call or in another, alone or
in a batch, are the same bits. A decode step needs one row per request (its next position),
and drawing that row costs about 50 numpy calls whatever the number of rows, so each request
whose rows are not drawn yet gets its positions of this step plus the next `ahead` ones, all
requests of the step in one `latent_noise` call; the following steps of that request copy
their row from the block. Blocks are kept per latent seed, the oldest drawn dropped first
beyond `max_bytes`.

Rows that belong to no request (padding, dummy runs) and requests whose positions in the step
are not consecutive are drawn directly.
"""

from __future__ import annotations

import collections

import numpy as np
import torch
from torch import Tensor

from generator.vllm_plugin.context import StepBatch
from models.noise import latent_noise


class NoiseAhead:
    """Per-seed blocks of latent-noise rows (see module doc)."""

    def __init__(self, hidden: int, ahead: int = 32, max_bytes: int = 32 << 20) -> None:
        self.hidden, self.ahead, self.max_bytes = hidden, ahead, max_bytes
        self._blocks: collections.OrderedDict[int, tuple[int, int, np.ndarray]] = (
            collections.OrderedDict()
        )
        """seed -> (first position, end position, rows [end - first, hidden])."""
        self._bytes = 0

    def _store(self, seed: int, first: int, rows: np.ndarray) -> None:
        old = self._blocks.pop(seed, None)
        if old is not None:
            self._bytes -= old[2].nbytes
        self._blocks[seed] = (first, first + rows.shape[0], rows)
        self._bytes += rows.nbytes
        while self._bytes > self.max_bytes and len(self._blocks) > 1:
            _, (_, _, dropped) = self._blocks.popitem(last=False)  # oldest drawn first
            self._bytes -= dropped.nbytes

    def rows(self, step: StepBatch, positions: np.ndarray) -> Tensor:
        """fp32 [T, hidden]: `latent_noise(step.seeds, positions, hidden)`, bit for bit."""
        n, h = positions.shape[0], self.hidden
        out = np.empty((n, h), dtype=np.float32)
        covered = 0
        draw: list[tuple[int, int, int, int]] = []  # (seed, first position, start, end)
        get = self._blocks.get
        for rs in step.requests:
            start, end = rs.start, rs.end
            if end <= start:
                continue
            first = int(positions[start])
            if end - start > 1 and not np.array_equal(
                positions[start:end], np.arange(first, first + end - start)
            ):
                continue  # not consecutive: drawn directly below
            block = get(rs.seed)
            if block is not None and block[0] <= first and first + end - start <= block[1]:
                out[start:end] = block[2][first - block[0] : first - block[0] + end - start]
            else:
                draw.append((rs.seed, first, start, end))
            covered += end - start
        if draw:
            sizes = [end - start + self.ahead for _, _, start, end in draw]
            seeds = np.repeat(np.asarray([d[0] for d in draw], dtype=np.uint64), sizes)
            pos = np.concatenate([np.arange(f, f + k) for (_, f, _, _), k in zip(draw, sizes)])
            drawn = latent_noise(seeds, torch.from_numpy(pos), h).numpy()
            at = 0
            for (seed, first, start, end), k in zip(draw, sizes):
                fresh = drawn[at : at + k].copy()
                at += k
                out[start:end] = fresh[: end - start]
                self._store(seed, first, fresh)
        if covered < n:  # padding, rows of no request, non-consecutive requests
            done = np.zeros(n, dtype=bool)
            for rs in step.requests:
                first = int(positions[rs.start]) if rs.end > rs.start else 0
                m = rs.end - rs.start
                if m == 1 or (m > 1 and np.array_equal(
                    positions[rs.start : rs.end], np.arange(first, first + m)
                )):  # fmt: skip
                    done[rs.start : rs.end] = True
            rest = np.flatnonzero(~done)
            seeds_rest = step.seeds[rest]
            out[rest] = latent_noise(seeds_rest, torch.from_numpy(positions[rest]), h).numpy()
        return torch.from_numpy(out)

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0


__all__ = ["NoiseAhead"]
