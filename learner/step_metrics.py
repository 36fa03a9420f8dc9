"""Per-step training metrics: sums, token-weighted means and maxima over DP ranks."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_(t: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a CPU tensor over `group`, through the current CUDA device when
    the group's backend is NCCL (which has no CPU tensors); returns `t`."""
    if dist.get_backend(group) == "nccl":
        dev = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(dev, op=op, group=group)
        t.copy_(dev.cpu())
    else:
        dist.all_reduce(t, op=op, group=group)
    return t


class StepMetrics:
    """Sums, token-weighted means and maxima, reduced over the data-parallel group."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def add_mean(self, key: str, value: float, weight: float) -> None:
        self.add_weighted(key, value * weight, weight)

    def add_weighted(self, key: str, weighted_sum: float, weight: float) -> None:
        self.weighted[key] = self.weighted.get(key, 0.0) + weighted_sum
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def add_max(self, key: str, value: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, -math.inf), value)

    def reduce(self, group: Any) -> dict[str, float]:
        sk, wk, mk = sorted(self.sums), sorted(self.weighted), sorted(self.maxes)
        flat = [self.sums[k] for k in sk]
        flat += [self.weighted[k] for k in wk] + [self.weights[k] for k in wk]
        packed = torch.tensor(flat, dtype=torch.float64)
        peaks = torch.tensor([self.maxes[k] for k in mk], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            all_reduce_(packed, group)
            all_reduce_(peaks, group, dist.ReduceOp.MAX)
        vals, n = packed.tolist(), len(sk)
        out = dict(zip(sk, vals[:n], strict=True))
        for i, k in enumerate(wk):
            w = vals[n + len(wk) + i]
            out[k] = vals[n + i] / w if w > 0 else 0.0
        out.update(zip(mk, peaks.tolist(), strict=True))
        return out
