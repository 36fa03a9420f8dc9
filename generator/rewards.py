"""Reward functions: resolution by dotted path, the built-ins and the synthetic task.

A reward function has the signature (docs/REWARDS.md)::

    fn(completion_text: str, completion_tokens: list[int], task: dict[str, Scalar])
        -> float | tuple[float, dict[str, Scalar]]

and is named by a dotted path, ``"package.module:function"`` or ``"package.module.function"``;
a bare name (``"numeric"``) means a built-in of this module. Built-ins: ``exact_match``,
``numeric``, ``regex``, ``synthetic`` (the quickstart's count-on task, with
:func:`synthetic_task_prompts`) and ``math`` (generator.math_reward, on math-verify).
Rewards are called through :class:`generator.reward_runner.RewardRunner`, which adds
timeouts and error capture.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any

Scalar = None | bool | int | float | str
Task = dict[str, Scalar]
RewardFn = Callable[[str, list[int], Task], Any]
BUILTINS = ("exact_match", "numeric", "regex", "synthetic", "math")
_ELSEWHERE = {"math": "generator.math_reward:math"}
"""Built-ins that live in their own module (imported only when named: heavier dependencies)."""


class RewardError(ValueError):
    """A reward function cannot be found or used, or the runner's settings are invalid."""


# -- resolution ---------------------------------------------------------------------------
def resolve_reward(path: str) -> RewardFn:
    """The callable named by ``path`` ("pkg.mod:fn", "pkg.mod.fn" or a built-in's name)."""
    if not isinstance(path, str) or not path.strip():
        raise RewardError(
            f"reward must be a dotted path like 'package.module:function', got {path!r}"
        )
    path = _ELSEWHERE.get(path.strip(), path.strip())
    if path.startswith(("http://", "https://")):  # a judge in another process
        from generator.remote_reward import RemoteReward

        try:
            return RemoteReward(path)
        except ValueError as e:
            raise RewardError(str(e)) from None
    if path in BUILTINS:
        return globals()[path]  # type: ignore[no-any-return]
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    expected = (
        "expected 'package.module:function' or 'package.module.function' naming a callable "
        f"fn(completion_text, completion_tokens, task), or a built-in: {', '.join(BUILTINS)}"
    )
    if not mod_name or not attr or not attr.isidentifier():
        raise RewardError(f"reward {path!r} is not a dotted path; {expected}")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise RewardError(
            f"reward {path!r}: module {mod_name!r} not found ({e}); {expected}"
        ) from e
    except Exception as e:  # the module exists but fails to import: say so, with the cause
        raise RewardError(f"reward {path!r}: importing {mod_name!r} failed: {e!r}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward {path!r}: module {mod_name!r} has no {attr!r}; {expected}")
    if not callable(fn):
        raise RewardError(f"reward {path!r} is a {type(fn).__name__}, not a callable; {expected}")
    return fn  # type: ignore[no-any-return]


# -- built-ins ----------------------------------------------------------------------------
def _norm(s: str) -> str:
    return " ".join(s.split()).casefold()


def exact_match(text: str, tokens: list[int], task: Task) -> tuple[float, Task]:
    """1.0 when the completion equals task["answer"]; task["normalize"] (default True)
    first strips, collapses whitespace runs and casefolds both sides."""
    answer = str(task["answer"])
    same = _norm(text) == _norm(answer) if task.get("normalize", True) else text == answer
    return float(same), {"match": same}


_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
_SIGN = r"(?:(?<![\w)\]}.])[-+\u2212])?"  # a sign right after a digit is an operator
_NUM = _SIGN + _UNSIGNED
_FRAC_TEX = _SIGN + r"\\[dt]?frac\s*\{\s*" + _NUM + r"\s*\}\s*\{\s*" + _NUM + r"\s*\}"
_CANDIDATE = re.compile(rf"{_FRAC_TEX}|{_NUM}(?:\s*/\s*{_NUM})?")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def parse_number(s: str) -> Fraction | None:
    """A number written as an int, decimal, 1,234.5, 1e-3, a/b or \\frac{a}{b} (with an
    optional sign, surrounding $ or spaces and a trailing % or .), exactly; None if not one."""
    s = s.strip().strip("$").strip().replace("\u2212", "-").replace("\\!", "").replace("\\,", "")
    s = s.rstrip(".").rstrip("%").strip()
    m = re.fullmatch(r"([-+]?)\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", s)
    if m:
        num, den = parse_number(m.group(2)), parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) == "-" else num / den
    if "/" in s:
        a, _, b = s.partition("/")
        num, den = parse_number(a), parse_number(b)
        return None if num is None or den is None or den == 0 else num / den
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _boxed_contents(text: str) -> list[str]:
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def extract_answer(text: str) -> tuple[Fraction | None, str, str]:
    """(value, matched text, method) of the final answer of a math completion: the last
    \\boxed{...}, else the number after the last "answer is" / "answer:", else the last
    number; method is "boxed", "answer_is", "last_number" or "none"."""
    for content in reversed(_boxed_contents(text)):
        value = parse_number(content)
        if value is None:
            found = _CANDIDATE.findall(content)
            value = parse_number(found[-1]) if found else None
            content = found[-1] if found else content
        if value is not None:
            return value, content.strip(), "boxed"
    tails = list(_ANSWER_IS.finditer(text))
    if tails:
        m = _CANDIDATE.search(text, tails[-1].end())
        if m is not None and (value := parse_number(m.group())) is not None:
            return value, m.group(), "answer_is"
    for cand in reversed(_CANDIDATE.findall(text)):
        if (value := parse_number(cand)) is not None:
            return value, cand, "last_number"
    return None, "", "none"


def numeric(text: str, tokens: list[int], task: Task) -> tuple[float, Task]:
    """1.0 when the completion's final answer (see :func:`extract_answer`) equals
    task["answer"] within task["rel_tol"] (default 1e-6) or task["abs_tol"] (default 1e-9)."""
    want = parse_number(str(task["answer"]))
    if want is None:
        raise ValueError(f"task answer {task['answer']!r} is not a number")
    got, shown, method = extract_answer(text)
    info: Task = {"extracted": shown[:200], "method": method}
    if got is None:
        return 0.0, info
    rel, abs_ = float(task.get("rel_tol", 1e-6) or 0.0), float(task.get("abs_tol", 1e-9) or 0.0)
    ok = got == want or abs(float(got - want)) <= max(rel * max(abs(got), abs(want)), abs_)
    return float(ok), info


@lru_cache(maxsize=256)
def _compile(pattern: str, flags: int) -> re.Pattern[str]:
    return re.compile(pattern, flags)


def regex(text: str, tokens: list[int], task: Task) -> tuple[float, Task]:
    """1.0 when task["pattern"] matches: task["mode"] "search" (default) anywhere, or
    "fullmatch" the whole stripped completion; task["ignore_case"] (default False)."""
    mode = task.get("mode", "search")
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"task mode {mode!r} must be 'search' or 'fullmatch'")
    pat = _compile(str(task["pattern"]), re.IGNORECASE if task.get("ignore_case") else 0)
    m = pat.search(text) if mode == "search" else pat.fullmatch(text.strip())
    return float(m is not None), {"matched": "" if m is None else m.group()[:200]}


# -- the synthetic task -------------------------------------------------------------------
SYNTHETIC_BASE = 18
"""Token id of "0" in models.tokenizer's vocabulary; "0".."9" are ids 18..27."""


def synthetic_task_prompts(
    n: int,
    seed: int,
    vocab_size: int = 512,
    *,
    length: int = 8,
    shown: int = 3,
    alphabet_size: int = 10,
    base: int = SYNTHETIC_BASE,
    max_step: int = 1,
    format_weight: float = 0.2,
    bos_id: int = 1,
) -> list[tuple[list[int], Task]]:
    """``n`` prompts of the count-on task (docs/REWARDS.md): each prompt is ``bos_id`` then
    ``shown`` symbols counting up by ``step`` (1..max_step) modulo ``alphabet_size`` through
    token ids ``base .. base + alphabet_size - 1`` (the digits of the tiny tokenizer); the
    completion should continue the count for ``length`` tokens. Deterministic in ``seed``."""
    if not (n >= 0 and length >= 1 and shown >= 1 and 2 <= alphabet_size and max_step >= 1):
        raise ValueError("need n >= 0, length >= 1, shown >= 1, alphabet_size >= 2, max_step >= 1")
    if not 0 <= bos_id < vocab_size or not 0 <= base <= vocab_size - alphabet_size:
        raise ValueError(
            f"alphabet ids {base}..{base + alphabet_size - 1} and bos {bos_id} must lie in "
            f"[0, {vocab_size})"
        )
    if not 0.0 <= format_weight < 1.0:
        raise ValueError(f"format_weight must be in [0, 1), got {format_weight}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(alphabet_size)
        step = rng.randint(1, max(1, min(max_step, alphabet_size - 1)))
        syms = [(start + i * step) % alphabet_size for i in range(shown + length)]
        ids = [base + s for s in syms]
        task: Task = {
            "kind": "count_on",
            "base": base,
            "alphabet_size": alphabet_size,
            "step": step,
            "last": ids[shown - 1],
            "length": length,
            "format_weight": format_weight,
            "target": " ".join(str(i) for i in ids[shown:]),
        }
        out.append(([bos_id, *ids[:shown]], task))
    return out


def synthetic(text: str, tokens: list[int], task: Task) -> tuple[float, Task]:
    """Reward of the count-on task, on token ids: of the first task["length"] positions, the
    fraction whose token is the successor of the token before it (the prompt's last token for
    position 0), weighted 1 - format_weight, plus format_weight x the fraction that are
    alphabet symbols at all. Info: correct, in_alphabet, exact (equals task["target"])."""
    base, k, step, length = (
        int(str(task[key])) for key in ("base", "alphabet_size", "step", "length")
    )
    fw, prev = float(str(task["format_weight"])), int(str(task["last"]))
    correct = in_alpha = 0
    for tok in tokens[:length]:
        if base <= tok < base + k:
            in_alpha += 1
            if base <= prev < base + k and tok == base + (prev - base + step) % k:
                correct += 1
        prev = tok
    exact = " ".join(str(t) for t in tokens[:length]) == task["target"]
    reward = (1.0 - fw) * correct / length + fw * in_alpha / length
    return reward, {"correct": correct / length, "in_alphabet": in_alpha / length, "exact": exact}
