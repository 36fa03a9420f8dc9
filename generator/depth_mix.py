"""The mixed-depth task: copying and multi-hop variable tracking in one split, so that some
answers need one lookup and others every hop (docs/TASKS.md, "Mixed depth").

    python -m generator.depth_mix OUT_DIR [--train 4000] [--test 200] [--mix 1:0.5,2:0.5]
                                  [--seed 0] [--queries 1] [--chains 4] [--answer digits]

writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl, one question a row:

    prompt   two pointer chains over distinct letters, every assignment shuffled, then "?" and
             the last name of the queried chain
    answer   the queried chain's root digit, "0".."9"
    hops     the queried chain's assignments: the item's difficulty class

A class of ``hops`` h > 1 is variable tracking: the queried chain runs from a digit through
h - 1 pointers, the other chain (the distractor) from another digit ("b=a,a=4,y=x,x=7?b" ->
"4"), so the answer is found by following the pointers. The class h = 1 is copying: the queried
name holds the digit and the distractor chain ends in a letter nobody assigns, so the prompt's
one digit is the answer ("a=4,y=x,x=q?a" -> "4"). Every distractor has as many assignments as
the longest class of the mix, so a question's length says little about its class. ``--mix``
names each class and its share: of n rows exactly round(n x share) are of each class but the
last, which takes the rest, in a seeded order. Rows are a pure function of (seed, split, row):
the same arguments write the same bytes; the test split has its own seed stream and no
question of train.

Reward (`reward`, task.reward ``generator.depth_mix:reward``): 1 when the completion,
whitespace stripped, is the answer digit; 0 otherwise, and ``malformed`` when it is not one
digit. Accuracy by class at each fixed depth: ``looprl eval --by hops --depths 1,2,3,4``
(pipeline/commands/evaluation.py).

With ``--queries K`` (K >= 2) the rows are the long variant (docs/TASKS.md "Mixed depth, long
completions"), where the class varies per generated token rather than per question:

    prompt   ``--chains`` C pointer chains of H assignments each (H the longest class of the
             mix) over distinct capital letters, from C distinct digits, every assignment
             shuffled, then "?" and K queried names, one letter each, no separator
             ("B=A,A=4,D=C,C=7?ABDC" -> "4477" for K = 4)
    answer   the K queried names' root digits in query order, e.g. "4477"
    hops     the K queries' classes in query order, one digit each, e.g. "1221": query j of
             class h names the h-th name of its chain (h = 1: the name holds its digit, a
             copy; h > 1: h - 1 pointers to follow)

With ``--answer pairs`` the answer names each query before its digit, "A=4,A=4,D=7,C=7" for
the prompt above ("NAME=DIGIT" in query order, comma-separated; the same prompts and digits
as ``--answer digits``, the default): of its 4K - 1 characters only the K digits need a
lookup; a name copies its query from the prompt and "=" and "," are the format, so most of a
completion is tokens one loop should answer (docs/TASKS.md "Mixed depth, answers in pairs").

Of each row's K queries exactly round(K x share) are of each class but the last (the rest), in
a seeded order, each of a chain drawn uniformly. Capital letters because the tiny tokenizer
(models/tokenizer.py) merges no two of them: every character of a prompt is one token, so
query j sits exactly K - 1 positions before the position that predicts answer digit j.
Rows are again a pure function of (seed, split, row, K, C). Reward (`reward_multi`,
task.reward ``generator.depth_mix:reward_multi``, with ``hops`` in task.metadata_columns):
the fraction of the K digits right (partial credit), ``correct`` when all are; 0 and
``malformed`` when the completion, whitespace stripped, is not exactly K digits (pairs: not K
comma-separated "NAME=DIGIT" items; an item's digit counts only under its query's name). With
task.reward_args ``score_hops: h`` it scores only the queries of class h, so that
``looprl eval ... --depths 1,2,3,4 'task.reward_args={score_hops: h}'`` gives that class's
per-digit accuracy at each fixed depth (``eval/reward_mean@d``): `--by` needs one class a row.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "depth_mix_multi_row",
    "depth_mix_row",
    "depth_mix_rows",
    "pairs",
    "parse_mix",
    "reward",
    "reward_multi",
    "write_depth_mix",
]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CAPITALS = LETTERS.upper()
"""The long variant's names: one token each, however they are strung together (module doc)."""
DIGITS = "0123456789"
ANSWERS = ("digits", "pairs")
"""The long variant's answer formats (``--answer``): the K digits, or K NAME=DIGIT items."""


def depth_mix_row(rng: random.Random, hops: int, distractor: int) -> tuple[str, str]:
    """One question whose queried chain has ``hops`` assignments, beside a chain of
    ``distractor`` assignments (from another digit; hops 1: from an unassigned letter):
    (prompt, answer digit)."""
    if not 1 <= hops or not 1 <= distractor or hops + distractor + 1 > len(LETTERS):
        raise ValueError(f"depth_mix: hops {hops} and distractor {distractor} must be >= 1 and "
                         f"fit {len(LETTERS)} letters")  # fmt: skip
    letters = rng.sample(LETTERS, hops + distractor + 1)
    root, other = rng.sample(range(10), 2)
    free = letters[-1] if hops == 1 else str(other)  # copying: the prompt's one digit
    parts = []
    for names, start in ((letters[:hops], str(root)), (letters[hops:-1], free)):
        parts.append(f"{names[0]}={start}")
        parts += [f"{b}={a}" for a, b in zip(names, names[1:])]
    rng.shuffle(parts)
    return ",".join(parts) + "?" + letters[hops - 1], str(root)


def depth_mix_multi_row(rng: random.Random, classes: Sequence[int], chains: int,
                        length: int) -> tuple[str, str]:  # fmt: skip
    """One long-variant question (module doc): ``chains`` chains of ``length`` assignments from
    distinct digits, then one query a class of ``classes`` (in order; class h names a chain's
    h-th name): (prompt, answer digits)."""
    if not 1 <= chains <= len(DIGITS) or length < 1 or chains * length > len(CAPITALS):
        raise ValueError(f"depth_mix: {chains} chains of {length} assignments need 1 <= chains "
                         f"<= {len(DIGITS)} (distinct digits) and chains x assignments <= "
                         f"{len(CAPITALS)} (distinct letters)")  # fmt: skip
    if not classes or not all(1 <= h <= length for h in classes):
        raise ValueError(f"depth_mix: query classes {list(classes)} must be 1..{length}")
    letters = rng.sample(CAPITALS, chains * length)
    names = [letters[c * length : (c + 1) * length] for c in range(chains)]
    roots = rng.sample(DIGITS, chains)
    parts = [f"{chain[0]}={root}" for chain, root in zip(names, roots)]
    parts += [f"{b}={a}" for chain in names for a, b in zip(chain, chain[1:])]
    rng.shuffle(parts)
    picks = [rng.randrange(chains) for _ in classes]
    query = "".join(names[c][h - 1] for c, h in zip(picks, classes))
    return ",".join(parts) + "?" + query, "".join(roots[c] for c in picks)


def parse_mix(text: str) -> dict[int, float]:
    """ "1:0.5,3:0.5" -> {1: 0.5, 3: 0.5}: each class's hops and share (shares sum to 1)."""
    try:
        mix = {int(h): float(f) for h, _, f in (x.partition(":") for x in text.split(",") if x)}
    except ValueError:
        raise ValueError(f"--mix {text!r}: expected HOPS:SHARE,..., e.g. 1:0.5,3:0.5") from None
    if not mix or any(h < 1 or f <= 0 for h, f in mix.items()) or abs(sum(mix.values()) - 1) > 1e-9:
        raise ValueError(f"--mix {text!r}: hops >= 1, shares > 0 summing to 1")
    return mix


def _classes(n: int, mix: dict[int, float], rng: random.Random) -> list[int]:
    """Each row's class: round(n x share) rows of each class but the last (the rest), shuffled."""
    hops = list(mix)
    counts = [round(n * mix[h]) for h in hops[:-1]]
    counts.append(n - sum(counts))
    if counts[-1] < 0:
        raise ValueError(f"depth_mix: shares {mix} over {n} rows leave the last class none")
    out = [h for h, c in zip(hops, counts) for _ in range(c)]
    rng.shuffle(out)
    return out


def depth_mix_rows(n: int, mix: dict[int, float], seed: int, split: str,
                   avoid: set[str] | None = None, queries: int = 1, chains: int = 4,
                   answer: str = "digits") -> list[dict[str, Any]]:  # fmt: skip
    """``n`` distinct questions of the mix (module doc) not in ``avoid``: {"prompt", "answer",
    "hops"} rows; ``queries`` >= 2: the long variant's, of ``chains`` chains (``hops`` a string
    of the queries' classes), its answer the digits or (``answer`` "pairs") NAME=DIGIT items."""
    if answer not in ANSWERS:
        raise ValueError(f"depth_mix: --answer {answer!r}: expected one of {', '.join(ANSWERS)}")
    if queries >= 2:
        rows = _multi_rows(n, mix, seed, split, avoid, queries, chains)
        if answer == "pairs":
            for r in rows:
                r["answer"] = pairs(r["prompt"].partition("?")[2], r["answer"])
        return rows
    if queries != 1:
        raise ValueError(f"depth_mix: --queries {queries} must be >= 1")
    if answer != "digits":
        raise ValueError("depth_mix: --answer pairs needs the long variant (--queries >= 2)")
    rng = random.Random(f"depth_mix/{seed}/{split}")
    distractor = max(mix)
    rows: list[dict[str, Any]] = []
    seen = set(avoid or ())
    for hops in _classes(n, mix, rng):
        for _ in range(1000):
            q, a = depth_mix_row(rng, hops, distractor)
            if q not in seen:
                break
        else:
            raise ValueError(f"depth_mix: no new question of {hops} hops in 1000 draws")
        seen.add(q)
        rows.append({"prompt": q, "answer": a, "hops": hops})
    return rows


def pairs(names: str, digits: str) -> str:
    """The pairs answer of queried ``names`` and their ``digits``: "AB", "47" -> "A=4,B=7"."""
    return ",".join(f"{q}={d}" for q, d in zip(names, digits, strict=True))


def _multi_rows(n: int, mix: dict[int, float], seed: int, split: str, avoid: set[str] | None,
                queries: int, chains: int) -> list[dict[str, Any]]:  # fmt: skip
    """depth_mix_rows of the long variant: every row's classes by share (`_classes` over its
    ``queries``), then its question (`depth_mix_multi_row`), redrawn while it repeats."""
    rng = random.Random(f"depth_mix/{seed}/{split}/queries={queries}/chains={chains}")
    length = max(mix)
    if length > 9:
        raise ValueError(f"depth_mix: class {length} does not fit the hops column's one digit")
    counts = [round(queries * mix[h]) for h in list(mix)[:-1]]
    if min(counts, default=1) < 1 or sum(counts) >= queries:
        raise ValueError(f"depth_mix: shares {mix} over {queries} queries leave a class none a "
                         "row (every row asks each class at least once)")  # fmt: skip
    rows: list[dict[str, Any]] = []
    seen = set(avoid or ())
    for _ in range(n):
        classes = _classes(queries, mix, rng)
        for _ in range(1000):
            q, a = depth_mix_multi_row(rng, classes, chains, length)
            if q not in seen:
                break
        else:
            raise ValueError(f"depth_mix: no new question of {queries} queries in 1000 draws")
        seen.add(q)
        rows.append({"prompt": q, "answer": a, "hops": "".join(map(str, classes))})
    return rows


def write_depth_mix(out: Path, train: int, test: int, mix: dict[int, float], seed: int,
                    queries: int = 1, chains: int = 4, answer: str = "digits") -> None:  # fmt: skip
    """OUT/train.jsonl and OUT/test.jsonl (module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    tr = depth_mix_rows(train, mix, seed, "train", queries=queries, chains=chains, answer=answer)
    te = depth_mix_rows(test, mix, seed, "test", {r["prompt"] for r in tr}, queries, chains,
                        answer)  # fmt: skip
    for name, rows in (("train", tr), ("test", te)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def reward(text: str, tokens: list[int], task: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """1.0 when the completion (whitespace stripped) is task["answer"], else 0.0; info:
    ``correct``, and ``malformed`` when the completion is not exactly one digit."""
    got = text.strip()
    well = len(got) == 1 and got in DIGITS
    correct = well and got == str(task["answer"]).strip()
    return float(correct), {"correct": correct, "malformed": not well}


def reward_multi(text: str, tokens: list[int],
                 task: dict[str, Any]) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """The long variant's reward (module doc): the fraction of the scored queries whose digit
    the completion (whitespace stripped) has right, the scored queries all of task["answer"]'s
    or, with task["score_hops"], those whose class in task["hops"] is it; info ``correct`` (all
    scored right), ``malformed`` (not exactly as many digits as the answer, or in the pairs
    format as many NAME=DIGIT items: reward 0) and ``right`` (how many scored right). A pairs
    answer ("A=4,B=7") asks the pairs format; an item's digit counts only under its query's
    name."""
    answer, got = _items(str(task["answer"]).strip()), _items(text.strip())
    if not answer or not all(d in DIGITS and len(d) == 1 for _, d in answer):
        raise ValueError(f"depth_mix: answer {task['answer']!r} is not one or more digits or "
                         "NAME=DIGIT items")  # fmt: skip
    if answer[0][0]:  # pairs: K items of one letter, "=", one digit
        well = len(got) == len(answer) and all(len(q) == 1 and q in CAPITALS for q, _ in got)
    else:
        well = len(got) == len(answer) and not got[0][0]
    well = well and all(len(d) == 1 and d in DIGITS for _, d in got)
    scored = list(range(len(answer)))
    if task.get("score_hops") is not None:
        classes = str(task["hops"])
        if len(classes) != len(answer):
            raise ValueError(f"depth_mix: hops {classes!r} has {len(classes)} classes for the "
                             f"{len(answer)} answer digits {task['answer']!r}")  # fmt: skip
        scored = [j for j, h in enumerate(classes) if h == str(task["score_hops"])]
        if not scored:
            raise ValueError(f"depth_mix: score_hops {task['score_hops']}: no query of that "
                             f"class in hops {classes!r}")  # fmt: skip
    right = sum(got[j] == answer[j] for j in scored) if well else 0  # (name and digit)
    frac = right / len(scored)
    return frac, {"correct": well and right == len(scored), "malformed": not well,
                  "right": right}  # fmt: skip


def _items(text: str) -> list[tuple[str, str]]:
    """A long-variant answer's (name, digit) items: "A=4,B=7" -> [("A", "4"), ("B", "7")];
    digits alone ("47") -> [("", "4"), ("", "7")]; a pairs item without one "=" -> ("?", it),
    which no answer's item equals."""
    if "=" not in text and "," not in text:
        return [("", c) for c in text]
    out = []
    for item in text.split(","):
        name, eq, digit = item.partition("=")
        out.append((name, digit) if eq and "=" not in digit else ("?", item))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m generator.depth_mix",
                                description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    p.add_argument("out", type=Path, help="output directory (train.jsonl, test.jsonl)")
    p.add_argument("--train", type=int, default=4000, help="train rows")
    p.add_argument("--test", type=int, default=200, help="test rows")
    p.add_argument("--mix", default="1:0.5,2:0.5", help="HOPS:SHARE,... (shares sum to 1)")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--queries", type=int, default=1,
                   help="queried names a question (1: one digit answers; K >= 2: the long "
                   "variant, K digits)")  # fmt: skip
    p.add_argument("--chains", type=int, default=None,
                   help="the long variant's chains a question (default 4)")  # fmt: skip
    p.add_argument("--answer", default="digits", choices=ANSWERS,
                   help="the long variant's answer: the K digits (default) or K NAME=DIGIT "
                   "items, comma-separated")  # fmt: skip
    a = p.parse_args(argv)
    try:
        if a.chains is not None and a.queries < 2:
            raise ValueError(f"--chains {a.chains}: only the long variant (--queries >= 2) has "
                             "chains to count; a single query has its chain and one distractor")  # fmt: skip
        write_depth_mix(a.out, a.train, a.test, parse_mix(a.mix), a.seed, a.queries,
                        4 if a.chains is None else a.chains, a.answer)  # fmt: skip
    except ValueError as e:
        print(f"python -m generator.depth_mix: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
