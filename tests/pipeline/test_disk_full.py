"""A learner whose run directory fills up (a real 12 MiB tmpfs, real learner and generator
processes) stops with one line naming the path and what it kept; nothing acknowledged is
lost; after the file system grows, `looprl learner --resume` continues to the last step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.commands.launcher import Generators
from pipeline.core.recorder import read_rollouts
from tests.pipeline.e2e_utils import SMALL, check_run, small_config, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
STEPS = 14


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount(disk, "12m"):
        pytest.skip("needs root and tmpfs mounts (mount -t tmpfs)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_full_disk_stops_in_one_line_and_resume_continues(small_disk: Path, tmp_path: Path) -> None:
    run_dir = small_disk / "run"
    overrides = [f"run_dir={run_dir}", *SMALL, f"steps={STEPS}", "checkpoint.every=2",
                 "publish.keep=0", "generators.count=1"]  # fmt: skip
    cfg = small_config(run_dir, f"steps={STEPS}", "checkpoint.every=2", "publish.keep=0",
                       "generators.count=1")  # fmt: skip
    cmd = [sys.executable, "-m", "pipeline.cli", "learner"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "learner.out"  # off the small disk
    gens = Generators(cfg)
    learner = None
    try:
        with open(out, "wb") as log:
            learner = subprocess.Popen([*cmd, *overrides], stdout=log, stderr=subprocess.PIPE,
                                       env=env)  # fmt: skip
            assert wait_until(lambda: (run_dir / "endpoints.json").is_file(), 180)
            ep = json.loads((run_dir / "endpoints.json").read_text())
            gens.start(ep["control"], ep["weights"], run_dir / "init")
            _, err = learner.communicate(timeout=480)
        stderr = err.decode(errors="replace")
        assert learner.returncode == 1, stderr[-4000:]
        assert "Traceback" not in stderr, stderr[-4000:]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("looprl learner: error:")]
        assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr[-4000:]
        line = errors[0]
        assert "no space left on device writing " in line and str(run_dir) in line, line
        assert "kept: checkpoint " in line and f"stream {run_dir / 'stream'} with " in line, line
        assert f"`looprl learner --resume {run_dir}`" in line, line
        before = [r.rollout_id for _, r in read_rollouts(run_dir / "stream")]
        rows_before = len((run_dir / "steps.jsonl").read_text().splitlines())
        assert 1 <= rows_before < STEPS and before

        remount = ["mount", "-o", "remount,size=128m", str(small_disk)]
        assert subprocess.run(remount, capture_output=True).returncode == 0
        # Fresh generators for the resumed learner: one that kept running may already serve
        # a version newer than the checkpoint, which the resumed learner publishes again
        # (a resume issue of its own, not the disk's: see docs/PERFORMANCE.md, Reliability).
        gens.stop()
        gens = Generators(cfg)
        hint = "learner: generators connect with"
        with open(out, "ab") as log:
            learner = subprocess.Popen([*cmd, "--resume", str(run_dir)], stdout=log,
                                       stderr=subprocess.STDOUT, env=env)  # fmt: skip
            assert wait_until(lambda: out.read_text(errors="replace").count(hint) >= 2, 240)
            gens.start(ep["control"], ep["weights"], run_dir / "init")
            assert learner.wait(timeout=480) == 0, out.read_text(errors="replace")[-4000:]
    finally:
        if learner is not None and learner.poll() is None:
            learner.kill()
            learner.wait()
        gens.stop()
    after = [r.rollout_id for _, r in read_rollouts(run_dir / "stream")]
    assert after[: len(before)] == before  # every rollout recorded (acknowledged) is kept
    check_run(run_dir, 4, STEPS, max_staleness=None)
    assert "resumed from" in out.read_text(errors="replace")
