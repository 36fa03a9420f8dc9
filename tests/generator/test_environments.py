"""generator.environments: the protocol's loader, per-call limits and the built-in games."""

from __future__ import annotations

import time

import pytest

from generator.environments import (
    EnvCalls,
    EnvironmentError_,
    GuessNumber,
    Scripted,
    Turn,
    guess_rows,
    resolve_environment,
)


def test_resolve_builds_the_class_with_its_config_and_names_a_bad_path() -> None:
    env = resolve_environment("generator.environments:Scripted", {"turns": 3})
    assert isinstance(env, Scripted) and env.turns == 3
    with pytest.raises(EnvironmentError_, match="expected package.module:Class"):
        resolve_environment("generator.environments.Scripted")
    with pytest.raises(EnvironmentError_, match="cannot be loaded"):
        resolve_environment("generator.environments:NoSuchEnv")


def test_calls_fail_by_kind_and_a_hung_call_is_cut_at_its_limit() -> None:
    calls = EnvCalls(timeout_s=0.3)

    def boom() -> Turn:
        raise RuntimeError("env broke")

    t0 = time.monotonic()
    out = calls.run(
        [lambda: Turn("ok", 0.5), boom, lambda: time.sleep(3.0), lambda: "not a turn",
         lambda: Turn("x", float("nan"))],
        expect=Turn,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert out[0][0].reward == 0.5 and out[0][1] is None
    assert out[1] == (None, {"error": "RuntimeError: env broke", "kind": "exception"})
    assert out[2][1] is not None and out[2][1]["kind"] == "timeout"
    assert out[3][1] is not None and out[3][1]["kind"] == "invalid"
    assert out[4][1] is not None and out[4][1]["kind"] == "invalid"
    assert 0.3 <= elapsed < 1.5, elapsed  # the hung call is not waited for (3 s)
    assert calls.stats == {"calls": 5, "failed": 4, "timeouts": 1, "abandoned": 1}


def test_guess_number_feedback_and_reward_for_few_turns() -> None:
    env = GuessNumber({"max_turns": 4})
    ep = env.reset({"secret": 5, "low": 1, "high": 8})
    a = ep.step("3", [])
    assert (a.observation, a.reward, a.done) == ("higher", 0.0, False)
    b = ep.step("no idea", [])
    assert b.observation == "Say a number from 1 to 8." and not b.done
    c = ep.step("I say 7", [])
    assert c.observation == "lower"
    d = ep.step("5", [])
    assert d.done and d.reward == pytest.approx(1 / 4) and d.info == {"solved": 1, "guesses": 4}
    first = env.reset({"secret": 2, "low": 1, "high": 8}).step("2", [])
    assert first.reward == 1.0 and first.done
    with pytest.raises(EnvironmentError_, match="needs integer secret"):
        env.reset({"secret": "x", "low": 1, "high": 8})


def test_guess_rows_are_generated_deterministically_in_range() -> None:
    rows = guess_rows(50, 1, 8, seed=3)
    assert rows == guess_rows(50, 1, 8, seed=3) and rows != guess_rows(50, 1, 8, seed=4)
    assert {r["secret"] for r in rows} <= set(range(1, 9)) and len({r["secret"] for r in rows}) > 4
