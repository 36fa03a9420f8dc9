"""benchmarks/learner_process.py --device cpu --tiny: the real `looprl learner` process fed over
ZMQ by a simulated generator process, in the GPU mode's configuration (bf16 learner and
checkpoint, claims replayed once with the starting weights, the learner killed after its last
timed row), prints one JSON line whose figures agree with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "effective_tokens_per_s", "mfu", "busy_fraction", "versions_per_step", "publish_s",
    "publish_bytes", "digest_gb_s", "intake_rollouts_per_s", "intake_capacity_rollouts_per_s",
    "peak_mem_gib", "peak_rss_gib", "losses", "grad_norms", "health", "logprob_mismatch_max",
    "logprob_mismatch_fresh_max", "refused_total", "meets_busy_target", "real_tokens",
    "window_wall_s", "dispatch_wait_s",
}  # fmt: skip


def test_learner_process_benchmark_cpu_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "benchmarks/learner_process.py", "--device", "cpu", "--tiny",
           "--precision", "bf16", "--claims", "first", "--kill", "--lr", "1e-6",
           "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= set(res), KEYS - set(res)
    assert res["ok"] and res["learner_killed"] and res["device"] == "cpu"
    # 1 warm-up + 2 timed steps of 1 prompt x 2 samples, responses of 2..6 tokens after 4
    assert res["steps_done"] >= 3 and res["rollouts_per_step"] == 2
    assert 2 * 2 * (4 + 2 - 1) <= res["real_tokens"] <= 2 * 2 * (4 + 6 - 1)
    wall = res["window_wall_s"]  # the rates are rounded to 0.1 and 1e-3
    assert res["effective_tokens_per_s"] == pytest.approx(
        res["real_tokens"] / wall, rel=1e-4, abs=0.06
    )
    assert res["intake_rollouts_per_s"] == pytest.approx(4 / wall, rel=1e-4, abs=6e-4)
    assert 0.0 < res["busy_fraction"] <= 1.0 and res["mfu"] >= 0.0
    assert res["versions_per_step"] == 1.0  # one version published per step
    stages = res["publish_s"]
    for stage in ("snapshot", "room_wait", "blob", "digest", "write", "total", "lag", "announce"):
        assert stages[stage] >= 0.0, stages
    assert stages["total"] >= stages["digest"] and res["digest_gb_s"] > 0
    # bf16 weights of every parameter (and Huginn's fp32 RoPE table) are published
    assert res["publish_bytes"] >= 2 * res["shape"]["params"]
    assert res["peak_mem_gib"] is None and res["peak_rss_gib"] > 0.1  # no CUDA here
    assert len(res["losses"]) == len(res["grad_norms"]) == res["steps_done"]
    assert res["health"]["verdict"] == "ok", res
    # honest claims: none refused; the fresh ones within the bf16 bound (5 nats)
    assert res["refused_total"] == 0 and res["logprob_mismatch_fresh_max"] < 5.0
