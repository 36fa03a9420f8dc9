"""benchmarks/loop_credit.py's statistics and its CPU smoke: the 95% t-interval and the paired
verdict by hand, and ``--quick`` end to end (two tasks, vars and the mixed-depth task, each a
warm start and the arms last and exit_pdf_grad over 2 seeds through the reference learner):
the first line's figures and intervals, the last line's verdict.

Cost: the statistics < 1 s; the smoke about a minute on the 2-core host."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.bench_import import load_benchmark

lc = load_benchmark("loop_credit")
st = load_benchmark("loop_credit_stats")


def test_t_interval_by_hand() -> None:
    # mean 0.3, sd = sqrt(0.025) = 0.158114, t_{0.975, 4} = 2.776: half = 2.776 x 0.158114 / sqrt 5
    mean, lo, hi = st.t_interval([0.1, 0.2, 0.3, 0.4, 0.5])
    half = 2.776 * math.sqrt(0.025) / math.sqrt(5)
    assert math.isclose(mean, 0.3) and math.isclose(half, 0.196294, rel_tol=1e-5)
    assert math.isclose(lo, 0.3 - half) and math.isclose(hi, 0.3 + half)
    assert st.t_interval([0.4]) == (0.4, 0.4, 0.4)
    assert st.t975(4) == 2.776 and st.t975(35) == 2.042 and st.t975(200) == 1.960
    with pytest.raises(ValueError, match="df >= 1"):
        st.t975(0)


def test_verdict_pairs_by_seed() -> None:
    """An arm whose per-seed gain over last is steady is ahead even where the arms' own
    spreads overlap (paired by seed); a gain that changes sign is level; the last line names
    the best arm when none is ahead."""
    last = [0.20, 0.30, 0.25, 0.35, 0.22]
    steady = [a + d for a, d in zip(last, (0.05, 0.06, 0.04, 0.05, 0.07))]
    noisy = [a + d for a, d in zip(last, (0.10, -0.10, 0.05, -0.05, 0.0))]
    out = st.verdict({"mix": {"last": last, "steady": steady, "noisy": noisy}})
    c = {x["arm"]: x for x in out["comparisons"]}
    assert c["steady"]["call"] == "ahead" and math.isclose(c["steady"]["diff"], 0.054)
    half = 2.776 * 0.0114018 / math.sqrt(5)  # sd of (5, 6, 4, 5, 7) / 100
    assert math.isclose(c["steady"]["ci95"][0], 0.054 - half, rel_tol=1e-4)
    assert c["noisy"]["call"] == "level" and out["ahead"] == [("mix", "steady")]
    assert out["verdict"].startswith("steady ahead of last on mix: +0.054 (95% CI +0.0")
    out = st.verdict({"mix": {"last": last, "noisy": noisy}, "vars": {"last": last}})
    assert out["ahead"] == [] and out["verdict"].startswith("no arm ahead of last (best: noisy")
    behind = st.compare([a - 0.1 for a in last], last)
    assert behind["call"] == "behind" and math.isclose(behind["diff"], -0.1)
    with pytest.raises(ValueError, match="no 'last' arm"):
        st.verdict({"mix": {"noisy": noisy}})


def test_quick_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.time()
    assert lc.main(["--quick", "--out", str(tmp_path)]) == 0
    wall = time.time() - t0
    first, last = (json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-2:])
    assert set(first["tasks"]) == {"vars", "mix"} and first["samples_per_arm_seed"] == 32
    for res in first["tasks"].values():
        assert set(res["arms"]) == {"last", "exit_pdf_grad"}
        for arm in res["arms"].values():
            seeds, (lo, hi) = arm["accuracy_seeds"], arm["accuracy_ci95"]
            assert len(seeds) == 2 and lo <= arm["accuracy"] <= hi
            assert math.isclose(arm["accuracy"], sum(seeds) / 2)
    warm = first["tasks"]["mix"]["warm_start"]  # the mixed-depth task's classes, each depth
    for key in ("accuracy/hops=1", "accuracy/hops=2", "accuracy@1/hops=1", "accuracy@4/hops=2"):
        assert 0.0 <= warm[key] <= 1.0, key
    assert math.isclose(warm["accuracy@4"], (warm["accuracy@4/hops=1"]
                                             + warm["accuracy@4/hops=2"]) / 2)  # fmt: skip
    assert [(c["task"], c["arm"]) for c in last["comparisons"]] == [
        ("vars", "exit_pdf_grad"), ("mix", "exit_pdf_grad")]  # fmt: skip
    for c in last["comparisons"]:
        arms = first["tasks"][c["task"]]["arms"]
        assert math.isclose(c["diff"], arms["exit_pdf_grad"]["accuracy"] - arms["last"]["accuracy"],
                            abs_tol=1e-12)  # fmt: skip
        assert c["ci95"][0] <= c["diff"] <= c["ci95"][1] and c["seeds"] == 2
    assert isinstance(last["verdict"], str) and last["samples_per_arm_seed"] == 32
    assert wall < 90, wall
