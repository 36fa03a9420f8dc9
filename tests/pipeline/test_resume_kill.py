"""kill -9 of a real learner at three points, each followed by `looprl learner --resume`, with
the same two real `looprl generator` processes (vLLM, tiny Huginn) kept running throughout:
every sample accepted before a kill is trained (that copy, or the copy generated again when
the staleness rule forbids it), per work item; metrics.jsonl has one row per step; weights/
keeps publish.keep directories; no generator is offered a version it already serves.

The kill points are pipeline.core.faults (``LOOPRL_KILL_AT``): a real SIGKILL of the learner
process at an exact place, so the test is deterministic.

It also holds what tests/pipeline/test_e2e.py's kill-and-resume run checked (that run is gone):
nothing a learner started outlives it (its children are watched while it runs), the
generators reconnect by themselves, config.yaml is the run's across the resumes.

Runtime: one vLLM start for the generators and four learner lives (~10 s of imports each):
about 100 s on 2 shared cores (374 s measured at a load average of 20-30). It replaces no other run because the thing tested is four
process lives of one run directory; the other e2e runs are one life each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from pipeline.commands.launcher import Generators
from pipeline.config.run import to_yaml
from pipeline.core.recorder import read_rollouts, read_steps
from tests.pipeline.e2e_utils import SMALL, check_run, small_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 10
OVERRIDES = [f"steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=3",
             "staleness.max_staleness=1", "publish.keep=3"]  # fmt: skip
# mid-step 3 (checkpoint of step 2 kept); v5 written and in digests.jsonl, never announced;
# mid-checkpoint of step 6 (the step-4 checkpoint is the newest complete one)
KILLS = ["step:3", "announce:5", "checkpoint:6"]


def _accepted(run_dir: Path) -> dict[tuple[str, int], int]:
    """(work id, sample index) -> times recorded in the stream (accepted) so far."""
    return Counter((r.work_id, r.sample_index) for _, r in read_rollouts(run_dir / "stream"))


def _life(cmd: list[str], env: dict[str, str], log: object, kill_at: str | None,
          while_running: Callable[[], None] = lambda: None) -> int:  # fmt: skip
    """Run one learner life to its end (``while_running`` is called every half second);
    returns its exit code. Nothing it started may outlive it: its children, watched while it
    runs (megatron's checkpoint writer once left a ~300 MB Manager process behind a kill -9),
    must be gone within 30 s of its end; a survivor is stopped by pid, then the test fails."""
    e = dict(env)
    if kill_at is not None:
        e["LOOPRL_KILL_AT"] = kill_at
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e)  # type: ignore[arg-type]
    seen: dict[int, psutil.Process] = {}
    end = time.monotonic() + 300
    try:
        while p.poll() is None:
            assert time.monotonic() < end, f"learner life ({kill_at}) still running after 300 s"
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(p.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            while_running()
            time.sleep(0.5)
        return p.returncode
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        assert not alive, f"children outlived the learner ({kill_at}): {[c.pid for c in alive]}"


def test_learner_killed_at_three_points_loses_no_accepted_sample(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, *OVERRIDES)
    base = [sys.executable, "-m", "pipeline.cli", "learner"]
    first = [*base, f"run_dir={tmp_path}", *SMALL, *OVERRIDES]
    again = [*base, "--resume", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gens = Generators(cfg)
    before_kill: set[tuple[str, int]] = set()
    with open(tmp_path / "learner.log", "ab") as log:
        try:
            for i, point in enumerate(KILLS):
                cmd = first if i == 0 else again

                def start_generators() -> None:  # once, on the first life's endpoints
                    ep_file = tmp_path / "endpoints.json"
                    if not gens.procs and ep_file.is_file():
                        ep = json.loads(ep_file.read_text())
                        gens.start(ep["control"], ep["weights"], tmp_path / "init")

                rc = _life(cmd, env, log, point, start_generators if i == 0 else lambda: None)
                assert gens.procs, "the first life never bound its endpoints"
                assert rc == -signal.SIGKILL, f"life {i + 1} ({point}) ended with {rc}"
                before_kill |= set(_accepted(tmp_path))
                if point.startswith("checkpoint"):  # killed mid-write: only the temp dir
                    n = int(point.partition(":")[2])
                    ckpts = tmp_path / "checkpoints"
                    assert not (ckpts / f"step_{n:08d}").exists()
                    assert (ckpts / f".tmp-step_{n:08d}").is_dir()
                if point.startswith("announce"):  # the number is used, never announced
                    v = int(point.partition(":")[2])
                    digests = (tmp_path / "weights" / "digests.jsonl").read_text()
                    assert json.loads(digests.splitlines()[-1])["version"] == v
            assert _life(again, env, log, None) == 0
        finally:
            gens.stop()
    check_run(tmp_path, 4, STEPS, max_staleness=1)
    # the resumes kept the run's, learner.threads auto resolved once (OMP_NUM_THREADS=1: 1)
    run_cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, threads=1))
    assert (tmp_path / "config.yaml").read_text() == to_yaml(run_cfg)
    # per work item: every sample accepted before a kill was trained (that copy or its
    # regenerated copy); a sample accepted only in the last life may still be buffered
    trained: dict[str, set[int]] = defaultdict(set)
    for s in read_steps(tmp_path / "steps.jsonl"):
        for rid in s.rollout_ids:
            w, _, i = rid.rpartition("/")
            trained[w].add(int(i))
    lost = sorted((w, i) for w, i in before_kill if i not in trained.get(w, set()))
    accepted_items = {w for w, _ in before_kill}
    assert not lost, (
        f"{len(lost)} samples of {len({w for w, _ in lost})} work items accepted before a kill "
        f"were never trained (of {len(before_kill)} in {len(accepted_items)}): {lost[:8]}"
    )
    # one metrics row per step, also across the resumes
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps
    # pruning covers the directories the killed lives left
    vdirs = sorted(p.name for p in (tmp_path / "weights").glob("v*") if p.is_dir())
    assert len(vdirs) <= 3, vdirs
    # no generator was offered a version it already serves
    for g in sorted((tmp_path / "logs").glob("gen*.log")):
        text = g.read_text(errors="replace")
        assert "is not newer than" not in text, f"{g.name}: {text[-2000:]}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["counts"]["intake"].get("rollouts_dropped_stale", 0) == 0
    # the generators still serving an earlier life's version are honest: the last life
    # accepts their claims (before: "v16 was never delivered to it (delivered: [])")
    assert summary["counts"]["intake"].get("claims_refused", 0) == 0, summary["counts"]
    assert summary["counts"]["banned"] == {}, summary["counts"]["banned"]
