"""benchmarks/exit_pays.py's settings without a run (~2 s): the GPU mode's defaults and run
overrides (a valid run config, the exit arm decoding by ticks in kv last_exited, so that an
exited token skips compute), the CPU mode unchanged, the time budget's seeds and --merge."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace as Row

import numpy as np
import pytest

from tests.bench_import import load_benchmark

ep = load_benchmark("exit_pays")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=None)
    ep.add_run_arguments(p)
    p.add_argument("--depth-cost", type=float, default=0.05)
    ep.add_warm_arguments(p)
    p.add_argument("--smoke", action="store_true")
    return p.parse_args(argv)


def test_cpu_mode_keeps_its_defaults() -> None:
    args = _args([])
    ep.check_args(args)
    assert (args.size, args.steps, args.seeds) == ("tiny", 30, 3)
    assert (args.depth_ticks, args.lr) == (0, None)
    assert ep.device_overrides(args) == ["backend=reference"]
    assert ep.arm_overrides("exit", 0.05, 0)[0] == "rollout.exit_policy={kind: sampled_gate}"


def test_gpu_mode_defaults_and_a_valid_run_config(monkeypatch: pytest.MonkeyPatch) -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("the refusal below needs a host without CUDA")
    import torch

    from pipeline.config.run import load_config

    args = _args(["--device", "cuda", "--steps", "8"])
    with monkeypatch.context() as m:  # (the run configs below resolve on this CPU host)
        m.setattr(torch.cuda, "is_available", lambda: True)
        ep.check_args(args)
    assert (args.size, args.steps, args.seeds, args.depth_ticks) == ("400m", 8, 5, 2)
    assert (args.warm_lr, args.warm_batch, args.gate_lr, args.lr) == (3e-4, 64, 3e-4, 3e-5)
    over = ep.device_overrides(args)
    assert "backend=megatron" in over and "learner.precision=bf16" in over
    assert "learner.compile=false" in over and "generators.dtype=bfloat16" in over
    assert "optimizer.lr=3e-05" in over and "task.max_prompt_tokens=19" in over
    assert "generators.max_model_len=21" in over  # the prompt + the digit + EOS
    base = ["generators.engine=torch", "generators.count=1", *over]
    full = load_config(ep.CONFIG, base + ep.arm_overrides("full", 0.05, args.depth_ticks))
    assert full.rollout.parsed_policy is None and full.generators.depth_ticks == 0
    exit_ = load_config(ep.CONFIG, base + ep.arm_overrides("exit", 0.05, args.depth_ticks))
    policy = exit_.rollout.parsed_policy
    assert type(policy).__name__ == "SampledGate" and policy.kv == "last_exited"
    assert exit_.generators.depth_ticks == 2 and exit_.objective.depth_cost == 0.05
    assert (exit_.learner.precision, exit_.backend, exit_.publish.keep) == ("bf16", "megatron", 2)
    with pytest.raises(SystemExit, match="no CUDA device"):
        ep.check_args(_args(["--device", "cuda"]))  # (this host: torch.cuda unavailable)


def test_longest_prompt_bounds_the_rendered_prompts() -> None:
    data = ep.REPO / "configs" / "data" / "depth_mix" / "test.jsonl"
    longest = max(len(json.loads(ln)["prompt"]) for ln in data.read_text().splitlines() if ln)
    assert ep.longest_prompt() >= longest + 1  # BOS + one token a byte at most


def test_budget_stops_before_a_seed_that_cannot_end() -> None:
    clock = iter([100.0, 100.0, 150.0, 200.0, 250.0]).__next__  # a seed takes 50 s
    args = argparse.Namespace(first_seed=2, seeds=5, budget_s=260.0)
    # seed 5 would start at 250 s: 250 + 1.1 x 50 > 260, so 5 and 6 are not run
    assert list(ep.seeds_in_budget(args, 0.0, clock)) == [2, 3, 4]
    args = argparse.Namespace(first_seed=0, seeds=3, budget_s=0.0)
    assert list(ep.seeds_in_budget(args, 0.0)) == [0, 1, 2]


def test_merge_pairs_the_calls_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def call(path: Path, seeds: list[int], speed: float) -> str:
        runs = {arm: [{"samples_per_s": speed * (1 + (arm == "exit")) + s, "accuracy": 0.5,
                       "gen_samples_per_s": 10.0, "mean_depth": 4.0 - (arm == "exit")}
                      for s in seeds] for arm in ("full", "exit")}  # fmt: skip
        summary = {"arms": {a: ep.summarise(r) for a, r in runs.items()}, "seeds_run": seeds}
        path.write_text(json.dumps(summary) + "\n" + json.dumps({"verdict": "..."}) + "\n")
        return str(path)

    files = [call(tmp_path / "a.json", [0, 1], 100.0), call(tmp_path / "b.json", [2], 100.0)]
    assert ep.main(["--merge", *files]) == 0
    res, verdict = (json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines())
    assert res["seeds_run"] == [0, 1, 2] and verdict["seeds"] == 3
    assert res["arms"]["full"]["samples_per_s_seeds"] == [100.0, 101.0, 102.0]
    assert verdict["mean_depth"] == [4.0, 3.0] and verdict["accuracy_diff"][0] == 0.0


def test_merge_takes_the_finished_seeds_of_a_cut_off_calls_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call killed by the device's limit printed no summary; its stderr's per-run lines still
    give the seeds both arms finished (seed 4's full arm alone is left out), merged after a
    whole call's output."""

    def fig(sps: float, acc: float) -> str:
        return json.dumps({"samples_per_s": sps, "accuracy": acc, "gen_samples_per_s": 10.0,
                           "mean_depth": 4.0 if sps < 150 else 2.0})  # fmt: skip

    log = tmp_path / "cut.err"
    log.write_text("\n".join([
        "# warm start: {}", f"# full seed 3: {fig(100.0, 0.5)}",
        f"# exit seed 3: {fig(160.0, 0.48)}", "[W some warning]",
        f"# full seed 4: {fig(110.0, 0.5)}", "Terminated",
    ]) + "\n")  # fmt: skip
    whole = tmp_path / "whole.json"
    runs = {"full": [{"samples_per_s": 100.0, "accuracy": 0.5, "gen_samples_per_s": 10.0,
                      "mean_depth": 4.0}],
            "exit": [{"samples_per_s": 200.0, "accuracy": 0.5, "gen_samples_per_s": 10.0,
                      "mean_depth": 2.0}]}  # fmt: skip
    whole.write_text(json.dumps({"arms": {a: ep.summarise(r) for a, r in runs.items()},
                                 "seeds_run": [0]}) + "\n")  # fmt: skip
    assert ep.main(["--merge", str(whole), str(log)]) == 0
    res, verdict = (json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines())
    assert res["seeds_run"] == [0, 3] and verdict["seeds"] == 2
    assert res["arms"]["exit"]["samples_per_s_seeds"] == [200.0, 160.0]
    assert verdict["samples_per_s_ratio"][0] == pytest.approx((2.0 + 1.6) / 2)
    assert verdict["accuracy_diff"][0] == pytest.approx(-0.01)
    empty = tmp_path / "empty.err"
    empty.write_text(f"# full seed 0: {fig(1.0, 0.1)}\n")
    with pytest.raises(SystemExit, match="neither an output of this benchmark nor a log"):
        ep.main(["--merge", str(empty)])


def test_loop_shares_count_prompt_positions_at_full_depth() -> None:
    """Two rows of a 4-loop model: prompts of 5 and 3 tokens (4 and 2 positions before token
    0's, at depth 4), exits (4, 1, 2) and (2, 1). Whole rows: (16 + 7) + (8 + 3) = 34 of
    (7 + 4) x 4 = 44 position-loops; the decode (tokens 1..): (1 + 2) + 1 = 4 of 3 x 4 = 12. A
    full-depth row is 1.0; a stream without full_depth takes the model's 4."""
    rows = [Row(prompt_tokens=np.zeros(5), exit_depths=np.array([4, 1, 2], np.uint8), full_depth=4),
            Row(prompt_tokens=np.zeros(3), exit_depths=np.array([2, 1], np.uint8), full_depth=0)]  # fmt: skip
    assert ep.loop_shares(rows) == (pytest.approx(34 / 44), pytest.approx(4 / 12))
    full = [Row(prompt_tokens=np.zeros(5), exit_depths=np.full(3, 4, np.uint8), full_depth=4)]
    assert ep.loop_shares(full) == (1.0, 1.0)
    one = [Row(prompt_tokens=np.zeros(5), exit_depths=np.array([3], np.uint8), full_depth=4)]
    assert ep.loop_shares(one) == (pytest.approx(19 / 20), 1.0)  # no decode: nothing to save


def test_verdict_states_the_compute_ceiling() -> None:
    """The exit arm's loop share goes into the verdict as the most its compute can shrink; runs
    without the figure (outputs from before it) give no ceiling and still merge."""

    def run(sps: float, share: float | None) -> dict[str, float]:
        out = {"samples_per_s": sps, "accuracy": 0.5, "gen_samples_per_s": 10.0, "mean_depth": 3.0}
        return out | ({"loop_share": share, "decode_loop_share": share / 2} if share else {})

    v = ep.verdict([run(100.0, 1.0)] * 2, [run(110.0, 0.8), run(120.0, 0.9)])
    assert v["loop_share"] == [pytest.approx(0.85), pytest.approx(0.425)]
    assert "compute can shrink at most x1.18" in v["verdict"]
    old = ep.verdict([run(100.0, None)], [run(110.0, None)])
    assert "loop_share" not in old and "ceiling" not in old["verdict"]
    summary = ep.summarise([run(100.0, 0.8), run(100.0, None)])
    assert "loop_share" not in summary and summary["samples_per_s_seeds"] == [100.0, 100.0]


def test_sft_trains_on_the_device_named() -> None:
    """`looprl sft --device`: the module moved there (cpu: as before); a CUDA device this host
    lacks is refused in one line, and an unknown one too."""
    import torch

    from models.errors import ConfigError
    from pipeline.commands.warm_start import on_device

    module = torch.nn.Linear(2, 2)
    assert on_device(module, "cpu") is module
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device=cuda: this host has no CUDA device"):
            on_device(module, "cuda")
    with pytest.raises(ConfigError, match="expected cpu or cuda"):
        on_device(module, "meta")


@pytest.mark.parametrize(("task", "completion"), [("long", 17), ("pairs", 64)])
def test_long_task_selects_its_config_and_budgets(monkeypatch: pytest.MonkeyPatch, task: str,
                                                  completion: int) -> None:  # fmt: skip
    """--task long / pairs: configs/depth_mix_long.yaml / depth_mix_pairs.yaml in every call,
    the GPU mode's cache rows the longest prompt + the completion (16 digits + EOS; 16 NAME=DIGIT
    items + EOS), the query classes read from the data."""
    import torch

    from pipeline.config.run import load_config

    args = _args(["--task", task])
    ep.check_args(args)
    assert ep.TASKS[args.task].name == f"depth_mix_{task}.yaml" and _args([]).task == "mix"
    assert ep.query_classes(args) == ["1", "2"]
    assert ep.longest_prompt(ep.TASKS[task]) == 50  # 48 one-byte characters + BOS + 1
    args = _args(["--task", task, "--device", "cuda"])
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        ep.check_args(args)
    over = ep.device_overrides(args)
    want = f"generators.max_model_len={50 + completion}"
    assert "task.max_prompt_tokens=50" in over and want in over
    base = ["generators.engine=torch", "generators.count=1", *over]
    exit_ = load_config(ep.TASKS[task], base + ep.arm_overrides("exit", 0.05, 2))
    assert exit_.rollout.max_tokens == completion and exit_.generators.depth_ticks == 2
    assert exit_.task.reward == "generator.depth_mix:reward_multi"
    scored = load_config(ep.TASKS[task], [*base, "task.reward_args={score_hops: 2}"])
    assert scored.task.reward_args == {"score_hops": 2}
