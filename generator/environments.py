"""Environments: multi-turn conversations scored turn by turn (docs/TASKS.md).

The protocol (resolved from ``task.environment = "package.module:Class"``, like a reward)::

    env = Class(config)                 # once per generator; config: a dict of scalars
    episode = env.reset(task)           # one conversation, from the work item's task dict
    turn = episode.step(text, tokens)   # the model's turn: its text and its sampled token ids
    turn.observation                    # str (one user message) or [{"role", "content"}, ...]
    turn.reward, turn.done, turn.info   # reward contribution, conversation over, scalars

The conversation's first prompt is the work item's prompt (the task row's prompt, rendered
by the task source as for a single-turn task); ``reset`` starts the environment's state from
the same row. The driver (generator.multiturn) calls ``step`` after every model turn, until
``done``, ``rollout.max_turns`` model turns, or the environment-token budget
(``rollout.max_env_tokens``) or the model length would be exceeded. The rewards of all turns
are summed into the rollout's reward.

Every ``reset`` and ``step`` runs under a per-call time limit (:class:`EnvCalls`, the
reward runner's thread rule: a call past its limit is abandoned, not stopped). A call that
raises, runs past its limit or returns something that is not a :class:`Turn` fails the
conversation: reward None, ``reward_info`` {"error", "kind": exception | timeout | invalid},
the conversation ends and the generator goes on.
"""

from __future__ import annotations

import importlib
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Scalar = str | int | float | bool | None
Messages = list[dict[str, str]]


class EnvironmentError_(ValueError):  # noqa: N801 (the builtin name is taken)
    """An environment path that cannot be loaded, or bad environment settings."""


@dataclass
class Turn:
    """What an environment answers to one model turn."""

    observation: str | Messages = ""
    """The next observation: text (one user message) or chat messages; ignored when done."""
    reward: float = 0.0
    """This turn's reward contribution (summed over the conversation)."""
    done: bool = False
    """The conversation is over."""
    info: dict[str, Scalar] = field(default_factory=dict)
    """Scalars merged into the rollout's reward_info (later turns overwrite earlier keys)."""


class Episode(Protocol):
    """One conversation's state (what ``Environment.reset`` returns)."""

    def step(self, text: str, tokens: list[int]) -> Turn: ...


class Environment(Protocol):
    """Built once per generator with its config; ``reset`` starts one conversation."""

    def reset(self, task: Mapping[str, Scalar]) -> Episode: ...


def resolve_environment(path: str, config: Mapping[str, Scalar] | None = None) -> Environment:
    """Build the environment ``package.module:Class`` with ``config`` (its one argument)."""
    mod, sep, name = path.partition(":")
    if not sep or not mod or not name:
        raise EnvironmentError_(
            f"environment {path!r}: expected package.module:Class (e.g. "
            "generator.environments:GuessNumber)"
        )
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise EnvironmentError_(f"environment {path!r} cannot be loaded: {e}") from e
    env = cls(dict(config or {}))
    if not callable(getattr(env, "reset", None)):
        raise EnvironmentError_(f"environment {path!r} has no reset(task) method")
    return env  # type: ignore[no-any-return]


Outcome = tuple[Any, dict[str, Scalar] | None]
"""(value, None) on success, (None, {"error": text, "kind": ...}) on failure."""


def _failure(kind: str, error: str) -> Outcome:
    return None, {"error": error[:2000], "kind": kind}


class EnvCalls:
    """Runs environment calls at once, each under ``timeout_s`` (threads; mode inline: in
    the caller's thread, no limit). A call past its limit is abandoned (its thread keeps
    running, counted in ``stats["abandoned"]``): the reward runner's thread mode."""

    def __init__(self, timeout_s: float = 10.0, mode: str = "thread") -> None:
        if not timeout_s > 0 or mode not in ("thread", "inline"):
            raise EnvironmentError_(
                f"environment calls need timeout_s > 0 and mode thread|inline, got "
                f"{timeout_s!r}, {mode!r}"
            )
        self.timeout_s, self.mode = timeout_s, mode
        self.stats = dict.fromkeys(("calls", "failed", "timeouts", "abandoned"), 0)

    def run(
        self, calls: Sequence[Callable[[], Any]], *, expect: type | None = None
    ) -> list[Outcome]:
        """Outcomes of ``calls`` in order; a value not of type ``expect`` is kind invalid."""
        self.stats["calls"] += len(calls)
        out: list[Outcome] = [(None, None)] * len(calls)
        if self.mode == "inline":
            for i, fn in enumerate(calls):
                out[i] = self._guard(fn, expect)
        else:
            threads = []
            for i, fn in enumerate(calls):

                def target(i: int = i, fn: Callable[[], Any] = fn) -> None:
                    out[i] = self._guard(fn, expect)

                t = threading.Thread(target=target, daemon=True, name=f"env-{i}")
                t.start()
                threads.append((i, t, time.monotonic()))
            for i, t, t0 in threads:
                t.join(max(0.0, t0 + self.timeout_s - time.monotonic()))
                if t.is_alive():
                    self.stats["timeouts"] += 1
                    self.stats["abandoned"] += 1
                    out[i] = _failure(
                        "timeout", f"environment call ran past its {self.timeout_s}s limit"
                    )
        self.stats["failed"] += sum(info is not None for _, info in out)
        return out

    @staticmethod
    def _guard(fn: Callable[[], Any], expect: type | None) -> Outcome:
        try:
            value = fn()
        except Exception as e:
            return _failure("exception", f"{type(e).__name__}: {e}")
        if expect is not None and not isinstance(value, expect):
            return _failure("invalid", f"environment returned {type(value).__name__}, "
                            f"expected {expect.__name__}")  # fmt: skip
        if isinstance(value, Turn) and not (
            isinstance(value.reward, int | float) and math.isfinite(value.reward)
        ):
            return _failure(
                "invalid", f"environment turn reward {value.reward!r}: expected a finite float"
            )
        return value, None


# ---- built-in environments ----------------------------------------------------------------
_INT = re.compile(r"-?\d+")


class GuessNumber:
    """Guess a secret integer in [low, high] from higher / lower feedback.

    task: {"secret": int, "low": int, "high": int} (generator.environments.guess_rows builds
    them). Each model turn's first integer is its guess; the answer is "higher", "lower",
    "correct" (done) or, without a number, a reminder of the range. Reward: solving on model
    turn k gives ``(max_turns - k + 1) / max_turns`` (1 for a first-turn hit), else 0; info:
    solved (0/1), guesses. config: max_turns (default 8: the rollout's bound)."""

    def __init__(self, config: Mapping[str, Scalar]) -> None:
        self.max_turns = int(config.get("max_turns", 8) or 8)

    def reset(self, task: Mapping[str, Scalar]) -> _GuessEpisode:
        try:
            secret, low, high = (int(task[k]) for k in ("secret", "low", "high"))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as e:
            raise EnvironmentError_(
                f"GuessNumber task {dict(task)!r}: needs integer secret, low and high ({e})"
            ) from None
        return _GuessEpisode(secret, low, high, self.max_turns)


@dataclass
class _GuessEpisode:
    secret: int
    low: int
    high: int
    max_turns: int
    turns: int = 0

    def step(self, text: str, tokens: list[int]) -> Turn:
        self.turns += 1
        m = _INT.search(text)
        info: dict[str, Scalar] = {"solved": 0, "guesses": self.turns}
        if m is None:
            return Turn(f"Say a number from {self.low} to {self.high}.", 0.0, False, info)
        guess = int(m.group())
        if guess == self.secret:
            score = (self.max_turns - self.turns + 1) / self.max_turns
            return Turn("correct", max(0.0, score), True, {**info, "solved": 1})
        return Turn("higher" if guess < self.secret else "lower", 0.0, False, info)


def guess_rows(count: int, low: int = 1, high: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` GuessNumber dataset rows {"id", "prompt", "secret", "low", "high"} (no
    downloads: the task's data is generated)."""
    import random

    rng = random.Random(seed)
    return [
        {
            "id": f"guess-{i}",
            "prompt": f"Guess my number from {low} to {high}.",
            "secret": rng.randint(low, high),
            "low": low,
            "high": high,
        }
        for i in range(count)
    ]


class Scripted:
    """A deterministic environment for tests and smoke runs: observation "turn K" after model
    turn K, done after ``config["turns"]`` (default 2) turns, reward ``config["reward"]``
    (default 1.0) per turn; info: turns_seen."""

    def __init__(self, config: Mapping[str, Scalar]) -> None:
        self.turns = int(config.get("turns", 2) or 2)
        self.reward = float(config.get("reward", 1.0) or 0.0)

    def reset(self, task: Mapping[str, Scalar]) -> _ScriptedEpisode:
        return _ScriptedEpisode(self.turns, self.reward)


@dataclass
class _ScriptedEpisode:
    turns: int
    reward: float
    seen: int = 0

    def step(self, text: str, tokens: list[int]) -> Turn:
        self.seen += 1
        done = self.seen >= self.turns
        return Turn(f"turn {self.seen}", self.reward, done, {"turns_seen": self.seen})
