"""`looprl run` on an ordinary Llama (the depth-1 case, served by vLLM's own Llama class), as a
user runs it: one process, which starts the learner and its `looprl generator` processes.

- `looprl run model.path=<the checkpoint `looprl model init --family llama --size tiny`
  writes>` trains (every weight version loads into vLLM's Llama) and the reward rises;
- generators that cannot load the learner's weights (they serve a Llama of another shape, so
  v1 does not fit their model) exit at once with one line, and the run fails fast with one
  line naming why, instead of waiting out max_wait_s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from models.random_init import init_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# the repo first, then what the caller's PYTHONPATH held (the device host's wheels: gpu_check.sh)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
ENV.pop("LOOPRL_VERBOSE", None)
QUIET = ["metrics.progress=false", "metrics.plot=false", "metrics.tensorboard=false",
         "checkpoint.every=0"]  # fmt: skip


def looprl_run(run_dir: Path, *overrides: str, timeout_s: float,
               config: Path | None = None) -> tuple[int, str, float]:  # fmt: skip
    """`looprl run [--config CONFIG]` as a process; returns (exit code, stderr, wall seconds).
    Past ``timeout_s`` it gets SIGTERM (it stops its generators by pid), then SIGKILL, and the
    code is None."""
    err = run_dir.parent / f"{run_dir.name}.err"
    cfg = [] if config is None else ["--config", str(config)]
    cmd = [sys.executable, "-m", "pipeline.cli", "run", *cfg, f"run_dir={run_dir}", *QUIET,
           *overrides]  # fmt: skip
    t0 = time.monotonic()
    with open(err, "w") as e:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=e)
    try:
        code: Any = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        code = None
    return code, err.read_text(), time.monotonic() - t0


def llama_of_another_shape(out: Path, base: Path) -> Path:
    """``base`` (a tiny Llama) with intermediate_size 192 instead of 128: its MLPs padded with
    64 zero units (gate and up rows, down columns), so it computes what ``base`` computes
    (silu(0) * 0 = 0; the learner's check of the generators' claimed log-probs passes) but
    cannot load ``base``'s shapes."""
    from models.checkpoint import load_checkpoint, save_checkpoint

    cfg, state = load_checkpoint(base)
    pad = 192 - int(cfg["intermediate_size"])
    for k, v in list(state.items()):
        if k.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            state[k] = torch.cat([v, v.new_zeros(pad, v.shape[1])], 0)
        elif k.endswith("mlp.down_proj.weight"):
            state[k] = torch.cat([v, v.new_zeros(v.shape[0], pad)], 1)
    cfg["intermediate_size"] = 192
    extra = {f.name: f for f in base.iterdir()
             if f.is_file() and f.name != "config.json" and ".safetensors" not in f.name}  # fmt: skip
    save_checkpoint(state, cfg, out, extra_files=extra)
    return out


def test_run_trains_a_llama_through_vllm(tmp_path: Path) -> None:
    """The quickstart's job (GRPO, 16 prompts x 8 samples, the count-on task) on the tiny
    Llama, 30 steps, one generator: the mean reward of the last 5 steps rises from ~0.005 to
    above 0.15 (measured, three runs: 0.005 -> 0.206, 0.203, 0.203; 110-146 s of wall time on
    the 2 cores while other jobs kept the load at 5-11). Every metrics row carries the per-step
    timeline (pipeline.core.timeline: train, publish stages, delivery, generation, reward,
    intake, the trainer's wait), consistent with the step's wall time. Publication runs
    beside the next step (publish.max_pending 1): each row has its snapshot (gather + copy,
    on the critical path) and the hash + write of the versions announced since the last row."""
    model = init_checkpoint("llama", "tiny", tmp_path / "llama")
    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(
        run_dir, f"model.path={model}", "steps=30", "generators.count=1", timeout_s=400
    )
    assert code == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    print(f"\nllama run: {s['steps']} steps in {wall:.0f} s, reward {s['reward_first']:.3f} -> "
          f"{s['reward_last']:.3f}")  # fmt: skip
    assert s["steps"] == 30 and s["final_version"] == 30
    assert s["reward_first"] < 0.02 and s["reward_last"] > 0.15, s
    assert (s["counts"]["publisher"].get("nacked", 0)) == 0, s["counts"]["publisher"]
    # the per-step timeline (pipeline.core.timeline): every row says where its time went
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    announced = 0
    for r in rows:
        t = {k: v for k, v in r.items() if k.startswith("time/")}
        assert t["time/train"] == r["train_s"] and t["time/train"] > 0, t
        assert t["time/publish_snapshot"] > t["time/publish_gather"] > 0, t
        assert t["time/publish_room_wait"] >= 0, t
        if "time/publish" in t:  # versions of earlier steps hashed, written, announced
            announced += 1
            assert t["time/publish"] > 0 and t["time/publish_announce"] > 0, t
            assert t["time/publish_lag"] >= t["time/publish"], t
        assert t["time/generation"] > 0 and t["time/reward"] > 0 and t["time/queue"] >= 0, t
        assert t["time/dispatch_wait"] >= 0 and t["time/intake"] >= 0, t
        if r["step"] > 1:  # completion to completion: the wait, the step, its snapshot
            busy = (t["time/dispatch_wait"] + t["time/train"] + t["time/publish_snapshot"]
                    + t["time/publish_room_wait"])  # fmt: skip
            assert busy <= r["step_s"] + 0.05, (busy, r["step_s"], t)
    assert announced >= len(rows) - 2, announced  # (the last version: after the last row)
    assert sum(r["time/intake"] for r in rows) > 0
    delivered = [r["time/weight_delivery"] for r in rows if "time/weight_delivery" in r]
    assert len(delivered) >= len(rows) // 2 and min(delivered) > 0, delivered


def test_generators_that_cannot_load_the_weights_fail_the_run_fast(tmp_path: Path) -> None:
    """Both generators serve a Llama of another shape: they answer v0's work, then v1 (the
    learner's shapes) fails in their model's loader. Each exits 1 with one line, and `looprl
    run` exits 1 within seconds of that, not after max_wait_s (600 s; the old behaviour)."""
    model = init_checkpoint("llama", "tiny", tmp_path / "llama")
    other = llama_of_another_shape(tmp_path / "other", model)
    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(
        run_dir,
        f"model.path={model}",
        "steps=20",
        "generators.count=2",
        f"generators.extra_args=[--model,{other}]",
        "max_wait_s=600",
        timeout_s=240,
    )
    print(f"\nrun with unloadable weights: exit {code} after {wall:.0f} s")
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("looprl run: error:")]
    assert len(errors) == 1, err[-3000:]
    assert "every generator exited (codes gen0=1, gen1=1) after " in errors[0]
    # the first version a generator is handed: v1, or v2 when it joined after the learner
    # stepped again on the other's v0 rollouts (a slow start on a loaded host)
    assert re.search(r"cannot serve weights v[12]: the model's weight loader failed", errors[0])
    for i in range(2):
        log = (run_dir / "logs" / f"gen{i}.log").read_text()
        stopped = [line for line in log.splitlines() if f"generator gen{i} stopped:" in line]
        assert len(stopped) == 1 and re.search(r"cannot serve weights v[12]", stopped[0]), log[
            -3000:
        ]
    assert wall < 200
