"""The tool-math environment (generator.tools.toolmath): the model's "calc EXPR" and "python
CODE" turns reach the real calculator and the real sandbox, whose answers come back as the
observation; any other turn is the final answer, graded exactly; bad rows are refused naming
the key."""

from __future__ import annotations

import pytest

from generator.environments import EnvironmentError_, resolve_environment
from generator.tools.toolmath import ToolMath, parse_number, toolmath_rows


def test_tool_calls_answer_and_the_final_answer_is_graded() -> None:
    env = resolve_environment("generator.tools.toolmath:ToolMath", {"max_turns": 4})
    ep = env.reset({"result": 56, "tools": "calc,python"})
    t = ep.step(" calc 7*8", [])
    assert (t.observation, t.reward, t.done) == ("56", 0.0, False)
    t = ep.step("calc: 7/2", [])
    assert t.observation == "7/2 (= 3.5)"
    t = ep.step(" calc import os", [])
    assert str(t.observation).startswith("error: ") and t.info["tool_errors"] == 1
    t = ep.step(" python print(sum(range(12)) - 10)", [])  # the sandbox, a separate process
    assert t.observation == "56" and t.info["python_calls"] == 1
    t = ep.step(" The answer is 56.", [])
    assert (t.reward, t.done, t.info["correct"], t.info["answered"]) == (1.0, True, 1, 1)
    assert t.info["tool_calls"] == 4
    ep = env.reset({"result": "7/2"})
    assert ep.step(" 3.5", []).reward == 1.0
    assert env.reset({"result": 56}).step(" 55", []).reward == 0.0
    assert env.reset({"result": 56}).step(" no number", []).info["correct"] == 0


def test_the_sandbox_limits_hold_inside_the_environment() -> None:
    ep = ToolMath({}).reset({"result": 1, "sandbox_wall_s": 1.0})
    t = ep.step(" python while True: pass", [])
    assert t.observation in ("error: the sandbox's cpu limit", "error: the sandbox's wall limit")
    ep = ToolMath({}).reset({"result": 1, "sandbox_wall_s": 30.0})  # a loaded host starts slowly
    t = ep.step(" python open('/etc/x', 'w')", [])
    assert str(t.observation).startswith("error: PermissionError: sandbox:")
    t = ep.step(" python 1/0", [])
    assert t.observation == "error: ZeroDivisionError: division by zero"
    ep = ToolMath({}).reset({"result": 1, "tools": "calc"})
    t = ep.step(" python print(1)", [])
    assert str(t.observation).startswith("error: tool python is not allowed")
    assert t.info["python_calls"] == 0 and t.info["tool_errors"] == 1


def test_bad_rows_are_refused_naming_the_key() -> None:
    for task, key in (({}, "'result'"), ({"result": "x"}, "'result'"),
                      ({"result": 1, "tools": "calc,shell"}, "tools="),
                      ({"result": 1, "sandbox_wall_s": -1}, "sandbox_wall_s=")):  # fmt: skip
        with pytest.raises(EnvironmentError_, match=key):
            ToolMath({}).reset(task)


def test_rows_and_numbers() -> None:
    rows = toolmath_rows(600, seed=0)
    assert rows == toolmath_rows(600, seed=0)
    kinds = [r["kind"] for r in rows]
    assert 0.4 < kinds.count("ask") / 600 < 0.6 and 0.1 < kinds.count("direct") / 600 < 0.25
    for r in rows:
        a, b = (int(x) for x in r["prompt"][0]["content"][8:-1].split("*"))
        assert r["result"] == a * b and 2 <= a <= 9 and 2 <= b <= 9
        want = {"ask": f"calc {a}*{b}", "direct": str(a * b), "copy": str(a * b)}[r["kind"]]
        assert r["answer"] == want
        if r["kind"] == "copy":
            assert [m["content"] for m in r["prompt"][1:]] == [f"calc {a}*{b}", str(a * b)]
    assert {r["kind"] for r in toolmath_rows(50, seed=1, teach=False)} == {"ask"}
    assert [parse_number(s) for s in ("x 3/4 y", "-2.5", "none")] == [
        pytest.approx(0.75), pytest.approx(-2.5), None]  # fmt: skip
