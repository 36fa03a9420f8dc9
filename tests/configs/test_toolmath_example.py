"""The tool-use example (configs/toolmath.yaml, docs/TASKS.md "Tool math"): its data is what
`python -m generator.tools.toolmath` writes; the example's budgets fit a tool call, its result
and the answer; a shortened run through the real `looprl run` (warm start, learner, a vLLM
generator process, the ToolMath environment with the real calculator, eval rounds scored again
on the learner by the environment) trains on conversations and its stream replays to the same
weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from generator.tools.toolmath import SPLITS, ToolMath, toolmath_rows, write_data
from models.chat import ChatRenderer, eos_token_ids
from models.random_init import init_checkpoint
from pipeline.commands.warm_start import sft_examples
from pipeline.config.run import load_config
from tests.cli.test_run_llama import looprl_run

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "toolmath.yaml"


def test_committed_data_is_what_the_command_writes(tmp_path: Path) -> None:
    data = REPO / load_config(CONFIG).task.path
    write_data(tmp_path)
    for split, (n, seed, teach) in SPLITS.items():
        committed = (data / f"{split}.jsonl").read_text()
        assert committed == (tmp_path / f"{split}.jsonl").read_text()
        rows = [json.loads(x) for x in committed.splitlines()]
        want = toolmath_rows(n, seed, teach=teach)
        assert [r["id"] for r in rows] == [f"{split}-{w['id']}" for w in want]
    assert {r["kind"] for r in rows} == {"ask"}  # the test split only asks


def test_conversations_fit_the_example_budgets(tmp_path: Path) -> None:
    """The longest first prompt + rollout.max_tokens + rollout.max_env_tokens fit
    max_model_len; a tool call and its answer (each with EOS) fit max_tokens; the longest
    calculator result renders within max_env_tokens per turn it can follow."""
    cfg = load_config(CONFIG)
    r = cfg.rollout
    tiny = init_checkpoint(cfg.model.family, cfg.model.size, tmp_path / "m",
                           seed=cfg.model.init_seed)  # fmt: skip
    examples = sft_examples(cfg, tiny)
    assert len(examples) == 1200
    renderer = ChatRenderer.from_checkpoint(tiny)
    eos = eos_token_ids(tiny)
    longest = max(len(p) for p, _ in examples)
    assert longest + r.max_tokens + r.max_env_tokens <= cfg.generators.max_model_len
    call = [*renderer.tokenizer.encode(" calc 9*9", add_special_tokens=False).ids, *eos]
    answer = [*renderer.tokenizer.encode(" 81", add_special_tokens=False).ids, *eos]
    assert len(call) + len(answer) <= r.max_tokens
    obs = renderer.continuation(ToolMath({}).reset({"result": 81}).step(" calc 9*9", call)
                                .observation, call)  # fmt: skip
    assert (r.max_turns - 1) * len(obs) <= r.max_env_tokens
    assert cfg.task.environment == "generator.tools.toolmath:ToolMath"


@pytest.mark.vllm
@pytest.mark.slow
def test_a_short_toolmath_run_trains_on_conversations_evaluates_and_replays(
    tmp_path: Path,
) -> None:
    """configs/toolmath.yaml shortened (a 6-step warm start, 3 RL steps, one generator) with
    eval rounds on 8 test questions: every recorded rollout is a conversation within the
    example's limits whose reward is the environment's verdict (1 exactly when correct),
    observations at log-prob 0 and full depth; eval/accuracy comes from the learner's own
    replay of the eval conversations through ToolMath (no mismatch), and `looprl replay` of
    the stream reaches each version's digest."""
    from pipeline.commands.replay_main import replay
    from pipeline.core.recorder import read_rollouts

    run_dir = tmp_path / "run"
    code, err, wall = looprl_run(run_dir, "steps=3", "generators.count=1",
                                 "warm_start.segments=[6]", "eval.every=2", "eval.limit=8",
                                 config=CONFIG, timeout_s=540)  # fmt: skip
    assert code == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 3 and s["final_version"] == 3
    rolls = [r for _, r in read_rollouts(run_dir / "stream")]
    assert len(rolls) >= 3 * 16 * 8
    for r in rolls:
        assert r.token_mask is not None and r.token_mask.shape == r.tokens.shape
        env = r.token_mask == 0
        assert int(r.token_mask.sum()) <= 16 and 1 <= int(r.reward_info["turns"]) <= 3
        assert int(env.sum()) == r.reward_info["env_tokens"] <= 48
        assert (r.logprobs[env] == 0.0).all() and (r.exit_depths[env] == r.full_depth).all()
        assert r.reward == float(r.reward_info["correct"])
    calls = int(sum(int(r.reward_info["tool_calls"]) > 0 for r in rolls))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["eval/prompts"] for m in evals] == [8, 8, 8]  # steps 0 (reported 1), 2, 3
    assert all(0.0 <= m["eval/accuracy"] <= 1.0 for m in evals)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "claims reward" not in log  # no eval claim differed from the learner's replay
    print(f"\ntoolmath run: 3 steps in {wall:.0f} s, {calls} of {len(rolls)} conversations "
          f"call a tool, solved {np.mean([r.reward for r in rolls]):.2f}, eval accuracy "
          f"{[round(m['eval/accuracy'], 2) for m in evals]}")  # fmt: skip
    res = replay(run_dir / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
