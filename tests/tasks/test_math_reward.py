"""The ``math`` reward (generator.math_reward): equivalent answers accepted, wrong ones
rejected, GSM8K and \\boxed{} styles, the format term, and both time limits."""

from __future__ import annotations

import time

import pytest

from generator.math_reward import hash_answer, math, parse_answer
from generator.reward_runner import RewardRunner
from generator.rewards import resolve_reward

HARD = r"the answer is \boxed{9^{9^{9^{9}}}}"
"""Parses at once, but comparing it with a number never finishes (SymPy evaluates it)."""


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("1/2", "0.5"),
        ("0.5", "1/2"),
        (r"so we get \boxed{\frac{1}{2}}", "1/2"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        ("#### 42", "42"),
        ("42", "#### 42"),
        ("She has 3 + 4 = 7 apples.\n#### 7", "Natalia sold 48/2 = 3+4 = 7.\n#### 7"),
        ("#### 1,234", "1234"),
        (r"The answer is $\frac{3}{4}$.", "0.75"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        ("x = 5, so the answer is 5", "5"),
    ],
)
def test_equivalent_answers_are_accepted(completion: str, answer: str) -> None:
    reward, info = math(completion, [], {"answer": answer})
    assert reward == 1.0, info
    assert info["correct"] is True and info["formatted"] is True and info["verify"] == "ok"


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("1/3", "0.5"),
        (r"\boxed{\frac{1}{2}}", "2"),
        ("#### 41", "42"),
        ("#### 42\n", "#### 24"),
        ("42", "4.2"),
        ("no number here", "7"),
        ("", "7"),
        ("#### 7 but then 8", "8"),  # the word right after the last ####
    ],
)
def test_wrong_answers_are_rejected(completion: str, answer: str) -> None:
    reward, info = math(completion, [], {"answer": answer})
    assert reward == 0.0, info
    assert info["correct"] is False


def test_gsm8k_hash_wins_over_earlier_numbers() -> None:
    assert hash_answer("3 + 4 = 7\n#### 7\n") == "7"
    assert hash_answer("#### $1,200.") == "1200"
    assert hash_answer("no marker") is None and hash_answer("####\n7") is None
    assert hash_answer("#### 12 apples, not 13") == "12"
    assert math("3 + 4 = 7, then 9\n#### 7", [], {"answer": "7"})[0] == 1.0
    assert math("3 + 4 = 7, then 9", [], {"answer": "7"})[0] == 0.0  # last number: 9
    assert parse_answer("so #### 12")[1] == "hash"
    assert parse_answer(r"\boxed{12}")[1] == "boxed"
    assert parse_answer("12 eggs")[1] == "text"
    assert parse_answer("eggs") == ([], "none")


def test_format_weight_and_required_format() -> None:
    task = {"answer": "7", "format_weight": 0.2}
    assert math("7", [], task)[0] == pytest.approx(1.0)
    assert math("8", [], task)[0] == pytest.approx(0.2)  # an answer, the wrong one
    assert math("words", [], task)[0] == 0.0
    strict = {"answer": "7", "require_format": True, "format_weight": 0.1}
    assert math("7", [], strict) == (0.0, pytest.approx(math("7", [], strict)[1]))
    assert math("7", [], strict)[1]["formatted"] is False
    assert math(r"\boxed{7}", [], strict)[0] == pytest.approx(1.0)
    assert math("#### 7", [], strict)[0] == pytest.approx(1.0)
    assert math("#### 6", [], strict)[0] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({}, "no 'answer'"),
        ({"answer": "  "}, "no 'answer'"),
        ({"answer": "7", "format_weight": 1.0}, r"format_weight must be in \[0, 1\)"),
        ({"answer": "7", "math_timeout_s": -1}, "math_timeout_s must be whole seconds"),
        ({"answer": "7", "math_timeout_s": "soon"}, "math_timeout_s must be whole seconds"),
    ],
)
def test_bad_tasks_raise_naming_the_key(task: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        math("7", [], task)


def test_registered_as_builtin() -> None:
    assert resolve_reward("math") is math
    assert resolve_reward("generator.math_reward:math") is math


def test_math_verify_time_limit_in_the_main_thread() -> None:
    t0 = time.monotonic()
    reward, info = math(HARD, [], {"answer": "1", "math_timeout_s": 1})
    took = time.monotonic() - t0
    assert reward == 0.0 and info["verify"] == "timeout" and info["formatted"] is True
    assert took < 4.0, took  # 1 s per comparison, a few comparisons at most


def test_process_pool_time_limit_kills_a_runaway_call_and_keeps_serving() -> None:
    """math_timeout_s=0 turns math-verify's own limit off: the reward runner's per-call
    timeout kills the worker, replaces it, and the next calls are scored."""
    with RewardRunner("math", mode="process", workers=1, timeout_s=2.0) as runner:
        t0 = time.monotonic()
        hung, ok, wrong = runner.score_many(
            [
                (HARD, [], {"answer": "1", "math_timeout_s": 0}),
                (r"\boxed{\frac{1}{2}}", [], {"answer": "0.5"}),
                ("#### 41", [], {"answer": "42"}),
            ]
        )
        took = time.monotonic() - t0
    assert hung.reward is None and hung.info["kind"] == "timeout"
    assert ok.reward == 1.0 and ok.info["correct"] is True
    assert wrong.reward == 0.0
    assert runner.stats["timeouts"] == 1 and runner.stats["recycled"] == 1
    assert took < 30.0, took


def test_thread_mode_runs_without_signals() -> None:
    """Off the main thread math-verify's SIGALRM limit is off (signal.alarm would raise);
    the reward still scores."""
    with RewardRunner("math", mode="thread", workers=2, timeout_s=30.0) as runner:
        res = runner.score_many([("1/2", [], {"answer": "0.5"}), ("3", [], {"answer": "4"})])
    assert [r.reward for r in res] == [1.0, 0.0]
    assert all(r.info["verify"] == "ok" for r in res)
