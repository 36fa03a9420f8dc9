"""benchmarks/exit_pays.py's smoke (--smoke): the product's warm start (`looprl sft`), then a
real `looprl run` of each arm (fixed full depth; sampled exit with a depth cost) from it and
`looprl eval` of its last weights, and the two JSON lines with the verdict.

Cost: ~30 s on a quiet 2-core host (two runs of 3 steps, a 45-step warm start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_import import load_benchmark

pytestmark = pytest.mark.slow

ep = load_benchmark("exit_pays")


def test_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ep.main(["--smoke", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res, verdict = json.loads(lines[-2]), json.loads(lines[-1])
    assert res["samples_per_run"] == 3 * 4 * 4
    full, exit_ = res["arms"]["full"], res["arms"]["exit"]
    assert full["mean_depth"] == 4.0 and full["eval_mean_depth"] == 4.0  # every token 4 loops
    assert 1.0 <= exit_["mean_depth"] < 4.0  # the gate's sampled exits, in the trained stream
    for arm in (full, exit_):
        assert arm["samples_per_s"] > 0 and arm["tokens_per_s"] >= arm["samples_per_s"]
        for key in ("accuracy", "accuracy/hops=1", "accuracy/hops=2", "accuracy@1/hops=2"):
            assert 0.0 <= arm[key] <= 1.0 and len(arm[f"{key}_seeds"]) == 1
    for d in (1, 2, 3, 4):  # each fixed depth of the evaluation
        assert f"accuracy@{d}" in full and f"accuracy@{d}" in exit_
    ratio, (lo, hi) = verdict["samples_per_s_ratio"]
    assert ratio > 0 and lo <= ratio <= hi
    assert verdict["mean_depth"] == [full["mean_depth"], exit_["mean_depth"]]
    assert verdict["verdict"].startswith("exit vs full: samples/s x")
    for arm in ("full", "exit"):  # both arms generated with the torch engine
        assert "engine: torch" in (tmp_path / f"{arm}-0" / "config.yaml").read_text()


def test_smoke_long(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--task long: the same pipeline on configs/depth_mix_long.yaml (16 digits a completion),
    its accuracy the fraction of digits right, by query class. ~2 min on a quiet host."""
    assert ep.main(["--smoke", "--task", "long", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res, verdict = json.loads(lines[-2]), json.loads(lines[-1])
    assert res["samples_per_run"] == 3 * 4 * 4 and res["settings"]["task"] == "long"
    full, exit_ = res["arms"]["full"], res["arms"]["exit"]
    assert full["mean_depth"] == 4.0 and 1.0 <= exit_["mean_depth"] < 4.0
    for arm in (full, exit_):
        for key in ("accuracy", "exact", "accuracy@1", "accuracy/hops=1", "accuracy@4/hops=2"):
            assert 0.0 <= arm[key] <= 1.0, key
    assert verdict["verdict"].startswith("exit vs full: samples/s x")
    # the position-loops: the full arm all of them; the exit arm's prompts at the full depth
    assert full["loop_share"] == full["decode_loop_share"] == 1.0
    least = (48 * 4 + 17 * 1) / ((48 + 17) * 4)  # every one of 17 tokens at one loop
    assert least <= exit_["loop_share"] < 1.0 and "at most x" in verdict["verdict"]
    for arm in ("full", "exit"):
        assert "depth_mix_long" in (tmp_path / f"{arm}-0" / "config.yaml").read_text()
