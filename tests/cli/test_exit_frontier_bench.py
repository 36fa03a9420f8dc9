"""benchmarks/exit_frontier.py's frontier on synthetic per-run records (no `looprl` run): the
fixed-depth curve's intervals, the interpolation at a cost's mean exit depth, the paired
comparison with it, the verdict, and the PNG. Its --smoke is `python
benchmarks/exit_frontier.py --smoke` (~1-2 min; not in the suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_import import load_benchmark

ef = load_benchmark("exit_frontier")

CURVE = {0: [0.5, 0.6, 0.7, 0.8], 1: [0.4, 0.6, 0.6, 0.8]}  # per seed, accuracy@1..4


def _run(acc: float, depth: float, speed: float) -> dict[str, float]:
    return {"accuracy": acc, "eval_mean_depth": depth, "mean_depth": depth + 0.1,
            "samples_per_s": speed / 2, "gen_samples_per_s": speed}  # fmt: skip


def _points() -> list[dict[str, object]]:
    """Per seed the full arm (the curve), cost 0.05 at depth 2.5 0.2-0.21 above the seed's
    curve (0.65 / 0.6 there), cost 0.2 at depth 1.5 0.02 below / above it (level)."""
    out: list[dict[str, object]] = []
    for seed, curve in CURVE.items():
        at = {f"accuracy@{d}": a for d, a in zip((1, 2, 3, 4), curve)}
        out.append({"arm": "full", "cost": None, "seed": seed, **_run(curve[-1], 4.0, 100.0), **at})
        acc = ef.interp((1, 2, 3, 4), curve, 2.5) + 0.2 + 0.01 * seed
        out.append({"arm": "exit", "cost": 0.05, "seed": seed, **_run(acc, 2.5, 150.0)})
        acc = ef.interp((1, 2, 3, 4), curve, 1.5) + (0.02 if seed else -0.02)
        out.append({"arm": "exit", "cost": 0.2, "seed": seed, **_run(acc, 1.5, 200.0)})
    return out


def test_interp() -> None:
    assert ef.interp((1, 2, 3, 4), (0.5, 0.6, 0.7, 0.8), 2.5) == pytest.approx(0.65)
    assert ef.interp((1, 2, 3, 4), (0.5, 0.6, 0.7, 0.8), 0.7) == 0.5  # clamped
    assert ef.interp((1, 2, 3, 4), (0.5, 0.6, 0.7, 0.8), 4.2) == 0.8
    assert ef.interp((1, 2, 3, 4), (0.4, 0.6, 0.6, 0.8), 3.0) == pytest.approx(0.6)


def test_frontier_and_plot(tmp_path: Path) -> None:
    fr = ef.frontier(_points())
    assert fr["seeds"] == 2 and [f["depth"] for f in fr["fixed"]] == [1, 2, 3, 4]
    d1 = fr["fixed"][0]  # seeds 0.5 and 0.4: mean 0.45, half-width 12.706 x 0.0707 / sqrt 2
    assert d1["accuracy"] == pytest.approx(0.45) and d1["accuracy_seeds"] == [0.5, 0.4]
    assert d1["accuracy_ci95"] == pytest.approx([0.45 - 0.6353, 0.45 + 0.6353], abs=1e-3)
    assert fr["fixed"][3]["accuracy_ci95"] == pytest.approx([0.8, 0.8])  # no spread
    (c05, c2) = fr["exit"]
    assert c05["cost"] == 0.05 and c05["mean_depth"] == 2.5  # the held-out depth
    assert c05["train_mean_depth"] == pytest.approx(2.6) and c05["gen_samples_per_s"] == 150.0
    assert c05["fixed_at_depth"] == pytest.approx((0.65 + 0.6) / 2)
    assert c05["vs_fixed"]["diff"] == pytest.approx(0.205)
    assert c05["vs_fixed"]["call"] == "above" and c05["vs_fixed"]["seeds"] == 2
    assert c2["vs_fixed"]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert c2["vs_fixed"]["call"] == "level" and fr["above"] == [0.05]
    assert fr["full"]["gen_samples_per_s"] == 100.0 and fr["full"]["accuracy"] == 0.8
    assert fr["verdict"].startswith("learned exit minus the fixed-depth curve at its mean exit")
    assert "cost 0.05 at depth 2.50: +0.205 (" in fr["verdict"]
    assert fr["verdict"].endswith("above the curve: cost 0.05")
    png = ef.plot(fr, tmp_path / "images" / "frontier.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    saved = tmp_path / "out.jsonl"  # --replot: the figure again from the output's last line
    settings = {"steps": 30, "prompts": 16, "n": 8}
    saved.write_text(json.dumps({"arm": "full"}) + "\n" + json.dumps({**fr, "settings": settings}))
    assert ef.main(["--replot", str(saved), "--png", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000


def test_frontier_refuses_missing_seeds() -> None:
    points = [p for p in _points() if not (p["cost"] == 0.2 and p["seed"] == 1)]
    with pytest.raises(ValueError, match="cost 0.2 ran seeds"):
        ef.frontier(points)
    one = ef.frontier([p for p in _points() if p["seed"] == 0])
    assert one["above"] == [] and "1 seed" in one["verdict"]  # 1 seed: every call level
