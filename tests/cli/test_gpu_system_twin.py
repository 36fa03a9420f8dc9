"""benchmarks/gpu_system.py's CPU twin, as a person runs it: `looprl run` on the tiny shape
with the torch engine, then the run's Trainer on its recorded steps and its engine on one
step's work, alone; one JSON line whose figures hang together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_system_cpu_twin(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_system.py", "--size", "tiny", "--device", "cpu",
           "--tokens", "8", "--prompts", "4", "--n", "2", "--steps", "4", "--warmup", "1",
           "--engine", "torch", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0 and res["rows"] == 3  # steps 2..4 after one warm-up step
    # what the auto keys became on a CPU host, as the run recorded them
    assert res["chosen"] == {
        "learner.precision": "fp32", "learner.compile": False,
        "learner.max_tokens_per_micro": 0, "generators.engine": "torch",
        "generators.kv_cache_mb": 64, "generators.max_inflight": 16,
        "publish.transport": "shared_fs", "publish.directories": "every", "learner.lora.rank": 0,
        "generators.placement": "process", "generators.decode_chunk": 1, "generators.mps": False,
        "generators.learner_mps_percent": 0, "generators.mps_percent": 0,
    }  # fmt: skip
    # 4 x 2 rollouts a step of at most 8 tokens
    assert res["samples_per_s"] > 0  # (rounded to 1e-4: the ratio within 1e-3)
    assert 0 < res["tokens_per_s"] <= 8 * res["samples_per_s"] * (1 + 1e-3)
    assert res["train_tflops"] > 0 and res["train_s"] > 0
    # no card: the card's fractions are left out, not made up
    assert res["mfu"] is None and res["of_decode_bound"] is None and res["peak_gib"] is None
    assert res["training_alone_s"] > 0 and res["generation_alone_s"] > 0
    parts = max(res["training_alone_s"], res["generation_alone_s"])
    assert res["step_over_parts"] == pytest.approx(res["step_s"] / parts, rel=1e-2, abs=1e-3)
    assert res["delivery_s"] > 0 and res["delivery_gb_s"] > 0
