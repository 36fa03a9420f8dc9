"""A megatron learner whose disk fills while it writes a checkpoint (a real 5 MiB tmpfs as
RUN_DIR, real `looprl learner` / `looprl run` processes, a generator over ZMQ) stops with exit 1
and one line naming the checkpoint, the cause and what to do, no traceback; the partial
checkpoint is removed and never taken; every acknowledged rollout is in the stream; after the
file system grows, `looprl learner --resume` continues from the checkpoint before to the last
step. Needs root (tmpfs mounts) and skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.recorder import read_rollouts, read_steps
from tests.cli.test_learner_quiet import ENV, REPO, SETTINGS, fake_generator
from tests.pipeline.e2e_utils import check_run

pytestmark = [pytest.mark.megatron]
STEPS = 4
# Tiny llama: RUN_DIR/init ~0.6 MB, a published version ~0.56 MB, a checkpoint (model and Adam
# state) ~2.4 MB. 6 MiB holds init, the versions kept (publish.keep=2, a third while the next is
# written; each written before the next step: publish.max_pending=0), the stream and the
# checkpoint of step 2 (~4.7 MB at most), but not the checkpoint of step 4 beside it (~6.5 MB).
# keep=2: the generator has loaded v1 before v3 exists (step 3 trains v1's rollouts).
SIZE = "6m"
RUN = [s for s in SETTINGS if not s.startswith(("steps=", "checkpoint.every="))] + [
    f"steps={STEPS}", "checkpoint.every=2", "publish.keep=2", "publish.max_pending=0",
    "metrics.progress=false",
]  # fmt: skip


def _mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount(disk, f"size={SIZE}"):
        pytest.skip("needs root and tmpfs mounts (mount -t tmpfs)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _looprl(run_dir: Path, logs: Path, *args: str) -> tuple[int, str]:
    """`looprl ARGS` as a process, with a fake generator (tests/cli/test_learner_quiet) once
    RUN_DIR/endpoints.json is written; (exit code, stderr). Output goes to ``logs`` (off the
    small disk); the process is stopped by its pid if it outlives the deadline."""
    err_file = logs / f"err-{time.monotonic_ns()}.txt"
    cmd = [sys.executable, "-m", "pipeline.cli", *args]
    with open(logs / "out.txt", "a") as o, open(err_file, "w") as e:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=o, stderr=e)
    stop = threading.Event()
    gen: threading.Thread | None = None
    ep_file = run_dir / "endpoints.json"
    started = ep_file.stat().st_mtime_ns if ep_file.is_file() else None  # a resume rewrites it
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if gen is None and ep_file.is_file() and ep_file.stat().st_mtime_ns != started:
                eps = json.loads(ep_file.read_text())
                gen = threading.Thread(target=fake_generator, daemon=True,
                                       args=(eps["control"], eps["weights"], stop,
                                             run_dir / "init"))  # fmt: skip
                gen.start()
            time.sleep(0.1)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()  # by its pid
            proc.wait()
        stop.set()
        if gen is not None:
            gen.join(10)
    return code, err_file.read_text()


def _one_stop_line(stderr: str, command: str, run_dir: Path) -> str:
    """The one line the stop ends in (asserted: no traceback, no other error line)."""
    assert "Traceback" not in stderr, stderr[-4000:]
    full = [ln for ln in stderr.splitlines() if "No space left" in ln]
    assert len(full) == 1, stderr[-4000:]
    line = full[0]
    assert stderr.rstrip().endswith(line) and line.startswith(f"looprl {command}: error: ")
    assert not [ln for ln in stderr.splitlines() if " ERROR " in ln], stderr[-4000:]
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert f"no space left on device writing checkpoint {ckpt} ([Errno 28] No space left on " \
           "device; 0 of " in line, line  # fmt: skip
    assert "the partial checkpoint was removed, a resume never takes it" in line, line
    assert f"kept: checkpoint {run_dir / 'checkpoints' / 'step_00000002'}, " in line, line
    assert f"stream {run_dir / 'stream'} with " in line, line
    assert f"free space, then `looprl learner --resume {run_dir}` continues" in line, line
    return line


def test_full_disk_in_a_checkpoint_stops_in_one_line_and_resume_continues(
    small_disk: Path, tmp_path: Path
) -> None:
    from learner import checkpoint

    run_dir = small_disk / "run"
    code, err = _looprl(run_dir, tmp_path, "learner", *RUN, f"run_dir={run_dir}")
    assert code == 1, err[-4000:]
    _one_stop_line(err, "learner", run_dir)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]  # the partial is gone
    assert checkpoint.latest(run_dir) == ckpts / "step_00000002"
    before = [r.rollout_id for _, r in read_rollouts(run_dir / "stream")]
    trained = [s.rollout_ids for s in read_steps(run_dir / "steps.jsonl")]
    assert len(trained) == STEPS and {i for t in trained for i in t} <= set(before)

    remount = ["mount", "-o", "remount,size=64m", str(small_disk)]
    assert subprocess.run(remount, capture_output=True).returncode == 0
    code, err = _looprl(run_dir, tmp_path, "learner", "--resume", str(run_dir))
    assert code == 0, err[-4000:]
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in err, err[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    assert checkpoint.latest(run_dir) == ckpts / f"step_{STEPS:08d}"
    after = [r.rollout_id for _, r in read_rollouts(run_dir / "stream")]
    assert after[: len(before)] == before  # every rollout recorded (acknowledged) is kept
    check_run(run_dir, 2, STEPS, max_staleness=None)


def test_looprl_run_stops_in_the_same_line(small_disk: Path, tmp_path: Path) -> None:
    """`looprl run` (external generators: generators.count=0) ends in the same one line."""
    run_dir = small_disk / "run"
    code, err = _looprl(run_dir, tmp_path, "run", *RUN, f"run_dir={run_dir}",
                        "generators.count=0")  # fmt: skip
    assert code == 1, err[-4000:]
    _one_stop_line(err, "run", run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
