"""The learner's run-config knobs: `learner.precision`, `learner.backprop_depth`,
micro-batching, recompute, compile, mapped by `pipeline.backends.megatron_adapter.build_learner_trainer`
(the path `looprl learner` takes), refused where a backend or numerics mode cannot honour them;
and the CPU smoke mode of benchmarks/trainer_gpu.py (the real Trainer, tiny shape).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from models.errors import ConfigError
from pipeline.config.run import load_config
from tests.bench_import import load_benchmark
from tests.learner.dist_utils import run_distributed
from tests.learner.test_trainer import rollouts_for

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[2]


def test_config_refuses_what_a_backend_cannot_honour() -> None:
    assert load_config(None, ["learner.precision=bf16"]).learner.precision == "bf16"
    with pytest.raises(ConfigError, match="learner.precision.*numerics=exact needs fp32"):
        load_config(None, ["learner.precision=bf16", "numerics=exact"])
    with pytest.raises(ConfigError, match="learner.compile.*numerics=exact"):
        load_config(None, ["learner.compile=true", "numerics=exact"])
    with pytest.raises(ConfigError, match="learner.precision.*backend=reference"):
        load_config(None, ["learner.precision=bf16", "backend=reference"])
    with pytest.raises(ConfigError, match="learner.backprop_depth.*backend=reference"):
        load_config(None, ["learner.backprop_depth=4", "backend=reference"])
    for key in ("recompute=true", "compile=true"):
        with pytest.raises(ConfigError, match=f"learner.{key.split('=')[0]}.*backend=reference"):
            load_config(None, [f"learner.{key}", "backend=reference"])
    assert load_config(None, ["learner.backprop_depth=0", "backend=reference"]).backend
    # learner.micro_batch_size: honoured by both backends (tests/pipeline/test_epochs.py)
    assert load_config(None, ["learner.micro_batch_size=2", "backend=reference"]).learner
    with pytest.raises(ConfigError, match="learner.precision"):
        load_config(None, ["learner.precision=fp16"])
    with pytest.raises(ConfigError, match="learner.backprop_depth"):
        load_config(None, ["learner.backprop_depth=-2"])


def precision_body() -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed
    from learner.publish import publication_state
    from models.config import tiny_config
    from pipeline.backends.megatron_adapter import build_learner_trainer

    init_distributed(tp=1, seed=0)
    out: dict[str, Any] = {}
    base = ["rollout.n=4", "rollout.prompts_per_step=2", "optimizer.lr=1e-3"]
    for name, extra in (
        ("fp32", []),
        ("bf16", ["learner.precision=bf16", "learner.backprop_depth=2",
                  "learner.micro_batch_size=2", "learner.recompute=true"]),
    ):  # fmt: skip
        cfg = load_config(None, base + extra)
        trainer = build_learner_trainer(cfg, tiny_config("huginn"), None)
        model = trainer.policy_model
        opt = trainer.policy.opt.chained_optimizers[0]
        mains = [p for g in getattr(opt, "shard_fp32_from_float16_groups", []) for p in g]
        metrics = [trainer.step(rollouts_for(7 + i)) for i in range(2)]
        stored, _ = publication_state(model)
        out[name] = {
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "main_dtypes": sorted({str(p.dtype) for p in mains}),
            "optimizer": type(opt).__name__,
            "backprop_depth": model.backprop_depth,
            "micro": trainer.cfg.micro_batch_size,
            "recompute": model.options.recompute,
            "losses": [m["loss"] for m in metrics],
            "grad_norms": [m["grad_norm"] for m in metrics],
            "published": sorted({str(t.dtype) for n, t in stored.items() if n != "freqs_cis"}),
        }
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def precision() -> dict[str, Any]:
    return run_distributed(precision_body, 1, torchrun_env=False, timeout_s=300)[0]


def test_bf16_is_megatron_mixed_precision(precision: dict[str, Any]) -> None:
    fp32, bf16 = precision["fp32"], precision["bf16"]
    assert fp32["param_dtypes"] == ["torch.float32"] and fp32["main_dtypes"] == []
    assert bf16["param_dtypes"] == ["torch.bfloat16"]
    assert bf16["optimizer"] == "DistributedOptimizer" and bf16["main_dtypes"] == ["torch.float32"]
    assert bf16["published"] == ["torch.bfloat16"] and fp32["published"] == ["torch.float32"]
    assert (fp32["backprop_depth"], bf16["backprop_depth"]) == (0, 2)  # -1: checkpoint's 8 >= 6
    # fp32: the automatic micro-batch (9bf4dc7: the most rows within 16,384 tokens, here all 8
    # of the step; tests/pipeline/test_micro_batch.py), bf16: the explicit 2
    assert (fp32["micro"], bf16["micro"]) == (8, 2)
    assert (fp32["recompute"], bf16["recompute"]) == ("none", "block")
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert math.isfinite(b) and b == pytest.approx(a, rel=0.1, abs=2e-2)
    assert all(math.isfinite(g) and g > 0 for g in bf16["grad_norms"])


def test_trainer_benchmark_cpu_smoke() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "benchmarks/trainer_gpu.py", "--device", "cpu", "--tiny"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["bench"] == "trainer_step" and res["device"] == "cpu"
    assert res["loss_finite_every_step"] and len(res["losses"]) == 3
    assert all(math.isfinite(x) for x in res["losses"])
    assert res["tokens_per_s"] > 0 and res["backprop_depth_used"] == 2
    assert res["precision"] == "bf16" and res["skipped_nonfinite_total"] == 0.0
    assert torch.tensor(res["flops_per_token"]) > 0
    assert res["lr"] == 1e-4 and len(res["grad_norms"]) == 3  # the tiny shape's own rate
    assert res["health"]["verdict"] == "ok", res


def test_trainer_benchmark_exit_depths_with_and_without_depth_batching() -> None:
    """``--exit-depths uniform`` (each response token's depth in 1..r) with depth batching and
    with ``--no-compact``: the same rollouts (mean depth ~(r + 1) / 2), the same training
    within bf16 rounding, the JSON says which ran and leaves the full-depth MFU out."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = {}
    for flags in ([], ["--no-compact"]):
        proc = subprocess.run(
            [sys.executable, "benchmarks/trainer_gpu.py", "--device", "cpu", "--tiny",
             "--exit-depths", "uniform", *flags],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[bool(flags)] = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = out[False], out[True]
    assert on["compact"] is True and off["compact"] is False
    assert on["exit_depths"] == off["exit_depths"] == "uniform"
    assert 2.0 < on["mean_exit_depth"] == off["mean_exit_depth"] < 3.0  # r = 4
    assert on["mfu"] is None and on["mfu_real_tokens"] is None
    for a, b in zip(on["losses"], off["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (on["losses"], off["losses"])
    assert on["health"]["verdict"] == off["health"]["verdict"] == "ok"


def test_trainer_benchmark_flags_a_collapse_not_only_nonfinite() -> None:
    """The verdict of benchmarks/trainer_gpu.py: the collapse once seen (compiled
    Huginn-0125 at lr 3e-3: loss exactly 0.282842 with gradient norms ~1e-8 between spikes)
    is a collapse though every value is finite; an ordinary noisy run is ok."""
    health = load_benchmark("health").health

    ok = health([0.31, 0.27, 0.35, 0.29, 0.33], [4.1, 3.8, 5.0, 4.4, 3.9])
    assert ok == {"verdict": "ok", "steps": []}
    losses = [0.30, 0.282842, 0.282842, 0.282842, 0.282842, 0.31]
    norms = [5.0, 37.0, 1e-8, 1.2e-8, 0.9e-8, 111.0]
    got = health(losses, norms)
    assert got["verdict"] == "collapse" and got["steps"][:3] == [2, 3, 4], got
    assert health([0.3, 0.282842, 0.3, 0.282842], [4.0, 1e-9, 4.0, 1e-9])["verdict"] != "collapse"
    assert health([0.3, 0.2, 0.25, 0.3], [4.0, 4.2, 400.0, 3.9]) == {
        "verdict": "spikes",
        "steps": [2],
    }
    assert health([0.3, math.nan, 0.25], [4.0, 4.2, 3.9])["verdict"] == "nonfinite"
    # the H200 run at lr 3e-3 (docs/PERFORMANCE.md): finite, no spike, the loss up 4.8x
    lr3e3 = [0.136, 0.169, 0.205, 0.362, 0.468, 0.488, 0.537, 0.517, 0.566, 0.534, 0.574,
             0.584, 0.581, 0.582, 0.651]  # fmt: skip
    got = health(lr3e3, [1.25, 1.9, 2.35, 1.31, 1.87, 1.93, 2.44, 1.6, 1.69, 1.98, 2.22, 3.37,
                         3.17, 3.44, 4.73])  # fmt: skip
    assert got == {"verdict": "diverging", "steps": [10, 11, 12, 13, 14]}, got
    lr1e6 = [0.136, 0.141, 0.140, 0.133, 0.136, 0.133, 0.137, 0.129, 0.134, 0.134, 0.130, 0.133]
    assert health(lr1e6, [1.25] * 12)["verdict"] == "ok"
