"""What the learner promises about slow, paused, silent and lying generators (docs/PIPELINE.md,
"What the learner promises about its generators"), each driven with real processes on loopback:
a real learner (megatron backend, in this process), real `looprl generator` processes (vLLM on
CPU), SIGSTOP / SIGCONT, and hostile peers in their own processes (tests/pipeline/hostile_peer.py),
with one CPU core kept busy beside them so that the timings hold on a slow host too.

- A lone generator paused past the peer timeout is honest: when it comes back it is made
  current and its work is taken (or issued again), never banned; the run trains every step.
  The same run publishes every 2 steps (``publish.every=2``): the log-prob bound counts the
  learner's updates since the version a rollout was sampled with, not versions alone.
- Beside an honest generator: one that never acknowledges a weight version and fabricates its
  log-probs, and one that claims a version it was never sent, train nothing and are banned; one
  that takes work and never answers delays training by at most one work timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.commands.launcher import Generators
from pipeline.commands.learner_main import run_learner
from pipeline.core.metrics import read_metrics
from pipeline.core.recorder import read_rollouts, read_steps
from pipeline.core.validation import ModelLimits
from tests.pipeline.e2e_utils import check_run, small_config

PEER = Path(__file__).with_name("hostile_peer.py")
STEP_FLOOR_S, PEERS_S = 1.5, 90.0  # steps paced while the liars are not banned yet (at most)


@pytest.fixture
def busy_core() -> Iterator[int]:
    """A process spinning on one core for the length of the test (stopped by pid)."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _trained_by(run_dir: Path) -> Counter[str]:
    by_id = {r.rollout_id: r.generator_id for _, r in read_rollouts(run_dir / "stream")}
    return Counter(by_id[rid] for s in read_steps(run_dir / "steps.jsonl") for rid in s.rollout_ids)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_paused_lone_generator_rejoins_and_the_run_trains_every_step(
    tmp_path: Path, busy_core: int, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP the only generator for 3x the peer timeout at step 3 of 12, then SIGCONT
    (before: it rejoined serving the version before the learner's, was refused 8 times for
    weight_version and banned, and the run exited 1). publish.every=2 (before: the honest
    generator was banned at step 2 for logp_mismatch at the staleness-0 bound)."""
    caplog.set_level(logging.INFO, logger="pipeline.core.coordinator")
    steps = 12
    cfg = small_config(tmp_path, f"steps={steps}", "generators.count=1", "publish.every=2")
    pause_s = 3 * cfg.transport.peer_timeout_s
    state: dict[str, float | int] = {}
    gens = Generators(cfg)
    metrics = tmp_path / "metrics.jsonl"

    def stop() -> bool:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= 3 and "paused" not in state:
            os.kill(gens.procs[0].pid, signal.SIGSTOP)
            state["paused"], state["at_step"] = time.time(), done
            threading.Timer(pause_s, os.kill, (gens.procs[0].pid, signal.SIGCONT)).start()
        return gens.all_dead()

    try:
        s = run_learner(cfg, on_bound=gens.start, stop=stop)
        alive = gens.procs[0].poll() is None
    finally:
        gens.stop()
    assert "paused" in state, "the run ended before the pause"
    assert s["steps"] == steps
    assert alive, (tmp_path / "logs" / "gen0.log").read_text(errors="replace")[-3000:]
    assert s["counts"]["banned"] == {}, s["counts"]["banned"]
    assert s["counts"]["intake"].get("refused", 0) == 0, s["counts"]["intake"]
    rows = check_run(tmp_path, 4, steps, max_staleness=1)
    # the pause really cost the generator its registration, and it came back
    log = caplog.text
    assert "gen0 gone (heartbeat expired)" in log and log.count("generator gen0 joined") >= 2, log
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained = _trained_by(tmp_path)
    assert trained == {"gen0": steps * 2 * 4}, trained
    digests = (tmp_path / "weights" / "digests.jsonl").read_text().splitlines()
    assert len(digests) == steps // 2  # published every 2 steps


def _start_peer(mode: str, ctrl: str, wts: str, limits: ModelLimits, run_dir: Path,
                procs: list[subprocess.Popen[bytes]]) -> None:  # fmt: skip
    out = open(run_dir / f"{mode}.out", "wb")  # noqa: SIM115
    args = [mode, mode, ctrl, wts, str(limits.max_depth), str(limits.vocab_size), "600"]
    procs.append(subprocess.Popen([sys.executable, str(PEER), *args], stdout=out,
                                  stderr=subprocess.STDOUT))  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
def test_liars_train_nothing_and_a_work_holder_delays_training_by_one_timeout(
    tmp_path: Path, busy_core: int
) -> None:
    """One real generator beside three hostile peers (each its own process): ``noack`` never
    acknowledges a version and fabricates log-probs (3-5 nats off, answered at staleness 1), ``overclaim`` claims v500, ``holder`` takes
    work and never answers. Before: fabricated log-probs trained at the staleness-1 bound,
    the v500 claimant never banned, and the holder stopped training until max_wait_s."""
    steps, timeout_s = 14, 8.0
    cfg = small_config(tmp_path, f"steps={steps}", "generators.count=1",
                       f"intake.work_timeout_s={timeout_s}", "max_wait_s=120")  # fmt: skip
    gens = Generators(cfg)
    peers: list[subprocess.Popen[bytes]] = []
    metrics = tmp_path / "metrics.jsonl"
    where: dict[str, str] = {}

    def on_bound(ctrl: str, wts: str, model: Path) -> None:
        where.update(ctrl=ctrl, wts=wts, model=str(model))
        gens.start(ctrl, wts, model)

    seen: dict[str, float] = {"rows": 0}

    def banned_both() -> bool:
        outs = [tmp_path / f"{m}.out" for m in ("noack", "overclaim")]
        return all(o.exists() and "banned" in o.read_text() for o in outs)

    def stop() -> bool:  # the peers join once training runs (versions > 0 to lie about)
        rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if not peers and rows >= 2:
            limits = ModelLimits.from_checkpoint(where["model"], cfg.rollout.parsed_policy)
            for mode in ("noack", "overclaim", "holder"):
                _start_peer(mode, where["ctrl"], where["wts"], limits, tmp_path, peers)
            seen["t_peers"] = time.monotonic()
        if peers and rows > seen["rows"]:  # the run lasts until the liars had their chance:
            seen["rows"] = rows  # steps are paced (a floor per step, well under the work
            if not banned_both() and time.monotonic() < seen["t_peers"] + PEERS_S:  # timeout)
                time.sleep(STEP_FLOOR_S)
        return gens.all_dead()

    try:
        s = run_learner(cfg, on_bound=on_bound, stop=stop)
        alive = gens.procs[0].poll() is None
    finally:
        gens.stop()
        for p in peers:
            p.kill()
            p.wait()
    assert s["steps"] == steps and alive
    trained = _trained_by(tmp_path)
    assert set(trained) == {"gen0"} and trained["gen0"] == steps * 2 * 4, trained
    banned = s["counts"]["banned"]
    assert set(banned) == {"noack", "overclaim"}, banned
    assert "never sent" in banned["overclaim"], banned
    check_run(tmp_path, 4, steps, max_staleness=1)
    said = {m: (tmp_path / f"{m}.out").read_text() for m in ("noack", "overclaim", "holder")}
    assert "banned" in said["noack"] and "banned" in said["overclaim"], said
    held = [ln for ln in said["holder"].splitlines() if ln.startswith("work ")]
    assert held, said["holder"]  # it did take work
    # the holder delayed training by at most one work timeout (plus a step's generation)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    assert max(gaps) <= timeout_s + 6.0, gaps
    refused = s["counts"]["refused_by_generator"]
    assert refused["overclaim"].get("claim", 0) >= cfg.intake.max_refused, refused
    json.dumps(s)  # the summary stays serialisable
