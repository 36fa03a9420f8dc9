"""The multi-turn driver on a real vLLM engine: a tiny fixed-depth Huginn,
one engine for the module, a deterministic environment (generator.environments.Scripted)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from generator.engine import LoopedEngine, to_rollouts
from generator.environments import EnvCalls, Scripted, Turn
from generator.multiturn import MultiTurnEngine
from models.chat import ChatRenderer
from models.checkpoint import load_model
from models.exits import FixedDepth
from models.random_init import init_checkpoint
from models.reference import ReplayItem, replay
from pipeline.core.validation import DoorRules, Expected, ModelLimits, check_rollout
from tests.generator import work_item

STOPS = list(range(3, 512, 2))
"""Odd ids end a turn: a random tiny model's turns are ~2 tokens, so a conversation has
several turns before its model-token budget (the item's max_tokens, all turns) is spent."""


def talk(renderer: ChatRenderer, text: str, seeds: list[int], max_tokens: int, name: str) -> Any:
    """A work item whose turns stop at STOPS, ``max_tokens`` model tokens in all."""
    it = work_item(renderer.render(text), seeds, max_tokens=max_tokens, name=name)
    it.stop_token_ids = STOPS
    return it


def door_refusals(path: Path, mt: MultiTurnEngine, item: Any, samples: list[Any]) -> list[str]:
    """What the learner's door (pipeline.core.validation) says of the conversations, under
    the run's rules for mt's limits (rollout.max_turns, rollout.max_env_tokens)."""
    rules = DoorRules(reward_bound=100.0, environment=True, max_turns=mt.max_turns,
                      max_env_tokens=mt.max_env_tokens)  # fmt: skip
    limits = ModelLimits.from_checkpoint(path)
    out = []
    for r in to_rollouts(item, samples, "g"):
        exp = Expected(prompt_id=item.prompt_id, prompt_tokens=item.prompt_tokens.tolist(),
                       latent_seed=int(r.latent_seed), max_tokens=int(item.max_tokens),
                       min_version=0, max_version=0, sender="g")  # fmt: skip
        why = check_rollout(r, expect=exp, limits=limits, rules=rules)
        if why is not None:
            out.append(str(why))
    return out


class Counting:
    """The engine, counting its generate calls and the requests in each."""

    def __init__(self, engine: LoopedEngine) -> None:
        self.engine = engine
        self.calls: list[int] = []
        self.asked: list[list[int]] = []  # each call's max_tokens, per request

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, items: list[Any], sampling_offsets: Any = None) -> Any:
        self.calls.append(sum(it.n for it in items))
        self.asked.append([int(it.max_tokens) for it in items])
        return self.engine.generate(items, sampling_offsets=sampling_offsets)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LoopedEngine]]:
    path = init_checkpoint("huginn", "tiny", tmp_path_factory.mktemp("mt") / "huginn")
    engine = LoopedEngine(path, numerics="fast", exit_policy=FixedDepth(3),
                          kv_cache_bytes=16 << 20, max_model_len=256, max_num_seqs=8)  # fmt: skip
    yield path, engine
    engine.close()


def _segments(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    edges = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(mask)]
    return [(int(mask[a]), a, b) for a, b in zip(edges, edges[1:])]


def test_conversations_carry_sampled_ids_env_ids_and_replay_in_one_pass(setup: Any) -> None:
    path, engine = setup
    renderer = ChatRenderer.from_checkpoint(path)
    counted = Counting(engine)
    mt = MultiTurnEngine(counted, Scripted({"turns": 3, "reward": 0.5}), renderer,
                         max_turns=8, max_env_tokens=200, max_model_len=256)  # fmt: skip
    items = [
        talk(renderer, "Guess my number.", [11, 12], max_tokens=40, name="a"),
        talk(renderer, "Count to three.", [13, 14], max_tokens=40, name="b"),
    ]
    samples = mt.generate(items)
    # all four conversations in flight together: 3 rounds of 4 requests, not 12 calls of 1
    assert counted.calls == [4, 4, 4]
    model = load_model(path)[1]
    drifted = 0
    for item, group in zip(items, samples):
        for s in group:
            assert s.reward == pytest.approx(1.5) and s.reward_info is not None
            assert s.reward_info["turns"] == 3 and s.reward_info["turns_seen"] == 3
            runs = _segments(s.token_mask)
            assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]  # turn, obs, turn, obs, turn
            env = s.token_mask == 0
            assert s.reward_info["env_tokens"] == int(env.sum())
            assert (s.logprobs[env] == 0).all() and (s.exit_depths[env] == 3).all()
            assert (s.exit_depths == 3).all()  # fixed depth: every position runs 3
            for k, (v, a, b) in enumerate(runs):  # each observation rendered incrementally
                if v == 0:
                    turn = s.tokens[runs[k - 1][1] : runs[k - 1][2]].tolist()
                    assert s.tokens[a:b].tolist() == renderer.continuation(
                        f"turn {k // 2 + 1}", turn
                    )
            # the sampled ids, not a re-tokenization of their text
            for v, a, b in runs:
                ids = s.tokens[a:b].tolist()
                if (
                    v == 1
                    and renderer.tokenizer.encode(
                        renderer.decode(ids), add_special_tokens=False
                    ).ids
                    != ids
                ):
                    drifted += 1
            # one reference pass over the whole conversation gives the model tokens' log-probs
            (r,) = replay(model, [ReplayItem(item.prompt_tokens.tolist(), s.tokens.tolist(),
                          s.latent_seed, s.exit_depths.tolist(), 3)],
                          temperature=item.temperature, top_p=item.top_p, numerics="fast")  # fmt: skip
            model_pos = torch.from_numpy(s.token_mask == 1)
            diff = (torch.from_numpy(s.logprobs) - r.logprobs)[model_pos].abs().max().item()
            assert diff <= 1e-4, diff
            assert int(s.token_mask.sum()) <= 40
        assert door_refusals(path, mt, item, group) == []
    print(f"\nmodel turns that re-tokenize differently: {drifted} of 12")
    assert drifted > 0  # a random tiny model's turns: re-tokenizing would have drifted
    rolls = to_rollouts(items[0], samples[0], "g")
    assert rolls[0].reward == pytest.approx(1.5) and rolls[0].reward_info["turns"] == 3
    assert np.array_equal(rolls[0].tokens, samples[0][0].tokens)
    assert rolls[0].token_mask is not None
    assert np.array_equal(rolls[0].token_mask, samples[0][0].token_mask)


def test_a_failing_or_hung_environment_ends_its_conversation_only(setup: Any) -> None:
    import time

    path, engine = setup
    renderer = ChatRenderer.from_checkpoint(path)

    class Env:
        def reset(self, task: Any) -> Any:
            return Ep(int(task["mode"]))

    class Ep:
        def __init__(self, mode: int) -> None:
            self.mode, self.k = mode, 0

        def step(self, text: str, tokens: list[int]) -> Turn:
            self.k += 1
            if self.mode == 1 and self.k == 2:
                raise RuntimeError("broken env")
            if self.mode == 2:
                time.sleep(2.0)
            return Turn("more", 1.0, self.k >= 3)

    mt = MultiTurnEngine(engine, Env(), renderer, max_turns=8, max_env_tokens=200,
                         max_model_len=256, calls=EnvCalls(timeout_s=0.5))  # fmt: skip
    items = []
    for mode in (0, 1, 2):
        it = talk(renderer, "Hi.", [30 + mode], max_tokens=40, name=f"m{mode}")
        it.task = {"mode": mode}
        items.append(it)
    ok, broke, hung = (g[0] for g in mt.generate(items))
    assert ok.reward == 3.0 and ok.reward_info["turns"] == 3
    assert broke.reward is None and broke.reward_info["kind"] == "exception"
    assert broke.reward_info["turns"] == 2 and "broken env" in broke.reward_info["error"]
    assert hung.reward is None and hung.reward_info["kind"] == "timeout"
    assert hung.reward_info["turns"] == 1 and (hung.token_mask == 1).all()


def test_budgets_end_a_conversation_and_the_door_accepts_it(setup: Any) -> None:
    """Each limit ends a conversation within it (environment tokens, model turns, the item's
    max_tokens over ALL turns, max_model_len) and the door accepts what the driver made."""
    path, engine = setup
    renderer = ChatRenderer.from_checkpoint(path)
    seeds = [41, 42, 43, 44]
    item = talk(renderer, "Hi.", seeds, max_tokens=60, name="bud")
    obs = len(renderer.continuation("turn 1", [2]))
    mt = MultiTurnEngine(engine, Scripted({"turns": 5}), renderer, max_turns=8,
                         max_env_tokens=obs + 3, max_model_len=256)  # fmt: skip
    group = mt.generate([item])[0]
    for s in group:
        assert s.reward_info["env_budget"] == 1 and s.reward_info["turns"] == 2
        assert s.reward_info["env_tokens"] <= obs + 3
    assert door_refusals(path, mt, item, group) == []
    mt = MultiTurnEngine(engine, Scripted({"turns": 5}), renderer, max_turns=2,
                         max_env_tokens=500, max_model_len=256)  # fmt: skip
    group = mt.generate([item])[0]
    for s in group:
        assert s.reward_info["turns"] == 2 and s.reward == 2.0
        assert "env_budget" not in s.reward_info and "length" not in s.reward_info
    assert door_refusals(path, mt, item, group) == []

    # the model-token budget: 7 model tokens over all turns, each turn asked for what is left
    counted = Counting(engine)
    budget = talk(renderer, "Hi.", seeds, max_tokens=7, name="tok")
    mt = MultiTurnEngine(counted, Scripted({"turns": 50}), renderer, max_turns=50,
                         max_env_tokens=5000, max_model_len=256)  # fmt: skip
    group = mt.generate([budget])[0]
    turns = []
    for s in group:
        model = int(s.token_mask.sum())
        assert model == 7 and s.finish_reason == "length" and s.reward_info["length"] == 1
        turns.append(int(s.reward_info["turns"]))
        assert s.reward == float(s.reward_info["turns"])  # the turn that spent it is scored
    print(f"\nturns within a 7-token budget: {turns}; asked per round: {counted.asked}")
    assert max(turns) >= 3  # several turns shared the budget
    for r, asked in enumerate(counted.asked):  # round r asks each live one for what is left
        live = [s for s, t in zip(group, turns) if t > r]
        left = [7 - _model_tokens_before(s, r) for s in live]
        assert asked == left, (r, asked, left)
    assert door_refusals(path, mt, budget, group) == []
    tight = dataclasses.replace(budget, max_tokens=6)  # the door counts the same tokens
    assert all("too_long: 7 model tokens > max_tokens 6" in w
               for w in door_refusals(path, mt, tight, group))  # fmt: skip

    # max_model_len: the whole conversation (first prompt included) stays within it
    room = len(item.prompt_tokens) + 3 * obs + 6
    mt = MultiTurnEngine(engine, Scripted({"turns": 50}), renderer, max_turns=50,
                         max_env_tokens=5000, max_model_len=room)  # fmt: skip
    group = mt.generate([item])[0]
    for s in group:
        assert s.reward_info["length"] == 1 and s.finish_reason == "length"
        assert len(item.prompt_tokens) + len(s.tokens) <= room
    assert door_refusals(path, mt, item, group) == []


def _model_tokens_before(s: Any, turn: int) -> int:
    """Model tokens of the sample's first ``turn`` turns (runs of mask 1)."""
    runs = [b - a for v, a, b in _segments(s.token_mask) if v == 1]
    return sum(runs[:turn])
