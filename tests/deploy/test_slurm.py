"""deploy/slurm/looprl.sbatch on a real Slurm (slurmctld + four slurmd on this host, made and
stopped by `scripts/slurm_cluster.sh`): the file as users submit it, CPU-only through its
GPUS_PER_NODE=0 mode, runs the learner on node 0 and one generator on each of nodes 1 and 2;
the reward of the quickstart task rises across a cancelled generator step and a time-limit
stop followed by a resubmission, which a generator array job (deploy/slurm/generators.sbatch,
on node 3) joins late (see the test's docstring).

About 4-5 minutes on an idle 2-core host (one learner and two vLLM generators per job life:
the real processes the file starts). Needs root, slurm-wlm and munge: scripts/setup.sh
installs them."""

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
from pipeline.core.recorder import read_rollouts, read_steps

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
SBATCH = REPO / "deploy" / "slurm" / "looprl.sbatch"
ARRAY = REPO / "deploy" / "slurm" / "generators.sbatch"
POLL_S = 0.25  # the test's look at the jobs and metrics.jsonl
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


def _accepted(run_dir: Path) -> set[tuple[str, int]]:
    return {(r.work_id, r.sample_index) for _, r in read_rollouts(run_dir / "stream")}


def _trained(run_dir: Path) -> set[tuple[str, int]]:
    out = set()
    for st in read_steps(run_dir / "steps.jsonl"):
        for rid in st.rollout_ids:
            w, _, i = rid.rpartition("/")
            out.add((w, int(i)))
    return out


def test_sbatch_trains_survives_a_cancelled_step_and_resumes_after_the_time_limit(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """One run, two job lives. Life 1: both generator steps serve; at step 8 node 2's step is
    cancelled (SIGKILL), node 1's carries on; at step 16 the batch shell gets the SIGTERM
    the time limit's ``--signal=B:TERM@300`` sends (``scancel --signal=TERM --batch``): the
    learner checkpoints and stops, the job completes. Life 2: the same command again resumes
    from the checkpoint with both nodes' generators and finishes; every sample accepted in
    life 1 was trained (that copy or its regenerated one), one metrics row per step. Life 2
    is joined late by a generator array job (deploy/slurm/generators.sbatch, 2 tasks on the
    fourth node): their keys are made after the learner started and admitted; they serve
    rollouts that are trained, and stop cleanly on scancel."""
    # 30 steps left life 2 only 14: on a loaded host (the full suite) the array's generators
    # started ~17 s before the nodes' and served all 14 before the nodes' engines were up
    run_dir, steps = tmp_path / "run", 44
    # CURVE keys and a non-loopback address, as on a cluster (no CURVE on loopback by default)
    addr = socket.gethostbyname(connect_host("0.0.0.0")[0])
    if addr.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address for the generators to reach")
    export = ",".join([
        "ALL", "GPUS_PER_NODE=0", f"LEARNER_ADDR={addr}", f"PORT={_free_port()}",
        f"RUN_DIR={run_dir}", f"VENV={sys.prefix}", "MAX_INFLIGHT=2", "KV_CACHE_MB=64",
        "MAX_MODEL_LEN=64",
    ])  # fmt: skip

    def life(n: int, on_step: dict[int, list[str]]) -> str:
        out = tmp_path / f"job{n}.out"
        sub = subprocess.run(
            ["sbatch", "--parsable", "--nodes=3", "--gpus-per-node=0", "--time=20",
             f"--output={out}", f"--export={export}", str(SBATCH), f"steps={steps}",
             "checkpoint.every=4"],
            env=slurm, cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        job, done, end = sub.stdout.strip().split(";")[0], set(), time.monotonic() + 900
        while _job_state(slurm, job) in {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
            assert time.monotonic() < end, f"job {job} still running; {out}"
            rows = len(_metrics(run_dir))
            for at, action in on_step.items():
                if at not in done and rows >= at:
                    done.add(at)
                    if action == ["array"]:  # joins the running job late
                        array.append(subprocess.run(
                            ["sbatch", "--parsable", "--array=0-1", "--gpus-per-task=0",
                             "--nodelist=n3", f"--output={tmp_path}/array-%a.out",
                             f"--export={export}", str(ARRAY)],
                            env=slurm, cwd=REPO, capture_output=True, text=True, check=True,
                        ).stdout.strip().split(";")[0])  # fmt: skip
                    elif action == ["cancel n2"]:
                        on_n2 = [s for s, nodes in _steps(slurm, job).items() if nodes == "n2"]
                        assert len(on_n2) == 1, _steps(slurm, job)
                        subprocess.run(["scancel", on_n2[0]], env=slurm, check=True)
                    else:
                        subprocess.run([*action, job], env=slurm, check=True)
            time.sleep(POLL_S)
        log = out.read_text()
        assert _job_state(slurm, job) == "COMPLETED", log
        assert "learner exited with 0" in log, log
        assert done == set(on_step), (done, log)
        return log

    life(1, {8: ["cancel n2"], 16: ["scancel", "--signal=TERM", "--batch"]})
    first = _metrics(run_dir)
    assert 16 <= len(first) < steps, len(first)  # stopped early, by the signal
    assert max(r["generators"] for r in first[:8]) == 2 and first[-1]["generators"] == 1
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    accepted_life1 = _accepted(run_dir)

    array: list[str] = []
    life(2, {len(first): ["array"]})  # the same command: it finds the checkpoint and resumes
    subprocess.run(["scancel", array[0]], env=slurm, check=True)  # SIGTERM: hand back, stop
    end = time.monotonic() + 120
    while any(_job_state(slurm, f"{array[0]}_{i}") in {"PENDING", "RUNNING", "COMPLETING"}
              for i in (0, 1)):  # fmt: skip
        assert time.monotonic() < end, "the array generators did not stop"
        time.sleep(POLL_S)
    sent = {}
    for i in (0, 1):
        log = (tmp_path / f"array-{i}.out").read_text()
        name = f"array-{array[0]}-{i}"
        assert f"generator {name}" in log and "stopped cleanly" in log, log[-3000:]
        sent[name] = json.loads(log.split("stopped cleanly: ", 1)[1].splitlines()[0]
                                .replace("'", '"')).get("rollouts_sent", 0)  # fmt: skip
    by_gen = {r.generator_id: r for _, r in read_rollouts(run_dir / "stream")}
    trained_ids = {rid for st in read_steps(run_dir / "steps.jsonl") for rid in st.rollout_ids}
    late = [r for _, r in read_rollouts(run_dir / "stream") if r.generator_id.startswith("array-")]
    assert late and any(r.rollout_id in trained_ids for r in late), (sent, sorted(by_gen))
    assert sum(sent.values()) >= len(late) > 0, sent
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # one row per step
    assert rows[-1]["generators"] == 4  # both nodes again in life 2, and the array's two
    lost = sorted(accepted_life1 - _trained(run_dir))
    assert not lost, f"{len(lost)} samples accepted in life 1 never trained: {lost[:8]}"
    r0 = sum(r["reward_mean"] for r in rows[:5]) / 5
    r1 = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert r1 > max(10 * r0, 0.05), (r0, r1)
