"""The multi-turn example (configs/guess.yaml, docs/TASKS.md "Multi-turn and tools"): its data
is what generator.environments.guess_rows writes; the run keys task.environment,
rollout.max_turns and rollout.max_env_tokens reach the generators (flags parsed back give the
config the run meant) and `looprl generator` drives its engine as conversations; a shortened
run through the real `looprl run` (learner, warm start, generator process, vLLM) records
conversations (token_mask with environment tokens) and trains on them, and its stream replays
to the same weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from generator.config import GeneratorConfig
from generator.environments import GuessNumber, guess_rows
from models.chat import ChatRenderer, eos_token_ids
from models.errors import ConfigError
from models.random_init import init_checkpoint
from pipeline.commands.generator_cli import add_parser, config_from_args
from pipeline.commands.generator_engine import multi_turn
from pipeline.commands.generator_flags import config_argv, generator_config
from pipeline.commands.warm_start import sft_examples
from pipeline.config.run import load_config
from tests.cli.test_run_llama import looprl_run
from tests.generator import work_item

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "guess.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = load_config(CONFIG)
    out = tmp_path_factory.mktemp("init") / "m"
    return init_checkpoint(cfg.model.family, cfg.model.size, out, seed=cfg.model.init_seed)


def test_committed_data_is_guess_rows() -> None:
    data = REPO / load_config(CONFIG).task.path
    for split, n, seed in (("train", 1000, 0), ("test", 100, 1)):
        rows = [json.loads(x) for x in (data / f"{split}.jsonl").read_text().splitlines()]
        want = [{**r, "id": f"{split}-{r['id']}", "answer": str(r["secret"])}
                for r in guess_rows(n, 1, 3, seed=seed)]  # fmt: skip
        assert rows == want
    secrets = [r["secret"] for r in want]
    assert sorted(set(secrets)) == [1, 2, 3]


def test_conversations_fit_the_example_budgets(tiny: Path) -> None:
    """A turn ends at the first digit (stop_token_ids are the tokenizer's "0".."9"), so two
    answers " N" fit rollout.max_tokens exactly; the longest observation fits
    rollout.max_env_tokens, and the first prompt plus both fit max_model_len."""
    cfg = load_config(CONFIG)
    r = cfg.rollout
    examples = sft_examples(cfg, tiny)
    assert len(examples) == 1000
    renderer = ChatRenderer.from_checkpoint(tiny)
    assert [renderer.decode([t]) for t in r.stop_token_ids] == [str(d) for d in range(10)]
    eos = eos_token_ids(tiny)
    env = GuessNumber({"max_turns": r.max_turns})
    for prompt, target in examples:  # " N<|eos|>": the digit stops a turn before the EOS
        assert target[-1] in eos and target[-2] in r.stop_token_ids
        assert r.max_turns * (len(target) - 1) == r.max_tokens
        assert len(prompt) + r.max_tokens + r.max_env_tokens <= cfg.generators.max_model_len
    digit = r.stop_token_ids[2]
    longest = max(len(renderer.continuation(t, [digit]))
                  for t in ("higher", "lower", "Say a number from 1 to 3."))  # fmt: skip
    assert (r.max_turns - 1) * longest <= r.max_env_tokens
    assert cfg.task.environment == "generator.environments:GuessNumber" and cfg.eval.every == 0
    assert env.max_turns == r.max_turns == 2


def test_environment_keys_reach_the_generators(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    meant = generator_config(cfg, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", tmp_path / "m", 0)
    assert (meant.environment, meant.max_turns, meant.max_env_tokens) == (
        "generator.environments:GuessNumber", 2, 32)  # fmt: skip
    argv = config_argv(meant)
    assert argv[argv.index("--environment") + 1] == "generator.environments:GuessNumber"
    assert argv[argv.index("--max-turns") + 1] == "2"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["generator", *argv])) == meant
    single = generator_config(load_config(None), "tcp://h:5", "tcp://h:6", tmp_path / "m", 0)
    assert single.environment == "" and "--environment" not in config_argv(single)
    for bad, msg in (
        ("generators.environment=a.b:C", r"generators\.environment=.*task\.environment"),
        ("generators.max_turns=2", r"generators\.max_turns=2: set by looprl run from "
         r"rollout\.max_turns"),
        ("task.reward=math", r"task\.reward='math': task\.environment .*not both"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            load_config(CONFIG, [bad])
    for key, value in (("environment", "no_class_here"), ("max_turns", 0),
                       ("max_env_tokens", 0)):  # fmt: skip
        with pytest.raises(ConfigError, match=f"generator config {key}="):
            GeneratorConfig(**{key: value})  # type: ignore[arg-type]


def test_the_generator_drives_its_engine_as_conversations(tiny: Path) -> None:
    """`looprl generator --environment ...`'s engine (pipeline.commands.generator_cli.multi_turn)
    around the torch engine: GuessNumber conversations within the flags' limits, the
    checkpoint's context length (Huginn's block_size) when max_model_len is 0."""
    from generator.environments import resolve_environment
    from generator.torch_engine.engine import TorchEngine

    cfg = GeneratorConfig(model=str(tiny), engine="torch", environment="generator."
                          "environments:GuessNumber", max_turns=3, max_env_tokens=60)  # fmt: skip
    env = resolve_environment(cfg.environment, {"max_turns": cfg.max_turns})
    mt = multi_turn(cfg, TorchEngine(tiny, max_model_len=None), env)
    assert (mt.max_turns, mt.max_env_tokens, mt.max_model_len) == (3, 60, 512)
    renderer = ChatRenderer.from_checkpoint(tiny)
    item = work_item(renderer.render("Guess my number from 1 to 8."), [1, 2, 3, 4],
                     max_tokens=12, name="g")  # fmt: skip
    item = dataclasses.replace(item, stop_token_ids=list(range(3, 512, 2)),
                               task={"secret": 5, "low": 1, "high": 8})  # fmt: skip
    samples = mt.generate([item])[0]
    assert len(samples) == 4
    for s in samples:
        assert s.token_mask is not None and s.reward_info is not None
        assert int(s.token_mask.sum()) <= 12 and 1 <= s.reward_info["turns"] <= 3
        assert int((s.token_mask == 0).sum()) == s.reward_info["env_tokens"] <= 60
        assert s.reward_info["solved"] in (0, 1) and s.reward is not None
    assert any(s.reward_info["turns"] > 1 for s in samples)
    assert any((s.token_mask == 0).any() for s in samples)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_short_guess_run_trains_on_conversations_and_replays(tmp_path: Path) -> None:
    """configs/guess.yaml, 3 steps and one generator, through `looprl run` as a user runs it:
    every recorded rollout is a conversation within the example's limits (model tokens <= 4,
    <= 2 turns, <= 32 environment tokens at log-prob 0 and full depth), its reward is
    GuessNumber's, the learner trained 3 versions, and `looprl replay` of the stream
    reaches each version's digest."""
    from pipeline.commands.replay_main import replay
    from pipeline.core.recorder import read_rollouts

    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(run_dir, "steps=3", "generators.count=1", config=CONFIG,
                                 timeout_s=480)  # fmt: skip
    assert code == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 3 and s["final_version"] == 3
    rolls = [r for _, r in read_rollouts(run_dir / "stream")]
    assert len(rolls) >= 3 * 16 * 8
    multi = 0
    for r in rolls:
        assert r.token_mask is not None and r.token_mask.shape == r.tokens.shape
        env = r.token_mask == 0
        turns, solved = int(r.reward_info["turns"]), int(r.reward_info["solved"])
        assert int(r.token_mask.sum()) <= 4 and 1 <= turns <= 2
        assert int(env.sum()) == r.reward_info["env_tokens"] <= 32
        assert (r.logprobs[env] == 0.0).all() and (r.exit_depths[env] == r.full_depth).all()
        assert r.reward == (pytest.approx((2 - turns + 1) / 2) if solved else 0.0)
        multi += int(env.any())
    print(f"\nguess run: 3 steps in {wall:.0f} s, {multi} of {len(rolls)} rollouts multi-turn, "
          f"solved {np.mean([r.reward_info['solved'] for r in rolls]):.2f}")  # fmt: skip
    assert multi >= len(rolls) // 2  # a first-turn miss (2 in 3) gets an observation
    res = replay(run_dir / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
