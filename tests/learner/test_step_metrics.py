"""learner.step_metrics.StepMetrics with values left on the device (0-d tensors, read once at
`reduce`) gives the same bits as the Python floats it was fed before (``float(t)`` of each value
at once): sums, token-weighted means and maxima, float32 and float64 values, integer counts,
adversarial magnitudes (1e30 beside 1e-30, negative zero, huge counts), and a mix of floats and
tensors; `mismatch_stats` likewise; and `policy_loss(lazy=True)` holds the values its floats
had. The card is not needed: the arithmetic of the accumulation is what is compared."""

from __future__ import annotations

import math
import random

import torch

from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss
from learner.step_metrics import StepMetrics, mismatch_stats, record_policy


def _values(rng: random.Random, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:  # float32, across magnitudes
            v = torch.tensor(rng.choice([1.0, -1.0]) * 10.0 ** rng.uniform(-30, 30),
                             dtype=torch.float32)  # fmt: skip
        elif kind == 1:  # float64
            v = torch.tensor(rng.uniform(-1e6, 1e6), dtype=torch.float64)
        elif kind == 2:  # an integer count
            v = torch.tensor(rng.randrange(0, 1 << 40), dtype=torch.int64)
        else:
            v = torch.tensor(-0.0, dtype=torch.float32)
        out.append(v)
    return out


def _feed(m: StepMetrics, ops: list[tuple[str, str, list[torch.Tensor]]], lazy: bool) -> None:
    def val(t: torch.Tensor) -> float | torch.Tensor:
        return t if lazy else float(t)

    for op, key, vs in ops:
        if op == "sum":
            m.add_sum(key, val(vs[0]))
        elif op == "mean":
            m.add_mean(key, val(vs[0]), val(vs[1]))
        elif op == "weighted":
            m.add_weighted(key, val(vs[0]), val(vs[1]))
        else:
            m.add_max(key, val(vs[0]))


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or (a[k] == b[k] and
                                                    math.copysign(1, a[k]) == math.copysign(1, b[k]))
        for k in a
    )  # fmt: skip


def test_tensor_values_reduce_to_the_bits_of_floats() -> None:
    rng = random.Random(0)
    for _ in range(50):
        ops = []
        for _ in range(rng.randrange(1, 40)):
            op = rng.choice(["sum", "mean", "weighted", "max"])
            ops.append((op, f"{op}{rng.randrange(3)}", _values(rng, 2)))
        floats, tensors, mixed = StepMetrics(), StepMetrics(), StepMetrics()
        _feed(floats, ops, lazy=False)
        _feed(tensors, ops, lazy=True)
        for i, o in enumerate(ops):  # every other value a float
            _feed(mixed, [o], lazy=bool(i % 2))
        want = floats.reduce(None)
        assert _same(want, tensors.reduce(None)), (want, tensors.reduce(None))
        assert _same(want, mixed.reduce(None))


def test_the_mismatch_family_and_a_lazy_loss_match_their_floats() -> None:
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    mask[2] = 0.0  # a row without a live token
    behav = torch.randn(6, 9, generator=gen) * 3 - 4
    learner = behav + torch.randn(6, 9, generator=gen) * 0.7
    learner[0, 1] = -math.inf  # not finite: out of the live tokens
    got = StepMetrics()
    mismatch_stats(got, mask, behav, learner, rejected=torch.rand(6, 9, generator=gen) > 0.8)
    want = StepMetrics()  # the same values read one by one, as before
    for k, v in got.sums.items():
        want.sums[k] = float(v)
    for k, v in got.weighted.items():
        want.weighted[k], want.weights[k] = float(v), float(got.weights[k])
    for k, vs in got.maxes.items():
        want.maxes[k] = [float(x) for x in vs]
    assert _same(got.reduce(None), want.reduce(None))
    assert got.reduce(None)["logp_mismatch_mean"] > 0  # real values, not zeros

    cfg = ObjectiveConfig(kind="ppo")
    batch = {"mask": mask, "advantages": torch.randn(6, 9, generator=gen),
             "logp": behav + 0.1, "behav_logp": behav, "normalizer": float(mask.sum())}  # fmt: skip
    loss, floats = policy_loss(cfg, batch)
    loss_l, lazy = policy_loss(cfg, batch, lazy=True)
    assert torch.equal(loss, loss_l) and floats.keys() == lazy.keys()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in lazy.values())
    assert all(float(lazy[k]) == floats[k] for k in floats)
    a, b = StepMetrics(), StepMetrics()
    record_policy(a, floats, mask, behav, learner, 3)
    record_policy(b, lazy, mask, behav, learner, 3)
    assert _same(a.reduce(None), b.reduce(None))
