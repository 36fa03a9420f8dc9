"""A generator that cannot serve stops at once, and a run left without generators fails fast.

- `StopOnFailedLoad` (the generator process's engine): the first weight set the engine refuses
  (a digest that does not match, a loader that fails, files it cannot read) stops the loop with
  one line naming the version and why, and is refused as before;
- the launcher's line: the last error a generator logged, without its log prefix;
- `looprl run` whose only generator exits at start (a reward that does not import) exits 1
  with that line (it returned 0 with a summary of 0 steps before).
(With real weights that do not fit the generators' model: tests/cli/test_run_llama.py.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.commands.console import last_error_line
from pipeline.commands.generator_cli import StopOnFailedLoad
from tests.cli.test_run_llama import ENV, QUIET, REPO
from weights.check import WeightsRefused
from weights.verified import VerifiedWeights


class FakeEngine:
    weight_version = 0

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    def generate(self, items: list[Any]) -> list[list[Any]]:
        return [[] for _ in items]

    def load_weights(self, weights: VerifiedWeights) -> None:
        if self.fail is not None:
            raise self.fail
        self.weight_version = weights.version


def test_a_refused_set_stops_the_generator_with_one_line() -> None:
    lines: list[str] = []
    ok = StopOnFailedLoad(FakeEngine(None), lines.append)
    ok.load_weights(VerifiedWeights.of({}, 1, "d"))
    assert ok.weight_version == 1 and ok.failure == "" and lines == []
    assert ok.generate([1, 2]) == [[], []]

    bad = WeightsRefused("weights v2: digest aa does not match the announced bb; still serving v1")
    served = StopOnFailedLoad(FakeEngine(bad), lines.append)
    with pytest.raises(WeightsRefused):
        served.load_weights(VerifiedWeights.of("/weights/v2", 2, "bb"))
    assert lines == [served.failure]
    assert served.failure == (
        "cannot serve weights v2: digest aa does not match the announced bb; still serving v1"
    )
    missing = StopOnFailedLoad(FakeEngine(FileNotFoundError("no /weights/v3")), lines.append)
    with pytest.raises(FileNotFoundError):
        missing.load_weights(VerifiedWeights.of("/weights/v3", 3, "cc"))
    assert lines[-1] == "cannot serve weights v3: FileNotFoundError: no /weights/v3"


def test_last_error_line_of_a_generator_log(tmp_path: Path) -> None:
    log = tmp_path / "gen0.log"
    log.write_text(
        "2026-12-01 21:41:39,196 INFO generator.loop: welcomed by run r\n"
        "2026-12-01 21:41:46,192 ERROR pipeline.commands.generator_cli: generator gen0 "
        "stopped: cannot serve weights v1: x\n"
        "2026-12-01 21:41:46,300 INFO generator.loop: bye\n\n"
    )
    assert last_error_line(log) == "generator gen0 stopped: cannot serve weights v1: x"
    log.write_text("looprl generator: error: reward 'x': not found\n")
    assert last_error_line(log) == "looprl generator: error: reward 'x': not found"
    log.write_text("just a line\n")
    assert last_error_line(log) == "just a line"
    assert last_error_line(tmp_path / "absent.log") == ""


@pytest.mark.slow
def test_run_fails_when_its_only_generator_exits(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", f"run_dir={run_dir}", *QUIET,
           "model.family=llama", "steps=5", "generators.count=1", "max_wait_s=600",
           "generators.extra_args=[--reward,no_such_module:score]"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    print(f"\nrun without a generator: exit {proc.returncode} after {wall:.0f} s")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("looprl run: error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert (
        "every generator exited (codes gen0=2) after 0 steps; gen0: looprl generator: "
        in (errors[0])
    )
    assert "no_such_module" in errors[0] and str(run_dir / "logs") in errors[0]
