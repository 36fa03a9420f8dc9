"""Tool math: an environment in which the model calls the calculator or the Python sandbox,
reads the result as the next observation, and gives a final answer that is graded.

The model's turn is one of (leading whitespace ignored; docs/TASKS.md "Tool math")::

    calc EXPR       the calculator (generator.tools.calculator.calculator_tool) on EXPR;
                    the observation is its result ("56", "7/2 (= 3.5)") or "error: ..."
    python CODE     the sandbox (generator.tools.sandbox.run_python) runs CODE; the observation
                    is its stdout (cut at ``max_output_chars``), or "error: <limit or stderr>"
    anything else   the final answer: its first number (an integer, a decimal or a/b) is
                    compared exactly with the task's ``result``; the conversation ends

Reward: 1.0 for a correct final answer, else 0.0 (a conversation that ends without a final
answer, after ``max_turns`` turns or its budgets, scores 0). info: correct (0/1, what eval
accuracy counts), answered (0/1), tool_calls, tool_errors, python_calls.

task (the dataset row's task dict): ``result`` (the exact answer: an int, or text such as
"7/2"); optional ``tools`` ("calc,python": the tools this row allows, a call to another is
answered "error: tool NAME is not allowed") and ``sandbox_wall_s`` (the sandbox's wall-time
limit, default 5 s; its cpu limit is the same, rounded up). A row's prompt may already hold a
tool exchange (chat messages ending with the tool's result): the episode starts there.

Deterministic given the task and the model's turns (the learner replays eval conversations
through it: pipeline.core.eval_rounds.environment_rescorer), as long as the code the model
runs in the sandbox is.

``python -m generator.tools.toolmath OUT_DIR [--train 1200] [--test 100]`` writes the example's
data (configs/data/toolmath, configs/toolmath.yaml): :func:`toolmath_rows`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from generator.environments import EnvironmentError_, Scalar, Turn
from generator.tools.calculator import calculator_tool
from generator.tools.sandbox import SandboxLimits, run_python

TOOLS = ("calc", "python")
_CALL = re.compile(r"\s*(calc|python)\b[ \t:]*(.*)", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The first number of ``text`` (an integer, a decimal or a/b) exactly, or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return Fraction(m.group())
    except (ValueError, ZeroDivisionError):
        return None


class ToolMath:
    """See the module docstring. config (from the generator): max_turns (default 8); the
    per-row settings come from the task dict."""

    def __init__(self, config: Mapping[str, Scalar]) -> None:
        self.max_turns = int(config.get("max_turns", 8) or 8)
        self.max_output_chars = 200

    def reset(self, task: Mapping[str, Scalar]) -> ToolMathEpisode:
        raw = task.get("result")
        try:
            result = Fraction(str(raw))
        except (ValueError, ZeroDivisionError):
            raise EnvironmentError_(
                f"ToolMath task {dict(task)!r}: needs 'result', an exact number (e.g. 56 or 7/2)"
            ) from None
        allowed = str(task.get("tools", "calc,python") or "").split(",")
        bad = [t for t in allowed if t.strip() not in TOOLS]
        if bad:
            raise EnvironmentError_(
                f"ToolMath task tools={task.get('tools')!r}: {bad} not among {TOOLS}"
            )
        wall = float(task.get("sandbox_wall_s", 5.0) or 5.0)
        if not wall > 0:
            raise EnvironmentError_(f"ToolMath task sandbox_wall_s={wall}: must be > 0")
        limits = SandboxLimits(wall_s=wall, cpu_s=max(1, math.ceil(wall)))
        return ToolMathEpisode(result, {t.strip() for t in allowed}, limits,
                               self.max_output_chars)  # fmt: skip


@dataclass
class ToolMathEpisode:
    result: Fraction
    tools: set[str]
    limits: SandboxLimits
    max_output_chars: int
    info: dict[str, Scalar] = field(default_factory=lambda: {
        "correct": 0, "answered": 0, "tool_calls": 0, "tool_errors": 0, "python_calls": 0})  # fmt: skip

    def step(self, text: str, tokens: list[int]) -> Turn:
        m = _CALL.match(text)
        if m is None:  # the final answer
            got = parse_number(text)
            ok = got is not None and got == self.result
            self.info.update(correct=int(ok), answered=1)
            return Turn("", 1.0 if ok else 0.0, True, dict(self.info))
        name, arg = m.group(1), m.group(2).strip()
        self.info["tool_calls"] = int(self.info["tool_calls"] or 0) + 1
        if name not in self.tools:
            out = f"error: tool {name} is not allowed (allowed: {sorted(self.tools)})"
        elif name == "calc":
            out = calculator_tool(arg)
        else:
            self.info["python_calls"] = int(self.info["python_calls"] or 0) + 1
            r = run_python(arg, self.limits)
            if r.limit not in (None, "blocked"):  # blocked: stderr names what was refused
                out = f"error: the sandbox's {r.limit} limit"
            elif r.exit_code != 0:
                tail = r.stderr.strip().splitlines()
                out = f"error: {tail[-1] if tail else f'exit code {r.exit_code}'}"
            else:
                out = r.stdout.strip()
        if out.startswith("error:"):
            self.info["tool_errors"] = int(self.info["tool_errors"] or 0) + 1
        return Turn(out[: self.max_output_chars] or "(no output)", 0.0, False, dict(self.info))


# ---- the example's data ------------------------------------------------------------------
def toolmath_rows(count: int, seed: int = 0, *, low: int = 2, high: int = 9,
                  teach: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """``count`` rows {"id", "prompt" (chat messages), "answer" (what a warm start imitates),
    "result", "kind", "tools"} of products A*B, A and B in [low, high]. With ``teach`` (the
    train split): kind "ask" (1/2: the question; answer "calc A*B", a tool call), "direct"
    (1/6: the question; answer the product itself) and "copy" (1/3: the question, the tool
    call and its result as the conversation so far; answer the result). Without (the test
    split): every row kind "ask". Pure function of its arguments."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        q = {"role": "user", "content": f"What is {a}*{b}?"}
        r = rng.random() if teach else 0.0
        kind = "ask" if r < 1 / 2 else "direct" if r < 2 / 3 else "copy"
        prompt: list[dict[str, str]] = [q]
        answer = f"calc {a}*{b}"
        if kind == "direct":
            answer = str(a * b)
        elif kind == "copy":
            prompt = [q, {"role": "assistant", "content": answer},
                      {"role": "user", "content": str(a * b)}]  # fmt: skip
            answer = str(a * b)
        rows.append({"id": f"toolmath-{i}", "prompt": prompt, "answer": answer,
                     "result": a * b, "kind": kind, "tools": "calc,python"})  # fmt: skip
    return rows


SPLITS = {"train": (1200, 0, True), "test": (100, 1, False)}
"""split -> (rows, seed, teach) of the example's data."""


def write_data(out: Path, counts: Mapping[str, int] | None = None) -> list[Path]:
    """configs/data/toolmath: OUT/train.jsonl and OUT/test.jsonl (ids prefixed by the split)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, (n, seed, teach) in SPLITS.items():
        rows = toolmath_rows((counts or {}).get(split, n), seed, teach=teach)
        p = out / f"{split}.jsonl"
        p.write_text("".join(json.dumps({**r, "id": f"{split}-{r['id']}"}) + "\n" for r in rows))
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m generator.tools.toolmath",
                                 description="write the tool-math example's data")  # fmt: skip
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=SPLITS["train"][0])
    ap.add_argument("--test", type=int, default=SPLITS["test"][0])
    a = ap.parse_args(argv)
    for p in write_data(a.out, {"train": a.train, "test": a.test}):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
