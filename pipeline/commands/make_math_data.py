"""A small GSM8K-format dataset of arithmetic word problems, generated in code (no downloads).

    python -m pipeline.commands.make_math_data OUT_DIR [--train 1000] [--test 100]
                                      [--level easy|copy|medium] [--format jsonl|parquet]
                                      [--seed 0]

writes OUT_DIR/train.<ext> and OUT_DIR/test.<ext> (the split names `datasets` recognises),
one problem per row with the columns

    prompt    the question, e.g. "Mia has 3 pens and gets 4 more. How many pens now?"
    answer    a GSM8K-style solution ending in the final answer: "3 + 4 = 7\\n#### 7"
    level     "copy", "easy" or "medium"
    op        the arithmetic the problem needs: copy, add, sub, mul, add_sub

Levels: copy (the answer, 0..9 and each digit equally likely, is the one number in the
question; the solution is just "#### 7": what configs/math.yaml trains the tiny model on),
easy (one operation, every answer 0..9) and medium (two operations on numbers up to 99).
Rows are a pure function of (seed, split, row): the same arguments always write the same
bytes, and the test split uses its own seed stream, with questions that do not occur in train.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben")
THINGS = ("apples", "pens", "books", "cards", "coins", "eggs", "toys", "cups", "shells", "stamps")
LEVELS = ("copy", "easy", "medium")

Problem = tuple[str, str, str]  # (question, solution, op)


def _copy(rng: random.Random) -> Problem:
    name, thing, a = rng.choice(NAMES), rng.choice(THINGS), rng.randint(0, 9)
    q = rng.choice((
        f"{name} has {a} {thing}. How many {thing} does {name} have?",
        f"{name} buys {a} {thing}. How many {thing} did {name} buy?",
        f"There are {a} {thing} in a box. How many {thing} are in the box?",
    ))  # fmt: skip
    return q, f"#### {a}", "copy"


def _easy(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    op = rng.choice(("add", "sub", "mul"))
    if op == "add":
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
        return q, f"{a} + {b} = {a + b}\n#### {a + b}", op
    if op == "sub":
        a = rng.randint(1, 9)
        b = rng.randint(0, a)
        q = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
        return q, f"{a} - {b} = {a - b}\n#### {a - b}", op
    a = rng.randint(1, 4)
    b = rng.randint(0, 9 // a)
    q = f"{name} has {a} bags with {b} {thing} in each. How many {thing} in all?"
    return q, f"{a} * {b} = {a * b}\n#### {a * b}", op


def _medium(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        a, b = rng.randint(10, 60), rng.randint(1, 30)
        c = rng.randint(1, a + b)
        q = (f"{name} has {a} {thing}, buys {b} more, then gives {c} to a friend. "
             f"How many {thing} does {name} have left?")  # fmt: skip
        return q, f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}\n#### {a + b - c}", "add_sub"
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(0, 99 - a * b)
    q = (f"{name} fills {a} boxes with {b} {thing} each and has {c} more {thing} on a shelf. "
         f"How many {thing} are there in total?")  # fmt: skip
    return q, f"{a} * {b} = {a * b}\n{a * b} + {c} = {a * b + c}\n#### {a * b + c}", "mul"


_MAKERS: dict[str, Callable[[random.Random], Problem]] = {
    "copy": _copy,
    "easy": _easy,
    "medium": _medium,
}


def make_rows(
    n: int, level: str, seed: int, split: str, avoid: set[str] | None = None
) -> list[dict[str, Any]]:
    """``n`` rows of ``level`` (see the module doc); questions in ``avoid`` are skipped. A
    level has finitely many questions: asking for more distinct ones than exist raises."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} must be one of {LEVELS}")
    rng = random.Random(f"{seed}/{split}/{level}")
    rows: list[dict[str, Any]] = []
    seen = set(avoid or ())
    misses = 0  # draws in a row that gave a question already taken
    while len(rows) < n and misses < 10_000:
        q, solution, op = _MAKERS[level](rng)
        if q in seen:
            misses += 1
            continue
        misses = 0
        seen.add(q)
        rows.append({"prompt": q, "answer": solution, "level": level, "op": op})
    if len(rows) == n:
        return rows
    raise ValueError(
        f"level {level!r} has fewer than {n} distinct new questions for split {split!r}"
    )


def write_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Write ``rows`` as jsonl (sorted keys, one per line) or parquet, by ``path``'s suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa  # local: only for --format parquet
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    else:
        raise ValueError(f"{path}: write .jsonl or .parquet")
    return path


def make_dataset(out: Path, *, train: int = 1000, test: int = 100, level: str = "easy",
                 fmt: str = "jsonl", seed: int = 0) -> dict[str, Path]:  # fmt: skip
    """Write OUT/train.<fmt> and OUT/test.<fmt> (test questions disjoint from train)."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"format {fmt!r} must be jsonl or parquet")
    tr = make_rows(train, level, seed, "train")
    te = make_rows(test, level, seed, "test", avoid={r["prompt"] for r in tr})
    return {
        "train": write_rows(tr, out / f"train.{fmt}"),
        "test": write_rows(te, out / f"test.{fmt}"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.commands.make_math_data",
                                description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    p.add_argument("out", help="output directory (train.<ext> and test.<ext> are written)")
    p.add_argument("--train", type=int, default=1000, help="train rows (default 1000)")
    p.add_argument("--test", type=int, default=100, help="test rows (default 100)")
    p.add_argument("--level", choices=LEVELS, default="easy", help="difficulty (default easy)")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", dest="fmt")
    p.add_argument("--seed", type=int, default=0, help="generation seed (default 0)")
    a = p.parse_args(argv)
    try:
        paths = make_dataset(Path(a.out), train=a.train, test=a.test, level=a.level, fmt=a.fmt,
                             seed=a.seed)  # fmt: skip
    except ValueError as e:
        print(f"make_math_data: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
