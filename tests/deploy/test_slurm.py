"""deploy/slurm/looprl.sbatch on a real Slurm (slurmctld + three slurmd on this host, made and
stopped by `scripts/slurm_cluster.sh`): the file as users submit it, CPU-only through its
GPUS_PER_NODE=0 mode, runs the learner on node 0 and one generator on each of nodes 1 and 2,
and the reward of the quickstart task rises. Mid-run, node 2's generator step is cancelled
(`scancel JOB.STEP`): the run carries on with the other one and finishes.

About 3-4 minutes on an idle 2-core host (one learner and two vLLM generators: the real
processes the file starts). Needs root, slurm-wlm and munge: scripts/setup.sh installs them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.commands.learner_main import connect_host

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
SBATCH = REPO / "deploy" / "slurm" / "looprl.sbatch"
HAVE_SLURM = shutil.which("slurmctld", path="/usr/sbin:/usr/bin") and os.geteuid() == 0
pytestmark = pytest.mark.skipif(
    not HAVE_SLURM, reason="needs root, slurm-wlm and munge (scripts/setup.sh installs them)"
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    state = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(CLUSTER), "start", str(state)], check=True, timeout=120)
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, check=False)
        for _ in range(240):  # the job's processes end (a learner checkpoints on SIGTERM)
            q = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True)
            if not q.stdout.strip():
                break
            time.sleep(0.5)
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], check=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) // 2 * 2  # the file binds PORT and PORT + 1


def _job_state(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True).stdout  # fmt: skip
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")


def _steps(env: dict[str, str], job: str) -> dict[str, str]:
    """step id -> node list of the job's running steps."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %N"], env=env,
                         capture_output=True, text=True).stdout  # fmt: skip
    return dict(line.split() for line in out.splitlines() if line.strip())


def _metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def test_the_sbatch_file_trains_and_survives_a_cancelled_generator_step(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    run_dir, steps = tmp_path / "run", 30
    # CURVE keys and a non-loopback address, as on a cluster (no CURVE on loopback by default)
    addr = socket.gethostbyname(connect_host("0.0.0.0")[0])
    if addr.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address for the generators to reach")
    export = ",".join([
        "ALL", "GPUS_PER_NODE=0", f"LEARNER_ADDR={addr}", f"PORT={_free_port()}",
        f"RUN_DIR={run_dir}", f"VENV={sys.prefix}", "MAX_INFLIGHT=2", "KV_CACHE_MB=64",
        "MAX_MODEL_LEN=64",
    ])  # fmt: skip
    sub = subprocess.run(
        ["sbatch", "--parsable", "--nodes=3", "--gpus-per-node=0", "--time=20",
         f"--output={tmp_path}/job.out", f"--export={export}", str(SBATCH), f"steps={steps}",
         "checkpoint.every=0"],
        env=slurm, cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = sub.stdout.strip().split(";")[0]
    cancelled, end = "", time.monotonic() + 900
    while _job_state(slurm, job) in {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
        assert time.monotonic() < end, f"job {job} still running; {tmp_path}/job.out"
        rows = _metrics(run_dir)
        if not cancelled and len(rows) >= 8:  # mid-run: cancel node 2's generator step
            on_n2 = [s for s, nodes in _steps(slurm, job).items() if nodes == "n2"]
            assert len(on_n2) == 1, _steps(slurm, job)
            cancelled = on_n2[0]
            subprocess.run(["scancel", cancelled], env=slurm, check=True)
            at_cancel = len(rows)
        time.sleep(1)
    log = (tmp_path / "job.out").read_text()
    assert _job_state(slurm, job) == "COMPLETED", log
    assert "learner exited with 0" in log, log
    rows = _metrics(run_dir)
    assert cancelled and [r["step"] for r in rows] == list(range(1, steps + 1)), log
    assert max(r["generators"] for r in rows[:at_cancel]) == 2  # both nodes' generators served
    assert rows[-1]["generators"] == 1  # node 2's left; node 1's carried the rest of the run
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > max(10 * first, 0.05), (first, last)
