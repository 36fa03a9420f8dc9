"""Helpers for the end-to-end tests: a real learner (in this process, megatron backend) and
real `looprl generator` processes (vLLM on CPU) over ZMQ on loopback."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.commands.launcher import Generators
from pipeline.commands.learner_main import run_learner
from pipeline.config.run import RunConfig, load_config
from pipeline.core.metrics import read_metrics
from pipeline.core.recorder import read_rollouts, read_steps

SMALL = [
    "rollout.n=4", "rollout.max_tokens=8", "rollout.prompts_per_step=2", "task.num_prompts=16",
    "generators.count=2", "generators.max_inflight=2", "transport.peer_timeout_s=4",
    "transport.heartbeat_interval_s=0.5", "metrics.progress=false", "metrics.tensorboard=false",
    "metrics.plot=false", "checkpoint.every=0", "backend=megatron", "max_wait_s=240",
]  # fmt: skip


def small_config(run_dir: Path, *overrides: str) -> RunConfig:
    return load_config(None, [f"run_dir={run_dir}", *SMALL, *overrides])


def run(cfg: RunConfig, hook: Callable[[int, Generators], None] | None = None) -> dict[str, Any]:
    """Learner here + generator processes; ``hook(steps_done, gens)`` runs every loop turn."""
    gens = Generators(cfg)
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    state = {"size": -1, "steps": 0}

    def stop() -> bool:
        if hook is not None:
            size = metrics.stat().st_size if metrics.exists() else 0
            if size != state["size"]:
                state["size"] = size
                state["steps"] = len(metrics.read_text().splitlines()) if size else 0
            hook(state["steps"], gens)
        return gens.all_dead()

    try:
        return run_learner(cfg, on_bound=gens.start, stop=stop)
    finally:
        gens.stop()


def welcomed(gens: Generators, i: int) -> bool:
    """Generator ``i``'s log says the learner admitted it."""
    log = gens.logs / f"gen{i}.log"
    return log.exists() and "welcomed by run" in log.read_text(errors="replace")


def kill9(gens: Generators, i: int) -> None:
    os.kill(gens.procs[i].pid, signal.SIGKILL)
    gens.procs[i].wait()


def check_run(run_dir: Path, n: int, steps: int, max_staleness: int | None) -> list[dict]:
    """The invariants every run must satisfy, read from its files."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    recorded = [r for _, r in read_rollouts(run_dir / "stream")]
    ids = [r.rollout_id for r in recorded]
    voided = Path(run_dir / "voided.jsonl")  # copies a resume voided: generated again
    again = Counter(json.loads(x)["rollout_id"] for x in voided.read_text().splitlines()) if voided.is_file() else Counter()  # fmt: skip
    twice = Counter(ids) - Counter(set(ids))
    assert not twice - again, (
        f"rollouts recorded twice without a resume voiding them: {twice - again}"
    )
    pairs = Counter((r.work_id, r.sample_index) for r in recorded)
    assert max(pairs.values()) <= 1 + max(again.values(), default=0), "a sample was accepted twice"
    trained = [rid for s in read_steps(run_dir / "steps.jsonl") for rid in s.rollout_ids]
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    assert set(trained) <= set(ids), "a trained rollout is missing from the stream"
    groups = Counter(rid.rpartition("/")[0] for rid in trained)
    assert set(groups.values()) == {n}, "an incomplete group was trained"
    if max_staleness is not None:
        assert max(r["staleness_max"] for r in rows) <= max_staleness
    digests = [
        json.loads(x) for x in (run_dir / "weights" / "digests.jsonl").read_text().splitlines()
    ]
    assert [d["version"] for d in digests] == list(range(1, len(digests) + 1))
    assert all(d["digest_kind"] == "sha256-tree" and d["digest_chunk_bytes"] > 0 for d in digests)
    return rows


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False
