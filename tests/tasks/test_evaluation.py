"""Stand-alone evaluation (pipeline/commands/evaluation.py) of a real tiny checkpoint on a dataset
split: the figures it reports are those of its own completions, scored by the task reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.commands.evaluation import evaluate, main
from pipeline.commands.make_math_data import make_dataset
from pipeline.config.run import load_config
from pipeline.core.eval_rounds import correct_of


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from models.random_init import init_checkpoint

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


def test_eval_needs_a_dataset_task() -> None:
    with pytest.raises(ConfigError, match="eval.every=5: needs task.kind=dataset"):
        load_config(None, ["eval.every=5"])


def test_fixed_depths(setup: tuple[Path, Path]) -> None:
    """--depths / eval.depths: the figures at each fixed depth are those of the same decode
    under FixedDepth(d) as the run's policy (here full depth 6: @6 equals the run's figures);
    bad depths are refused in one line naming eval.depths."""
    model, data = setup
    out = evaluate(cfg(data, "eval.depths=[1,6,9]"), model, limit=2)
    assert out["eval/mean_depth"] == 6.0
    assert out["eval/accuracy@6"] == out["eval/accuracy"]
    assert [out[f"eval/mean_depth@{d}"] for d in (1, 6, 9)] == [1.0, 6.0, 9.0]
    at2 = evaluate(cfg(data, 'rollout.exit_policy={kind: fixed, depth: 2}'), model, limit=2,
                   depths=[])  # fmt: skip
    assert (
        evaluate(cfg(data), model, limit=2, depths=[2])["eval/accuracy@2"] == at2["eval/accuracy"]
    )
    assert at2["eval/mean_depth"] == 2.0 and "eval/accuracy@2" not in at2
    with pytest.raises(ConfigError, match=r"eval\.depths=\[0\]: must be distinct ints"):
        evaluate(cfg(data), model, depths=[0])


def test_accuracy_at_depth_by_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--by hops on the mixed-depth task (generator.depth_mix, a tiny Ouro of 4 loops): the
    figures of each class at each fixed depth, whose prompt-weighted mean is the whole split's
    (pass@1, n = 1), every token of a class at the fixed depth; a column the prompts do not
    carry is refused in one line."""
    from generator.depth_mix import parse_mix, write_depth_mix
    from models.random_init import init_checkpoint

    model = init_checkpoint("ouro", "tiny", tmp_path / "model")
    write_depth_mix(tmp_path / "data", 20, 10, parse_mix("1:0.4,3:0.6"), 0)
    over = ["task.kind=dataset", f"task.path={tmp_path / 'data'}", "task.template=plain",
            "task.reward=generator.depth_mix:reward", "task.metadata_columns=[hops]",
            "rollout.max_tokens=2"]  # fmt: skip
    args = ["--model", str(model), "--depths", "1,2,4", "--by", "hops", *over]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval/hops=1/prompts"] == 4 and out["eval/hops=3/prompts"] == 6
    for d in (1, 2, 4):
        for h in (1, 3):
            assert out[f"eval/hops={h}/mean_depth@{d}"] == float(d)
            assert 0.0 <= out[f"eval/hops={h}/accuracy@{d}"] <= 1.0
        whole = (4 * out[f"eval/hops=1/accuracy@{d}"] + 6 * out[f"eval/hops=3/accuracy@{d}"]) / 10
        assert abs(out[f"eval/accuracy@{d}"] - whole) < 1e-12
    assert out["eval/hops=1/mean_depth"] == 4.0  # the run's policy: full depth
    cfg_ = load_config(None, over)
    with pytest.raises(ConfigError, match="--by 'level': not one of task.metadata_columns"):
        evaluate(cfg_, model, by="level")


def test_digit_accuracy_at_depth_by_query_class(tmp_path: Path) -> None:
    """The long mixed-depth task (generator.depth_mix --queries 8, reward_multi): at each fixed
    depth eval/reward_mean@d is the fraction of digits right, and scoring one query class at a
    time (task.reward_args score_hops) splits it: every row asks each class 4 times, so the
    whole split's figure is the two classes' mean."""
    from generator.depth_mix import parse_mix, write_depth_mix
    from models.random_init import init_checkpoint

    model = init_checkpoint("ouro", "tiny", tmp_path / "model")
    write_depth_mix(tmp_path / "data", 20, 6, parse_mix("1:0.5,2:0.5"), 0, queries=8)
    over = ["task.kind=dataset", f"task.path={tmp_path / 'data'}", "task.template=plain",
            "task.reward=generator.depth_mix:reward_multi", "task.metadata_columns=[hops]",
            "rollout.max_tokens=9"]  # fmt: skip
    whole = evaluate(load_config(None, over), model, depths=[1, 4])
    one, two = (evaluate(load_config(None, [*over, f"task.reward_args={{score_hops: {h}}}"]),
                         model, depths=[1, 4]) for h in (1, 2))  # fmt: skip
    for key in ("eval/reward_mean", "eval/reward_mean@1", "eval/reward_mean@4"):
        assert 0.0 <= whole[key] <= 1.0
        assert abs(whole[key] - (one[key] + two[key]) / 2) < 1e-12, key
    assert whole["eval/reward_mean@4"] == whole["eval/reward_mean"]  # the run's policy: depth 4
