"""Non-finite weights are never published (docs/CONTRACTS.md, invariants; trainer side).

1. learner.trainer: a rollout batch whose loss and gradients are not finite (a reward of inf:
   its group's advantages become NaN) is skipped on every rank. One spawned run of 2 ranks
   (gloo), at TP=2 and then at DP=2 (the inf sits in data-parallel rank 1's rows only, so
   rank 0's own loss is finite and only the reduced gradients are NaN): the weights stay
   bit-identical, the metrics report the skip, and a following good step gives bit for bit the
   weights of a fresh trainer that only saw the good step (Adam state and LR warmup untouched).
2. learner.publish: a state with NaN / inf, or a finite fp32 state that overflows bf16 in the
   cast, raises NonFiniteWeightsError naming the tensor and nothing is written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from tests.learner.dist_utils import run_distributed
from tests.learner.test_trainer import SEED, looped_trainer, rollouts_for

pytestmark = pytest.mark.megatron

CFG = TrainConfig(global_batch_size=8, micro_batch_size=2, seed=SEED)
ADAM = OptimConfig(name="adam", lr=1e-3, grad_clip=1.0)  # DistributedOptimizer
WARMUP = ScheduleConfig(style="linear", warmup_steps=2, decay_steps=4)  # LR differs per update


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy_model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def skip_body() -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed

    out: dict[str, Any] = {}
    for tp in (2, 1):
        init_distributed(tp=tp, seed=SEED)
        bad = rollouts_for(7)
        # Sorted by id, group w7-1 is the second half of the batch: DP rank 1's rows at DP=2.
        next(r for r in bad if r.rollout_id == "w7-1/3").reward = math.inf
        a = looped_trainer(CFG, ADAM, WARMUP)
        before = _params(a)
        m_bad = a.step(bad)
        unchanged = _same(before, _params(a))
        m_good = a.step(rollouts_for(9))
        b = looped_trainer(CFG, ADAM, WARMUP)
        m_ref = b.step(rollouts_for(9))
        out[f"tp{tp}"] = {
            "unchanged": unchanged,
            "finite_after_bad": all(bool(torch.isfinite(p).all()) for p in _params(a).values()),
            "good_equals_fresh": _same(_params(a), _params(b)),
            "m_bad": m_bad,
            "m_good": m_good,
            "m_ref": m_ref,
            "update_count": a.update_count,
            "weight_version": a.weight_version,
        }
        destroy_distributed(keep_process_group=tp == 2)
    return out


@pytest.fixture(scope="module")
def skipped() -> list[dict[str, Any]]:
    return run_distributed(skip_body, 2, timeout_s=300)


@pytest.mark.parametrize("tp", [2, 1])
def test_nonfinite_update_is_skipped_on_every_rank(skipped: list[dict[str, Any]], tp: int) -> None:
    for rank in skipped:
        r = rank[f"tp{tp}"]
        assert r["unchanged"] and r["finite_after_bad"]
        assert r["m_bad"]["skipped_nonfinite"] == 1.0
        assert r["m_bad"]["skipped_nonfinite_total"] == 1.0
        assert not math.isfinite(r["m_bad"]["grad_norm"])
        assert r["m_good"]["skipped_nonfinite"] == 0.0
        assert r["m_good"]["skipped_nonfinite_total"] == 1.0
        assert math.isfinite(r["m_good"]["loss"]) and math.isfinite(r["m_good"]["grad_norm"])
        # Optimizer state and LR schedule untouched: the good step equals a fresh first step.
        assert r["good_equals_fresh"]
        assert r["m_good"]["lr"] == r["m_ref"]["lr"] == pytest.approx(5e-4)  # warmup: 1 of 2
        assert r["m_good"]["loss"] == r["m_ref"]["loss"]
        assert r["update_count"] == 1 and r["weight_version"] == 2
    a, b = skipped[0][f"tp{tp}"]["m_bad"], skipped[1][f"tp{tp}"]["m_bad"]
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a), (a, b)


def _exporter(state: dict[str, torch.Tensor]) -> Any:
    return lambda model: (dict(state), set())


def test_publish_refuses_nonfinite_tensors(tmp_path: Path) -> None:
    from learner.publish import publish
    from models.errors import NonFiniteWeightsError
    from weights.publication import weights_dir

    good = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bad = good.clone()
    bad[0, 1], bad[2, 3], bad[1, 0] = math.nan, math.inf, -math.inf
    state = {"a.weight": good, "b.weight": bad, "c.weight": torch.full((2,), math.nan)}
    model = torch.nn.Linear(1, 1)
    with pytest.raises(NonFiniteWeightsError, match=r"'b\.weight' has 3 non-finite .* of 12"):
        publish(model, weights_dir(tmp_path, 1), 1, config={}, exporter=_exporter(state))
    assert not (tmp_path / "weights").exists()
    assert issubclass(NonFiniteWeightsError, ValueError)

    # Finite in fp32, but the largest fp32 values round to inf in bf16: refused after the cast.
    big = {"a.weight": good, "z.weight": torch.tensor([torch.finfo(torch.float32).max, 1.0])}
    pub = publish(model, weights_dir(tmp_path, 1), 1, config={}, exporter=_exporter(big))
    assert pub is not None and (tmp_path / "weights" / "v1").is_dir()
    with pytest.raises(NonFiniteWeightsError, match=r"'z\.weight' has 1 non-finite .* of 2") as e:
        publish(
            model,
            weights_dir(tmp_path, 2),
            2,
            config={},
            dtype=torch.bfloat16,
            exporter=_exporter(big),
        )
    assert (e.value.name, e.value.count, e.value.numel) == ("z.weight", 1, 2)
    assert not (tmp_path / "weights" / "v2").exists()
