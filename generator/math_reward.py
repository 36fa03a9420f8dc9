"""The ``math`` reward: verify a completion's final answer against the ground truth.

Built on Hugging Face's ``math-verify`` (``math_verify.parse`` / ``math_verify.verify``):
answers are parsed into SymPy objects and compared symbolically and numerically, so ``1/2``,
``0.5`` and ``\\boxed{\\frac{1}{2}}`` are the same answer. Order of one call::

    gold := task["answer"], after its last "####" if it has one (a GSM8K solution)
    pred := the completion after its last "####" (GSM8K style), else the whole completion
            (math-verify then prefers the last \\boxed{...}, then the last expression)
    formatted := an answer was extracted (with task["require_format"]: only a \\boxed{} or a
                 "####" answer counts)
    correct := formatted and verify(parse(gold), parse(pred))
    reward := (1 - format_weight) * correct + format_weight * formatted

Task keys: ``answer`` (required), ``format_weight`` (default 0.0, in [0, 1)),
``require_format`` (default False), ``math_timeout_s`` (default 5; whole seconds for
math-verify's own SIGALRM limit on each parse and comparison; 0 disables it). The SIGALRM
limit only works in a process's main thread (the reward runner's ``process`` mode, or
``inline`` in a main thread); elsewhere it is off and the runner's per-call ``timeout_s`` is
the only limit (in ``thread`` mode a runaway comparison is abandoned but keeps a core busy:
use ``process`` for this reward). A comparison that times out scores 0 with
``info["verify"] = "timeout"``. ``math_verify`` is imported on the first call only.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

Scalar = None | bool | int | float | str
Task = dict[str, Scalar]

log = logging.getLogger(__name__)

_HASH = re.compile(r"####[ \t]*(\S+)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _mv() -> Any:
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its per-call timeout warnings
    return math_verify


def hash_answer(text: str) -> str | None:
    """The word right after the last ``####`` (GSM8K: ``#### 1,234``), commas, $ and a
    final period removed; None without a ``####`` followed by one."""
    found = _HASH.findall(text)
    if not found:
        return None
    return found[-1].strip().replace(",", "").strip("$ ").rstrip(".")


def _limit(task: Task) -> int | None:
    raw = task.get("math_timeout_s", 5)
    try:
        seconds = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"task math_timeout_s must be whole seconds >= 0, got {raw!r}") from None
    if seconds < 0:
        raise ValueError(f"task math_timeout_s must be whole seconds >= 0, got {raw!r}")
    if seconds == 0 or threading.current_thread() is not threading.main_thread():
        return None  # SIGALRM works only in the main thread: the runner's timeout applies
    return seconds


def _weight(task: Task) -> float:
    raw = task.get("format_weight", 0.0)
    fw = float(raw if raw is not None else 0.0)
    if not 0.0 <= fw < 1.0:
        raise ValueError(f"task format_weight must be in [0, 1), got {raw!r}")
    return fw


def parse_answer(
    text: str, limit: int | None = None, *, gold: bool = False
) -> tuple[list[Any], str]:
    """(math-verify parse result, method) of a completion or gold answer: method "hash"
    (after the last ``####``), "boxed" (a \\boxed{} in the text), "text" (any other
    expression found) or "none" (nothing parsable: the list is empty). A gold answer that
    is bare LaTeX (``\\sqrt{8}``, no $ around it) is read as math, ``$...$``."""
    mv = _mv()
    hashed = hash_answer(text)
    if hashed is not None:
        got = mv.parse(hashed, parsing_timeout=limit)
        if got:
            return got, "hash"
    got = mv.parse(text, parsing_timeout=limit)
    if not got and gold:
        got = mv.parse(f"${text}$", parsing_timeout=limit)
    if not got:
        return [], "none"
    return got, "boxed" if _BOXED.search(text) else "text"


def _equivalent(gold: list[Any], pred: list[Any], limit: int | None) -> tuple[bool, str]:
    """(any gold/pred pair equivalent, how the comparison went: ok | timeout | error)."""
    mv = _mv()
    from math_verify.errors import TimeoutException

    status = "ok"
    for g in gold:
        for p in pred:
            try:
                if mv.verify(g, p, timeout_seconds=limit, raise_on_error=True):
                    return True, "ok"
            except TimeoutException:  # a BaseException in math-verify
                status = "timeout"
            except Exception as e:  # an expression SymPy cannot compare: not equivalent
                status = status if status == "timeout" else f"error: {type(e).__name__}"
    return False, status


def math(text: str, tokens: list[int], task: Task) -> tuple[float, Task]:
    """Reward 1.0 for a final answer equivalent to task["answer"] (see the module doc),
    with an optional format term. Info: correct, formatted, method, extracted, verify."""
    if task.get("answer") is None or str(task["answer"]).strip() == "":
        raise ValueError("task has no 'answer' (the ground truth the math reward checks)")
    fw, limit = _weight(task), _limit(task)
    gold, _ = parse_answer(str(task["answer"]), limit, gold=True)
    if not gold:
        raise ValueError(f"task answer {str(task['answer'])[:200]!r} is not a parsable answer")
    pred, method = parse_answer(text, limit)
    formatted = bool(pred) and (not task.get("require_format") or method in ("hash", "boxed"))
    info: Task = {"method": method, "extracted": str(pred[-1])[:200] if pred else "",
                  "verify": "skipped"}  # fmt: skip
    correct = False
    if formatted:
        correct, info["verify"] = _equivalent(gold, pred, limit)
    info.update(correct=correct, formatted=formatted)
    return (1.0 - fw) * float(correct) + fw * float(formatted), info


def warm_up() -> None:
    """Import math-verify and run one small parse and check: a reward worker does this before
    it reports ready, so that no call's time limit pays for the import (seconds on a busy
    host)."""
    math("\\boxed{\\frac{1}{2}}", [], {"answer": "0.5", "math_timeout_s": 0})


math.warm_up = warm_up  # type: ignore[attr-defined]
