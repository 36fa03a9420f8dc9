"""benchmarks/loop_credit.py's statistics: the 95% t-interval of a mean over seeds, and the
verdict (which arm is ahead of the base arm, by how much, with its interval).

Every arm of a task runs the same seeds, and a seed fixes the arm's RL prompts and latent
seeds (the arm's loop weighting the only difference), so an arm is compared with the base arm
seed by seed: the paired differences d_s = accuracy(arm, s) - accuracy(base, s), their mean
and its 95% t-interval, mean +- t_{0.975, n-1} x sd(d) / sqrt(n). An arm is ahead on a task
when the interval lies above 0, behind when it lies below, else level with the base."""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["T975", "compare", "t975", "t_interval", "verdict"]

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064,
        25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000,
        120: 1.980}  # fmt: skip
"""The 0.975 quantile of Student's t by degrees of freedom (standard tables, 3 decimals)."""


def t975(df: int) -> float:
    """t_{0.975, df}: the table's value, else that of the largest tabled df below it (wider:
    conservative), 1.960 beyond 120."""
    if df < 1:
        raise ValueError(f"t975: needs df >= 1, got {df}")
    if df > 120:
        return 1.960
    return T975[max(k for k in T975 if k <= df)]


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean of ``xs`` (n >= 2; n = 1: the value
    itself, an interval of width 0 marked by nothing more: callers report n)."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, mean, mean
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def compare(arm: list[float], base: list[float]) -> dict[str, Any]:
    """The paired comparison of two arms' per-seed accuracies (module doc): {"diff": mean of
    arm - base, "ci95": [low, high], "seeds": n, "call": "ahead" | "behind" | "level"}."""
    if len(arm) != len(base) or not arm:
        raise ValueError(f"compare: needs the same seeds, got {len(arm)} and {len(base)}")
    mean, lo, hi = t_interval([a - b for a, b in zip(arm, base)])
    call = "level" if len(arm) < 2 else ("ahead" if lo > 0 else "behind" if hi < 0 else "level")
    return {"diff": mean, "ci95": [lo, hi], "seeds": len(arm), "call": call}


def verdict(per_task: dict[str, dict[str, list[float]]], base: str = "last") -> dict[str, Any]:
    """{task: {arm: per-seed accuracies}} -> the benchmark's last line: every arm against
    ``base`` on every task (`compare`), "ahead": the (task, arm) pairs whose interval lies
    above 0, and "verdict": one sentence, e.g. "exit_pdf ahead of last on mix: +0.031 (95%
    CI +0.004..+0.058, 5 seeds)" or "no arm ahead of last (best: ...)"."""
    comps = []
    for task, arms in per_task.items():
        if base not in arms:
            raise ValueError(f"verdict: task {task} has no {base!r} arm to compare with")
        for arm, accs in arms.items():
            if arm != base:
                comps.append({"task": task, "arm": arm, **compare(accs, arms[base])})

    def say(c: dict[str, Any]) -> str:
        lo, hi = c["ci95"]
        call = {"ahead": "ahead of", "behind": "behind", "level": "level with"}[c["call"]]
        return (f"{c['arm']} {call} {base} on "
                f"{c['task']}: {c['diff']:+.3f} (95% CI {lo:+.3f}..{hi:+.3f}, {c['seeds']} seeds)")  # fmt: skip

    ahead = [c for c in comps if c["call"] == "ahead"]
    if ahead:
        text = "; ".join(say(c) for c in sorted(ahead, key=lambda c: -c["diff"]))
    elif comps:
        best = max(comps, key=lambda c: c["diff"])
        text = f"no arm ahead of {base} (best: {say(best)})"
    else:
        text = f"no arm to compare with {base}"
    return {"verdict": text, "ahead": [(c["task"], c["arm"]) for c in ahead], "base": base,
            "comparisons": comps}  # fmt: skip
