"""`looprl run metrics.profile_steps=[first, last]`: the run's own steps under torch.profiler
(pipeline.core.profiling). A real run with its generator as a thread of the learner's process:
the trace holds the host ops of both the trainer's thread and the generator's, the table and
the summary are written, the run's other steps are unaffected."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pipeline.config.run import load_config
from pipeline.core.metrics import read_metrics
from tests.cli.test_run_llama import looprl_run

pytestmark = pytest.mark.slow


def test_a_profiled_run_traces_both_threads(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, err, _ = looprl_run(run_dir, "steps=3", "generators.placement=thread",
                              "metrics.profile_steps=[2,3]", timeout_s=300)  # fmt: skip
    assert code == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    prof = run_dir / "profile"
    summary = json.loads((prof / "summary.json").read_text())
    assert summary["steps"] == [2, 3]
    assert 0.0 < summary["window_s"] < 120.0
    assert summary["streams"] == {} and summary["busy_s"] == 0.0  # a CPU host: no device work
    events = json.loads(gzip.open(prof / "trace.json.gz").read())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    names = {e["name"] for e in ops}
    assert "aten::mm" in names, sorted(names)[:40]
    # the trainer's thread and the generator's (and the coordinator's): more than one thread
    assert len({e["tid"] for e in ops}) >= 2, {e["tid"] for e in ops}
    assert "aten::mm" in (prof / "kernels.txt").read_text()
    recorded = load_config(str(run_dir / "config.yaml"))  # the window is part of the run's config
    assert recorded.metrics.profile_steps == [2, 3]


def test_a_profiled_run_profiles_its_generator_process_too(tmp_path: Path) -> None:
    """With generators.placement=process the generator is another process: `looprl run` hands
    it the window, and it writes its own batches' trace, table and summary to
    RUN_DIR/profile/gen0 beside the learner's."""
    run_dir = tmp_path / "run"
    code, err, _ = looprl_run(run_dir, "steps=3", "generators.engine=torch",
                              "metrics.profile_steps=[2,3]", timeout_s=300)  # fmt: skip
    assert code == 0, err[-3000:]
    learner = json.loads((run_dir / "profile" / "summary.json").read_text())
    assert learner["steps"] == [2, 3]
    gen = run_dir / "profile" / "gen0"
    summary = json.loads((gen / "summary.json").read_text())
    assert summary["batches"] == [2, 3]
    assert 0.0 < summary["window_s"] < 120.0
    events = json.loads(gzip.open(gen / "trace.json.gz").read())["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert "aten::mm" in names or "aten::addmm" in names, sorted(names)[:40]  # the decode's
    assert "aten::" in (gen / "kernels.txt").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"profile_batches": "3"}, "profile_batches='3': expected FIRST:LAST"),
        ({"profile_batches": "4:3", "profile_dir": "p"}, "profile_batches='4:3': expected"),
        ({"profile_batches": "0:1", "profile_dir": "p"}, "profile_batches='0:1': expected"),
        ({"profile_batches": "1:2"}, "profile_dir='': profile_batches and profile_dir go"),
        ({"profile_dir": "p"}, "profile_dir='p': profile_batches and profile_dir go"),
    ],
)
def test_a_generator_profile_window_is_checked(flags: dict[str, str], message: str) -> None:
    from generator.config import GeneratorConfig
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        GeneratorConfig(**flags)
    assert GeneratorConfig(profile_batches=" 2:5", profile_dir="p").profile_window == [2, 5]
