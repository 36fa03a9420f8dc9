"""Reward functions (resolution, built-ins, synthetic task) and the RewardRunner."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from generator.reward_runner import MODES, RewardRunner, invoke, measure_overhead
from generator.rewards import (
    SYNTHETIC_BASE,
    RewardError,
    exact_match,
    extract_answer,
    numeric,
    regex,
    resolve_reward,
    synthetic,
    synthetic_task_prompts,
)

HERE = "tests.generator.test_rewards"


@pytest.fixture
def behave_path(monkeypatch: pytest.MonkeyPatch) -> str:
    """Dotted path of ``behave`` for worker processes, importable without the tests.generator
    package (whose __init__ imports torch and vLLM glue: seconds per worker spawn)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return "test_rewards:behave"


def behave(text: str, tokens: list[int], task: dict) -> object:
    """A reward that misbehaves on request (task["do"]); resolved by path in worker processes."""
    do = task.get("do", "ok")
    if do == "raise":
        raise RuntimeError("boom in reward")
    if do == "hang":
        time.sleep(3600)
    if do == "die":
        os._exit(3)
    if do == "nan":
        return float("nan")
    if do == "text":
        return "1.0"
    if do == "info":
        return 0.5, {"n": len(tokens), "obj": object(), "list": [1, 2]}
    return float(len(text))


NOT_CALLABLE = 42


# -- resolution -----------------------------------------------------------------------------
def test_resolve_forms() -> None:
    assert resolve_reward("generator.rewards:numeric") is numeric
    assert resolve_reward("generator.rewards.numeric") is numeric
    assert resolve_reward("numeric") is numeric
    assert resolve_reward(f"{HERE}:behave") is behave


@pytest.mark.parametrize(
    "path, words",
    [
        ("no_such_pkg.mod:fn", ["no_such_pkg.mod:fn", "not found", "package.module:function"]),
        ("generator.rewards:nope", ["has no 'nope'", "package.module:function"]),
        (f"{HERE}:NOT_CALLABLE", ["not a callable"]),
        ("justaname", ["not a dotted path", "exact_match"]),
        ("", ["dotted path"]),
    ],
)
def test_resolve_errors_name_path_and_expectation(path: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        resolve_reward(path)
    assert isinstance(e.value, RewardError)
    for w in words:
        assert w in str(e.value)


# -- built-ins ------------------------------------------------------------------------------
def test_exact_match_normalisation() -> None:
    assert exact_match("  Hello\n  World ", [], {"answer": "hello world"})[0] == 1.0
    assert exact_match("Hello World", [], {"answer": "hello world", "normalize": False})[0] == 0
    assert exact_match("hello world", [], {"answer": "hello world", "normalize": False})[0] == 1
    assert exact_match("hello", [], {"answer": "hello world"})[0] == 0.0


@pytest.mark.parametrize(
    "text, answer, ok, method",
    [
        ("so the answer is 42.", "42", True, "answer_is"),
        ("The answer is 7. Check: 7*2=14", "7", True, "answer_is"),
        ("12+7=19, so 19", "19", True, "last_number"),
        ("x = \\boxed{\\frac{3}{4}} and then 9", "0.75", True, "boxed"),
        ("\\boxed{x = -5}", "-5", True, "boxed"),
        ("total is $1,234.50", "1234.5", True, "last_number"),
        ("answer: -\\frac{1}{2}", "-1/2", True, "answer_is"),
        ("it is 3/4", "0.75", True, "last_number"),
        ("0.333333333", "1/3", True, "last_number"),  # within rel_tol 1e-6
        ("0.3333", "1/3", False, "last_number"),
        ("so 3-5", "5", True, "last_number"),  # "-" after a digit is an operator
        ("we get \u22127", "-7", True, "last_number"),
        ("1e-3", "0.001", True, "last_number"),
        ("50%", "50", True, "last_number"),
        ("no digits here", "1", False, "none"),
    ],
)
def test_numeric(text: str, answer: str, ok: bool, method: str) -> None:
    reward, info = numeric(text, [], {"answer": answer})
    assert reward == float(ok), (text, info)
    assert info["method"] == method


def test_numeric_tolerance_and_bad_answer() -> None:
    assert numeric("3.14", [], {"answer": 3.14159, "rel_tol": 1e-3})[0] == 1.0
    assert numeric("3.14", [], {"answer": 3.14159})[0] == 0.0
    assert numeric("0.5", [], {"answer": 0.6, "rel_tol": 0, "abs_tol": 0.2})[0] == 1.0
    with pytest.raises(ValueError, match="not a number"):
        numeric("1", [], {"answer": "forty-two"})
    assert extract_answer("\\boxed{1,000}")[0] == 1000


def test_regex() -> None:
    assert regex("the cat sat", [], {"pattern": r"c.t"})[0] == 1.0
    assert regex("the cat sat", [], {"pattern": r"c.t", "mode": "fullmatch"})[0] == 0.0
    assert (
        regex("  CAT \n", [], {"pattern": "cat", "mode": "fullmatch", "ignore_case": True})[0]
        == 1.0
    )
    with pytest.raises(ValueError, match="mode"):
        regex("x", [], {"pattern": "x", "mode": "match"})


# -- synthetic task -------------------------------------------------------------------------
def test_synthetic_prompts_deterministic_and_in_vocab() -> None:
    a = synthetic_task_prompts(50, seed=3, vocab_size=512)
    assert a == synthetic_task_prompts(50, seed=3, vocab_size=512)
    assert a != synthetic_task_prompts(50, seed=4, vocab_size=512)
    for prompt, task in a:
        assert prompt[0] == 1 and len(prompt) == 4
        assert all(SYNTHETIC_BASE <= t < SYNTHETIC_BASE + 10 for t in prompt[1:])
        assert task["last"] == prompt[-1] and task["length"] == 8
        assert all(isinstance(v, bool | int | float | str) for v in task.values())
    with pytest.raises(ValueError, match="must lie in"):
        synthetic_task_prompts(1, seed=0, vocab_size=20)


def test_synthetic_reward_partial_credit() -> None:
    prompt, task = synthetic_task_prompts(1, seed=0, vocab_size=512)[0]
    target = [int(t) for t in str(task["target"]).split()]
    assert synthetic("", target, task) == (1.0, {"correct": 1.0, "in_alphabet": 1.0, "exact": True})
    assert synthetic("", target + [2, 2], task)[0] == 1.0  # tokens past `length` are ignored
    assert synthetic("", [400] * 8, task)[0] == 0.0
    assert synthetic("", [], task)[0] == 0.0
    # half the positions right: the first four, then four wrong alphabet symbols
    wrong = [target[3]] * 4
    r, info = synthetic("", target[:4] + wrong, task)
    assert info["correct"] == 0.5 and info["in_alphabet"] == 1.0 and not info["exact"]
    assert r == pytest.approx(0.8 * 0.5 + 0.2)
    # credit is local: after a slip, counting on from the slip still earns credit
    slip = [target[0], target[5]]
    while len(slip) < 8:
        slip.append(SYNTHETIC_BASE + (slip[-1] - SYNTHETIC_BASE + 1) % 10)
    assert synthetic("", slip, task)[1]["correct"] == pytest.approx(7 / 8)


def test_synthetic_alphabet_is_the_tiny_tokenizers_digits() -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from models.tokenizer import tokenizer_files

    tok = Tokenizer.from_str(tokenizer_files(512)["tokenizer.json"].decode())
    assert [tok.token_to_id(str(d)) for d in range(10)] == list(range(SYNTHETIC_BASE, 28))
    _, task = synthetic_task_prompts(1, seed=1, vocab_size=512)[0]
    ids = [int(t) for t in str(task["target"]).split()]
    assert tok.decode(ids).isdigit()


# -- runner ---------------------------------------------------------------------------------
def test_invoke_checks_results() -> None:
    assert invoke(behave, "abc", [], {}) == (3.0, {})
    r, info = invoke(behave, "", [1, 2], {"do": "info"})
    assert r == 0.5 and info["n"] == 2 and isinstance(info["obj"], str) and info["list"] == "[1, 2]"
    assert invoke(behave, "", [], {"do": "raise"})[1]["kind"] == "exception"
    assert "boom" in str(invoke(behave, "", [], {"do": "raise"})[1]["error"])
    assert invoke(behave, "", [], {"do": "nan"})[1]["kind"] == "invalid"
    assert invoke(behave, "", [], {"do": "text"})[1]["kind"] == "invalid"


def test_runner_rejects_bad_settings() -> None:
    with pytest.raises(RewardError, match="no_such"):
        RewardRunner("no_such.module:fn", mode="inline")
    with pytest.raises(RewardError, match="mode"):
        RewardRunner("numeric", mode="fork")
    with pytest.raises(RewardError, match="dotted path"):
        RewardRunner(behave, mode="process")


@pytest.mark.parametrize("mode", MODES)
def test_runner_failures_are_recorded_not_fatal(mode: str, behave_path: str) -> None:
    calls = [
        ("ab", [1], {}),
        ("x", [], {"do": "raise"}),
        ("x", [], {"do": "nan"}),
        ("abcd", [], {}),
    ]
    with RewardRunner(behave_path, mode=mode, workers=2, timeout_s=30) as runner:
        out = runner.score_many(calls)
        assert [r.reward for r in out] == [2.0, None, None, 4.0]  # order kept
        assert out[1].info["kind"] == "exception" and "boom" in str(out[1].info["error"])
        assert out[2].info["kind"] == "invalid"
        assert runner.score("abc", [], {}).reward == 3.0
        assert runner.stats["failed"] == 2


def test_process_runner_kills_a_hung_reward_and_keeps_serving() -> None:
    # catastrophic backtracking: C code holding the GIL, which no thread could interrupt
    hang = {"pattern": "(a+)+$", "mode": "search"}
    text = "a" * 64 + "!"
    calls = [(text, [], hang)] + [("bb", [], {"pattern": "b+"})] * 6
    with RewardRunner("regex", mode="process", workers=2, timeout_s=0.5) as runner:
        t0 = time.monotonic()
        out = runner.score_many(calls)
        took = time.monotonic() - t0
        assert out[0].reward is None and out[0].info["kind"] == "timeout"
        assert "0.5s timeout" in str(out[0].info["error"])
        assert [r.reward for r in out[1:]] == [1.0] * 6  # the other worker kept serving
        assert took < 20  # bounded by the timeout (+ one respawn), not by the hung call
        assert runner.stats["timeouts"] == 1 and runner.stats["recycled"] == 1
        # the replacement worker serves the next calls; a second hang is handled too
        again = runner.score_many([(text, [], hang), ("c", [], {"pattern": "d"})])
        assert again[0].info["kind"] == "timeout" and again[1].reward == 0.0


def test_process_runner_survives_a_worker_crash(behave_path: str) -> None:
    with RewardRunner(behave_path, mode="process", workers=1, timeout_s=30) as runner:
        out = runner.score_many([("x", [], {"do": "die"}), ("xy", [], {})])
        assert out[0].reward is None and out[0].info["kind"] == "crash"
        assert "exit code 3" in str(out[0].info["error"])
        assert out[1].reward == 2.0


def test_thread_runner_abandons_a_hung_reward() -> None:
    with RewardRunner(behave, mode="thread", workers=2, timeout_s=0.3) as runner:
        out = runner.score_many([("a", [], {"do": "hang"}), ("bb", [], {}), ("ccc", [], {})])
        assert out[0].info["kind"] == "timeout"
        assert [r.reward for r in out[1:]] == [2.0, 3.0]
        assert runner.stats["abandoned"] == 1
        assert runner.score("dddd", [], {}).reward == 4.0


@pytest.mark.parametrize(("mode", "bad"), [("thread", "hang"), ("process", "hang"),
                                          ("process", "die")])  # fmt: skip
def test_chunked_calls_behind_a_failure_are_scored(mode: str, bad: str, behave_path: str) -> None:
    """Calls go to a worker in chunks (up to reward_runner.CHUNK at once): a call that hangs
    or kills its worker in the middle of a chunk fails alone, the calls queued behind it in
    the same chunk are handed to a worker again and scored, and the order is kept. One
    worker: the whole batch is one chunk."""
    fn = behave if mode == "thread" else behave_path
    calls = [("a" * (i + 1), [], {}) for i in range(12)]
    calls[4] = ("x", [], {"do": bad})
    with RewardRunner(fn, mode=mode, workers=1, timeout_s=0.5) as runner:
        out = runner.score_many(calls)
        want = [float(i + 1) for i in range(12)]
        assert [r.reward for r in out[:4] + out[5:]] == want[:4] + want[5:]
        assert out[4].reward is None
        assert out[4].info["kind"] == ("timeout" if bad == "hang" else "crash")
        assert runner.stats["calls"] == 12 and runner.stats["failed"] == 1
        assert runner.score("zz", [], {}).reward == 2.0  # the runner keeps serving


def test_measure_overhead_reports_every_mode() -> None:
    got = measure_overhead(calls=128, workers=1)
    assert set(got) == {f"{m}_{k}_us" for m in MODES for k in ("single", "batch64")}
    assert all(v > 0 for v in got.values())


def test_process_worker_warms_up_before_it_is_ready(tmp_path: Path) -> None:
    """A reward's warm_up() runs in each worker before it reports ready: its cost (here 2 s)
    never counts against a call's timeout (1 s), also after a worker is replaced."""
    import sys

    (tmp_path / "slow_start_reward.py").write_text(
        "import time\n"
        "READY = []\n"
        "def warm_up():\n    time.sleep(2.0)\n    READY.append(1)\n"
        "def fn(text, tokens, task):\n"
        "    if not READY:\n        warm_up()  # a lazy import, as math-verify's\n"
        "    if text == 'hang':\n        time.sleep(60)\n"
        "    return 1.0\n"
        "fn.warm_up = warm_up\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with RewardRunner("slow_start_reward:fn", mode="process", workers=1,
                          timeout_s=1.0) as runner:  # fmt: skip
            hung, first, second = runner.score_many([("hang", [], {}), ("a", [], {}),
                                                     ("b", [], {})])  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
    assert hung.reward is None and hung.info["kind"] == "timeout"
    assert first.reward == 1.0 and second.reward == 1.0  # the replaced worker warmed up first
    assert runner.stats["recycled"] == 1
