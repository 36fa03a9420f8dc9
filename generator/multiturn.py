"""The multi-turn driver: every sample of a work item is one conversation with an environment.

``MultiTurnEngine(engine, env, renderer, ...)`` is an Engine (generator.collaborators) around the
LoopedEngine or TorchEngine: ``generate(items)`` returns, per item and latent seed, one
Sample holding the whole conversation after the first prompt (the multi-turn wire
contract: `Rollout.token_mask`), in rounds::

    reset every conversation (generator.environments.EnvCalls: per-call limits)
    while some conversation goes on:
        one engine.generate over ALL of them: the prompt is the conversation so far (first
        prompt + every sampled and observation id, never re-tokenized), the SAME latent seed
        (the latent noise is a function of (seed, absolute position): contract 1), and
        sampling-seed offset = the turn (0, 1, ...; models.reference.sampling_seed), so a
        turn never reuses an earlier turn's random numbers
        step every environment at once with the turn's text and sampled ids
        append the observation's ids (models.chat.ChatRenderer.continuation), mask 0,
        log-prob 0.0, exit depth = full depth (prompt-like positions)

A conversation ends when its environment says done, after ``max_turns`` model turns, when
the next observation would pass ``max_env_tokens`` environment tokens (info
``env_budget``=1), when its model-token budget is used or the next turn would not fit
``max_model_len`` (finish_reason "length", info ``length``=1), or when an environment call
fails (reward None, info error/kind; the generator goes on). The work item's ``max_tokens``
is the budget of the WHOLE conversation's model tokens (what the door's too_long and the
learner's overlong shaping count): each turn samples at most ``max_tokens`` minus the model
tokens so far (and what fits ``max_model_len``); the environment still scores the turn that
used the budget up. The reward is the sum of the turns' contributions; reward_info gets
``turns``, ``env_tokens`` and the environment's info.
Contract 2 holds because the exit policy is fixed-depth (pipeline config refuses an
adaptive one with an environment): a re-prefilled model token runs the depth it sampled at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from generator.engine import Sample
from generator.environments import EnvCalls, Environment, Scalar, Turn
from proto.records import WorkItem
from weights.verified import VerifiedWeights


@dataclass
class _Conversation:
    item: WorkItem
    seed: int
    episode: Any = None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    weight_version: int = -1
    finish_reason: str = "length"
    reward: float | None = 0.0
    info: dict[str, Scalar] = field(default_factory=dict)
    turns: int = 0
    env_tokens: int = 0
    done: bool = False
    last_turn: list[int] = field(default_factory=list)
    model_tokens: int = 0
    full_depth: int = 0
    """The depth of the engine that ran it (an eval_depth item's engine: that depth)."""

    def budget(self) -> int:
        """Model tokens this conversation may still sample (the item's max_tokens, all turns)."""
        return int(self.item.max_tokens) - self.model_tokens

    def fail(self, info: dict[str, Scalar]) -> None:
        self.reward, self.done = None, True
        self.info.update(info)


class MultiTurnEngine:
    """An Engine whose samples are conversations (see the module doc)."""

    def __init__(
        self,
        engine: Any,
        env: Environment,
        renderer: Any,
        *,
        max_turns: int = 8,
        max_env_tokens: int = 512,
        max_model_len: int = 1024,
        calls: EnvCalls | None = None,
        detokenize: Any = None,
    ) -> None:
        if max_turns < 1 or max_env_tokens < 0 or max_model_len < 2:
            raise ValueError("need max_turns >= 1, max_env_tokens >= 0, max_model_len >= 2")
        self.engine, self.env, self.renderer = engine, env, renderer
        self.max_turns, self.max_env_tokens = max_turns, max_env_tokens
        self.max_model_len = max_model_len
        self.calls = calls or EnvCalls()
        self.detokenize = detokenize or renderer.decode
        self.full_depth = int(getattr(engine, "full_depth", 1))

    def __getattr__(self, name: str) -> Any:  # looped, close, ...: the engine's
        return getattr(self.engine, name)

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def load_weights(self, weights: VerifiedWeights) -> None:
        self.engine.load_weights(weights)

    def generate(self, items: Sequence[WorkItem]) -> list[list[Sample]]:
        convs = [[_Conversation(it, int(s)) for s in it.latent_seeds] for it in items]
        flat = [c for group in convs for c in group]
        outs = self.calls.run([partial(self.env.reset, dict(c.item.task)) for c in flat])
        for c, (episode, err) in zip(flat, outs):
            if err is not None:
                c.fail(err)
            c.episode = episode
        while live := [c for c in flat if not c.done]:
            self._turn(live)
        return [[self._sample(c) for c in group] for group in convs]

    def _turn(self, live: list[_Conversation]) -> None:
        subs = []
        for c in live:
            prompt = [*(int(t) for t in c.item.prompt_tokens), *c.tokens]
            # >= 1 after the first turn (_turn ends a spent budget, _observe keeps a free
            # position); a first prompt too long for the engine is the engine's error
            room = max(1, min(c.budget(), self.max_model_len - len(prompt)))
            subs.append(dataclasses.replace(
                c.item, work_id=f"{c.item.work_id}@{c.seed}#{c.turns}",
                prompt_tokens=np.asarray(prompt, np.int32),
                latent_seeds=np.asarray([c.seed], np.uint64), sample_indices=[],
                max_tokens=room,
            ))  # fmt: skip
        samples = self.engine.generate(subs, sampling_offsets=[c.turns for c in live])
        for c, group in zip(live, samples):
            s = group[0]
            ids = [int(t) for t in s.tokens]
            if c.weight_version < 0:
                c.weight_version = int(s.weight_version)
                c.full_depth = int(s.full_depth) or self.full_depth
            versions = (
                s.token_versions if s.token_versions is not None else [s.weight_version] * len(ids)
            )
            c.tokens += ids
            c.mask += [1] * len(ids)
            c.logprobs += [float(x) for x in s.logprobs]
            c.depths += [int(x) for x in s.exit_depths]
            c.versions += [int(v) for v in versions]
            c.finish_reason, c.last_turn = str(s.finish_reason), ids
            c.turns += 1
            c.model_tokens += len(ids)
        texts = [self.detokenize(c.last_turn) for c in live]
        outs = self.calls.run(
            [partial(c.episode.step, t, list(c.last_turn)) for c, t in zip(live, texts)],
            expect=Turn,
        )
        for c, (turn, err) in zip(live, outs):
            if err is not None:
                c.fail(err)
                continue
            assert c.reward is not None
            c.reward += float(turn.reward)
            c.info.update(turn.info)
            if turn.done or c.turns >= self.max_turns:
                c.done = True
                continue
            if c.budget() <= 0:  # the conversation's model tokens are spent
                c.done, c.finish_reason, c.info["length"] = True, "length", 1
                continue
            self._observe(c, turn)

    def _observe(self, c: _Conversation, turn: Turn) -> None:
        try:
            ids = self.renderer.continuation(turn.observation, c.last_turn)
        except ValueError as e:  # a malformed observation: the environment's failure
            c.fail({"error": f"observation: {e}"[:2000], "kind": "invalid"})
            return
        if c.env_tokens + len(ids) > self.max_env_tokens:
            c.done, c.info["env_budget"] = True, 1
            return
        if len(c.item.prompt_tokens) + len(c.tokens) + len(ids) + 1 > self.max_model_len:
            c.done, c.finish_reason, c.info["length"] = True, "length", 1
            return
        c.tokens += ids
        c.mask += [0] * len(ids)
        c.logprobs += [0.0] * len(ids)
        c.depths += [c.full_depth or self.full_depth] * len(ids)
        c.versions += [c.versions[-1] if c.versions else self.weight_version] * len(ids)
        c.env_tokens += len(ids)

    def _sample(self, c: _Conversation) -> Sample:
        versions = np.asarray(c.versions, np.int64)
        inflight = bool(getattr(self.engine, "inflight_updates", False))
        info = {**c.info, "turns": c.turns, "env_tokens": c.env_tokens}
        return Sample(
            tokens=np.asarray(c.tokens, np.int32),
            logprobs=np.asarray(c.logprobs, np.float32),
            exit_depths=np.asarray(c.depths, np.uint8),
            latent_seed=c.seed,
            weight_version=c.weight_version if c.weight_version >= 0 else self.weight_version,
            token_versions=versions if inflight else None,
            finish_reason=c.finish_reason,
            full_depth=c.full_depth or self.full_depth,
            token_mask=np.asarray(c.mask, np.uint8),
            reward=c.reward,
            reward_info=info,
        )


def replay_conversation(
    env: Environment,
    renderer: Any,
    task: dict[str, Any],
    tokens: Sequence[int],
    mask: Sequence[int] | None,
    calls: EnvCalls | None = None,
) -> tuple[float | None, dict[str, Scalar]]:
    """Score a recorded conversation again with ``env`` (the learner's check of eval rewards,
    pipeline.core.eval_rounds.environment_rescorer): reset from ``task``, then each model turn
    (a run of mask 1; no mask: one turn) stepped with its decoded text and ids, in order, the
    turns' rewards summed as the driver sums them. Every recorded observation (a run of mask 0)
    must be exactly ``renderer.continuation`` of what the environment answers to the turn
    before it, and the environment must not end the conversation before its last turn; else
    the transcript is not this environment's (a generator's invention, or an environment that
    is not deterministic): reward 0.0 with info ``env_mismatch`` 1 and ``error``. A failed
    call: (None, {"error", "kind"}) as on the generator."""
    calls = calls or EnvCalls(mode="inline")
    ids = [int(t) for t in tokens]
    m = [1] * len(ids) if mask is None else [int(x) for x in mask]
    runs: list[tuple[int, int, int]] = []  # (mask value, start, end)
    for i, v in enumerate(m):
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1], i + 1)
        else:
            runs.append((v, i, i + 1))
    (episode, err), = calls.run([partial(env.reset, dict(task))])  # fmt: skip
    if err is not None:
        return None, err
    reward = 0.0
    info: dict[str, Scalar] = {}
    turns = 0

    def mismatch(why: str) -> tuple[float, dict[str, Scalar]]:
        return 0.0, {**info, "env_mismatch": 1, "correct": 0, "error": why[:2000]}

    for k, (v, a, b) in enumerate(runs):
        if v == 0:
            continue
        turns += 1
        turn_ids = ids[a:b]
        (turn, err), = calls.run([partial(episode.step, renderer.decode(turn_ids), turn_ids)],
                                 expect=Turn)  # fmt: skip
        if err is not None:
            return None, {**info, **err}
        reward += float(turn.reward)
        info.update(turn.info)
        rest = runs[k + 1 :]
        if not rest:
            break
        if turn.done:
            return mismatch(f"the environment ended the conversation after model turn {turns}, "
                            f"the transcript goes on for {len(rest)} more run(s)")  # fmt: skip
        try:
            want = [int(t) for t in renderer.continuation(turn.observation, turn_ids)]
        except ValueError as e:
            return mismatch(f"observation after model turn {turns}: {e}")
        got = ids[rest[0][1] : rest[0][2]] if rest[0][0] == 0 else []
        if got != want:
            return mismatch(f"the observation after model turn {turns} is {len(got)} ids, the "
                            f"environment's renders as {len(want)} ids that differ")  # fmt: skip
    return reward, {**info, "turns": turns, "env_tokens": m.count(0)}
