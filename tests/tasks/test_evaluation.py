"""Stand-alone evaluation (pipeline/evaluation.py) of a real tiny checkpoint on a dataset
split: the figures it reports are those of its own completions, scored by the task reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.evaluation import correct_of, evaluate, main
from pipeline.make_math_data import make_dataset


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from models.init import init_checkpoint

    tmp = tmp_path_factory.mktemp("eval")
    model = init_checkpoint("huginn", "tiny", tmp / "model")
    make_dataset(tmp / "data", train=20, test=6)
    return model, tmp / "data"


def cfg(data: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["task.kind=dataset", f"task.path={data}", "task.reward=math",
                              "rollout.max_tokens=3", "task.reward_args.format_weight=0.5",
                              *extra])  # fmt: skip


def test_greedy_and_sampled_figures(setup: tuple[Path, Path]) -> None:
    model, data = setup
    greedy = evaluate(cfg(data), model)
    assert greedy["eval/prompts"] == 6 and greedy["eval/n"] == 1
    assert greedy["eval/accuracy"] == greedy["eval/mean@n"]
    assert 0.0 <= greedy["eval/accuracy"] <= 1.0
    assert evaluate(cfg(data), model) == greedy  # greedy: deterministic
    sampled = evaluate(cfg(data), model, n=3, temperature=1.0, limit=4)
    assert sampled["eval/prompts"] == 4 and sampled["eval/n"] == 3
    assert evaluate(cfg(data), model, n=3, temperature=1.0, limit=4) == sampled  # seeded
    # the reward mean is format_weight x formatted + (1 - format_weight) x correct
    assert sampled["eval/reward_mean"] >= 0.5 * sampled["eval/mean@n"]


def test_cli_prints_one_json_line_and_refuses_bad_settings(
    setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = setup
    args = ["--model", str(model), "task.kind=dataset", f"task.path={data}", "task.reward=math",
            "rollout.max_tokens=2", "--limit", "2"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval/prompts"] == 2 and out["eval/split"] == "test"
    assert main(["--model", str(model)]) == 2  # the synthetic task has no eval split
    assert "looprl eval: error: run config task.kind='synthetic'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="need n >= 1"):
        evaluate(cfg(data), model, n=0)


def test_correct_of() -> None:
    assert correct_of(0.2, {"correct": True}) and not correct_of(1.0, {"correct": False})
    assert correct_of(1.0, {}) and not correct_of(0.5, {}) and not correct_of(None, {})


def test_periodic_eval_adds_eval_metrics_to_the_due_rows(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    import shutil

    from pipeline.evaluation import PeriodicEval

    model, data = setup
    c = cfg(data, "eval.every=2", "eval.limit=3", f"run_dir={tmp_path}")
    shutil.copytree(model, tmp_path / "weights" / "v2")  # a "published" version
    ev = PeriodicEval(c, model, tmp_path, last_step=6)
    assert [s for s in range(1, 7) if ev.due(s)] == [1, 3, 5, 6]
    rows = [{"step": s, "version": v} for s, v in [(1, 0), (2, 1), (3, 2), (5, 4)]]
    for r in rows:
        ev(r)
    assert "eval/accuracy" not in rows[1]  # not due
    assert rows[0]["eval/version"] == 0 and rows[2]["eval/version"] == 2
    assert rows[0]["eval/prompts"] == 3 and 0.0 <= rows[2]["eval/accuracy"] <= 1.0
    assert {k for k in rows[0] if k.startswith("eval/")} == {"eval/prompts", "eval/n",
        "eval/accuracy", "eval/mean@n", "eval/reward_mean", "eval/version", "eval/s"}  # fmt: skip
    assert rows[0]["eval/accuracy"] == rows[2]["eval/accuracy"]  # same weights, greedy
    assert "eval/accuracy" not in rows[3]  # v4 was never published here: skipped, not fatal
    with pytest.raises(ConfigError, match="eval.every=5: needs task.kind=dataset"):
        load_config(None, ["eval.every=5"])
