"""kill -9 of a real learner at three points, each followed by `looprl learner --resume`, with
the same two real `looprl generator` processes (vLLM, tiny Huginn) kept running throughout:
every sample accepted before a kill is trained (that copy, or the copy generated again when
the staleness rule forbids it), per work item; metrics.jsonl has one row per step; weights/
keeps publish.keep directories; no generator is offered a version it already serves.

The kill points are pipeline.core.faults (``LOOPRL_KILL_AT``): a real SIGKILL of the learner
process at an exact place, so the test is deterministic.

Runtime: one vLLM start for the generators and four learner lives (~10 s of imports each):
about 100 s on 2 shared cores (374 s measured at a load average of 20-30). It replaces no other run because the thing tested is four
process lives of one run directory; the other e2e runs are one life each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import pytest

from pipeline.commands.launcher import Generators
from pipeline.core.recorder import read_rollouts, read_steps
from tests.pipeline.e2e_utils import SMALL, check_run, small_config, wait_until

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


def _life(cmd: list[str], env: dict[str, str], log: object, kill_at: str | None) -> int:
    e = dict(env)
    if kill_at is not None:
        e["LOOPRL_KILL_AT"] = kill_at
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e)  # type: ignore[arg-type]
    try:
        return p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        # nothing the learner started may outlive it
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()


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
                if i == 0:  # the generators start once, on the first life's endpoints
                    proc = subprocess.Popen(  # noqa: S603
                        [*cmd], stdout=log, stderr=subprocess.STDOUT,
                        env={**env, "LOOPRL_KILL_AT": point},
                    )  # fmt: skip
                    try:
                        assert wait_until(lambda: (tmp_path / "endpoints.json").is_file(), 120)
                        ep = json.loads((tmp_path / "endpoints.json").read_text())
                        gens.start(ep["control"], ep["weights"], tmp_path / "init")
                        rc = proc.wait(timeout=300)
                    finally:
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait()
                else:
                    rc = _life(cmd, env, log, point)
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
