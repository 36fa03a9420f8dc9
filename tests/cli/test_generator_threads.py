"""`looprl run generators.placement=thread`: the generator as a thread of the learner's process
(pipeline.commands.generator_threads). The real learner and the real torch-engine generator
code over the real ZeroMQ endpoints, in one process: the run trains, every version after the
first reaches the generator and is served, the generator stops cleanly at the end (its loop
asked to finish: no process to signal), its lines in logs/gen0.log; a generator thread that
fails stops the run with its error named; settings a thread cannot honour are refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.config.run import load_config
from pipeline.core.metrics import read_metrics
from pipeline.core.recorder import read_rollouts, read_steps
from tests.cli.test_run_llama import looprl_run

pytestmark = pytest.mark.slow


def test_a_run_with_its_generator_in_a_thread(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(run_dir, "steps=4", "generators.placement=thread", timeout_s=300)
    assert code == 0, err[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["refused_total"] == 0
    gen_log = (run_dir / "logs" / "gen0.log").read_text()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "generator gen0: a thread of this process" in learner_log
    # the versions the learner published before the last step reach the thread and are served
    served = sorted(int(v) for v in re.findall(r"serving weights v(\d+)", gen_log))
    assert served == list(range(1, len(served) + 1)) and len(served) >= 2, gen_log[-2000:]
    trained = {rid for s in read_steps(run_dir / "steps.jsonl") for rid in s.rollout_ids}
    versions = {r.weight_version for _, r in read_rollouts(run_dir / "stream")
                if r.rollout_id in trained}  # fmt: skip
    assert max(versions) >= 1, versions  # rollouts of a served version were trained on
    # stopped by its loop (drained, Goodbye), not left behind as a daemon thread
    assert "generator gen0 stopped cleanly" in gen_log, gen_log[-2000:]
    assert "did not stop" not in learner_log
    # only the generator thread's own lines in its file
    assert "pipeline.core.coordinator" not in gen_log
    print(f"\nthread placement: 4 steps in {wall:.1f} s, served {served}")


def test_a_failing_generator_thread_stops_the_run_with_its_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, err, _ = looprl_run(
        run_dir, "steps=4", "generators.placement=thread", "generators.kv_cache_mb=1",
        "generators.max_model_len=4096", timeout_s=300,
    )  # fmt: skip
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("looprl run: error: every generator exited (codes gen0=1)"), last
    assert "generators.kv_cache_mb (1 MiB) holds no request of 4096 positions" in last, last
    assert "Traceback" not in err  # the traceback is the log's, the terminal gets one line
    assert "Traceback" in (run_dir / "logs" / "gen0.log").read_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["generators.placement=threads"], "generators.placement='threads': expected process or thread"),
        (["generators.placement=thread", "generators.engine=vllm"],
         "generators.engine='vllm': generators.placement=thread runs the torch engine only"),
        (["generators.placement=thread", "generators.threads=2"],
         "generators.threads=2: torch threads of a generator process"),
        (["generators.placement=thread", "generators.extra_args=[--batch-wait-s,1]"],
         "generators.extra_args=['--batch-wait-s', '1']: flags of a generator process"),
        (["generators.carveout_sms=16"], "generators.carveout_sms=16: needs generators.placement=thread"),
        (["generators.placement=thread", "generators.carveout_sms=-1"],
         "generators.carveout_sms=-1: must be >= 0"),
    ],
)  # fmt: skip
def test_settings_a_thread_cannot_honour_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU host's refusal")
def test_an_sm_carveout_without_a_card_is_refused_and_nothing_is_left_set(tmp_path: Path) -> None:
    """generators.carveout_sms on a host without CUDA: refused by name at start, before any
    generator thread (the process-wide carveout and switch interval left as they were)."""
    import sys

    import torch

    from pipeline.commands.generator_threads import GeneratorThreads

    cfg = load_config(None, ["generators.placement=thread", "generators.carveout_sms=16",
                             f"run_dir={tmp_path}"])  # fmt: skip
    switch = sys.getswitchinterval()
    gens = GeneratorThreads(cfg)
    with pytest.raises(ConfigError, match=r"generators.carveout_sms=16: needs a CUDA card"):
        gens.start("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", tmp_path / "model")
    assert gens.gens == [] and sys.getswitchinterval() == switch
    assert torch._C._get_sm_carveout_experimental() is None


def test_thread_placement_picks_the_torch_engine() -> None:
    cfg = load_config(None, ["generators.placement=thread"])
    assert cfg.generators.engine == "torch"
    assert any("generators.engine=torch: generators.placement=thread" in line
               for line in cfg.device_choices)  # fmt: skip


def test_sigterm_stops_the_run_and_its_generator_thread(tmp_path: Path) -> None:
    """SIGTERM to `looprl run` (its only process: the generator is a thread of it) ends the
    run at the next turn: exit 0, the generator's loop asked to finish and stopped cleanly."""
    import signal
    import subprocess
    import sys
    import time

    from tests.cli.test_run_llama import ENV, QUIET, REPO

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", f"run_dir={run_dir}", *QUIET,
           "steps=100000", "generators.placement=thread"]  # fmt: skip
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    try:
        metrics = run_dir / "metrics.jsonl"
        end = time.monotonic() + 240
        while time.monotonic() < end and proc.poll() is None:
            if metrics.is_file() and len(read_metrics(metrics)) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = proc.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, (tmp_path / "err").read_text()[-3000:]
    gen_log = (run_dir / "logs" / "gen0.log").read_text()
    assert "generator gen0 stopped cleanly" in gen_log, gen_log[-2000:]
    assert "did not stop" not in (run_dir / "logs" / "learner.log").read_text()
    print(f"\nSIGTERM after {len(read_metrics(metrics))} steps: exit 0 in {took:.1f} s")
    assert took < 60
