"""`looprl learner` as a user runs it (a process, megatron backend, a generator over ZMQ):
the terminal holds no third-party warnings (they are in RUN_DIR/logs/learner.log), and
`--resume` of the finished run says so and leaves summary.json as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.net.transport.config import TransportConfig
from pipeline.net.transport.zmq import ZmqGeneratorConnection
from proto.records import Ack, Heartbeat, Hello, Rollout, RolloutBatch, WeightAnnounce, WorkItem

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
ENV.pop("LOOPRL_VERBOSE", None)
SETTINGS = [
    "backend=megatron", "model.family=llama", "steps=2", "rollout.n=2", "rollout.max_tokens=4",
    "rollout.prompts_per_step=1", "task.num_prompts=4", "metrics.plot=false",
    "metrics.tensorboard=false", "checkpoint.every=0", "max_wait_s=120",
]  # fmt: skip


def _honest(model: Any, rec: WorkItem, seed: int, tokens: list[int]) -> np.ndarray:
    """The log-probs a real generator would claim for ``tokens`` (models.reference replay of
    the weights it serves): the learner checks every claim before its update."""
    from models.reference import ReplayItem, replay

    item = ReplayItem(rec.prompt_tokens.tolist(), tokens, seed, [1] * len(tokens), 1)
    (r,) = replay(model, [item], temperature=rec.temperature, top_p=rec.top_p, numerics="fast")
    return r.logprobs.numpy().astype(np.float32)


def fake_generator(control: str, weights: str, stop: threading.Event, init: Path) -> None:
    """Answers every WorkItem with valid rollouts (2 tokens, full depth 1 of llama) whose
    log-probs are honest for the version it serves (RUN_DIR/init, then each announced one)."""
    from models.checkpoint import load_model

    tc = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=10.0)
    hello = Hello("fake0", "host", os.getpid(), ["llama"], 2, 0, time.time())
    conn = ZmqGeneratorConnection(tc, hello, control=control, weights=weights)
    version, model = 0, None
    try:
        while not stop.is_set():
            inc = conn.recv(0.05)
            if inc is None:
                continue
            rec = inc.record
            if isinstance(rec, WeightAnnounce):
                version, model = rec.version, load_model(Path(rec.path))[1]
                conn.send(Ack("weights", str(version), version), channel="weights")
                conn.send(Heartbeat("fake0", time.time(), version, 0))  # control too
            elif isinstance(rec, WorkItem):
                model = model if model is not None else load_model(init)[1]
                idx = rec.sample_indices or list(range(rec.n))
                rolls = [
                    Rollout(
                        rollout_id=f"{rec.work_id}/{i}",
                        work_id=rec.work_id,
                        prompt_id=rec.prompt_id,
                        sample_index=i,
                        generator_id="fake0",
                        latent_seed=int(seed),
                        prompt_tokens=rec.prompt_tokens,
                        tokens=np.array([5, 6], np.int32),
                        logprobs=_honest(model, rec, int(seed), [5, 6]),
                        exit_depths=np.ones(2, np.uint8),
                        weight_version=version,
                        reward=float(i % 2),
                    )  # fmt: skip
                    for i, seed in zip(idx, rec.latent_seeds)
                ]
                conn.send(RolloutBatch(rolls))
    finally:
        conn.close()


def learner(run_dir: Path, *args: str, serve: bool = True) -> tuple[int, str, str]:
    """Run `looprl learner ARGS` (with a fake generator once its endpoints are written when
    ``serve``); returns (code, stdout, stderr)."""
    out, err = run_dir.parent / "out.txt", run_dir.parent / "err.txt"
    cmd = [sys.executable, "-m", "pipeline.cli", "learner", *args]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=o, stderr=e)
    stop = threading.Event()
    gen: threading.Thread | None = None
    try:
        ep_file = run_dir / "endpoints.json"
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if serve and gen is None and ep_file.is_file():
                eps = json.loads(ep_file.read_text())
                gen = threading.Thread(target=fake_generator, daemon=True,
                                       args=(eps["control"], eps["weights"], stop,
                                             run_dir / "init"))  # fmt: skip
                gen.start()
            time.sleep(0.2)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()  # by its pid
            proc.wait()
        stop.set()
        if gen is not None:
            gen.join(10)
    return code, out.read_text(), err.read_text()


def test_quiet_terminal_then_resume_of_a_finished_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out, err = learner(run_dir, *SETTINGS, f"run_dir={run_dir}")
    assert code == 0, err[-4000:]
    terminal = out + err
    assert "Warning" not in terminal, terminal[-4000:]  # no UserWarning / FutureWarning lines
    assert "megatron" not in err  # nor megatron's INFO lines
    assert "learner: generators connect with" in out and "learner done" in out
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "UserWarning" in log and "megatron.core" in log  # they went to the file
    summary = (run_dir / "summary.json").read_bytes()
    assert json.loads(summary)["steps"] == 2

    code, out, err = learner(run_dir, "--resume", str(run_dir), serve=False)
    assert code == 0, err[-4000:]
    assert f"learner: {run_dir} already finished (step 2 of steps=2)" in out
    assert "generators connect with" not in out
    assert (run_dir / "summary.json").read_bytes() == summary


def test_no_final_checkpoint_when_told(tmp_path: Path) -> None:
    """checkpoint.final=false: the run trains and summarises but writes no checkpoint at its
    end (a benchmark, or a disk that cannot hold the optimizer state); the default writes one."""
    run_dir = tmp_path / "run"
    code, _, err = learner(run_dir, *SETTINGS, f"run_dir={run_dir}", "checkpoint.final=false")
    assert code == 0, err[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    ckpts = run_dir / "checkpoints"
    assert (sorted(ckpts.iterdir()) if ckpts.is_dir() else []) == []
    code, _, err = learner(run_dir, *SETTINGS, f"run_dir={run_dir}", "checkpoint.final=maybe",
                           serve=False)  # fmt: skip
    assert code != 0 and "checkpoint.final" in err, err[-2000:]
