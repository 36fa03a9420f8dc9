"""The mixed-depth task: copying and multi-hop variable tracking in one split, so that some
answers need one lookup and others every hop (docs/TASKS.md, "Mixed depth").

    python -m generator.depth_mix OUT_DIR [--train 4000] [--test 200] [--mix 1:0.5,2:0.5]
                                  [--seed 0]

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
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["depth_mix_row", "depth_mix_rows", "parse_mix", "reward", "write_depth_mix"]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


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
                   avoid: set[str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``n`` distinct questions of the mix (module doc) not in ``avoid``: {"prompt", "answer",
    "hops"} rows."""
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


def write_depth_mix(out: Path, train: int, test: int, mix: dict[int, float], seed: int) -> None:
    """OUT/train.jsonl and OUT/test.jsonl (module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    tr = depth_mix_rows(train, mix, seed, "train")
    te = depth_mix_rows(test, mix, seed, "test", {r["prompt"] for r in tr})
    for name, rows in (("train", tr), ("test", te)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def reward(text: str, tokens: list[int], task: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """1.0 when the completion (whitespace stripped) is task["answer"], else 0.0; info:
    ``correct``, and ``malformed`` when the completion is not exactly one digit."""
    got = text.strip()
    well = len(got) == 1 and got in DIGITS
    correct = well and got == str(task["answer"]).strip()
    return float(correct), {"correct": correct, "malformed": not well}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m generator.depth_mix",
                                description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    p.add_argument("out", type=Path, help="output directory (train.jsonl, test.jsonl)")
    p.add_argument("--train", type=int, default=4000, help="train rows")
    p.add_argument("--test", type=int, default=200, help="test rows")
    p.add_argument("--mix", default="1:0.5,2:0.5", help="HOPS:SHARE,... (shares sum to 1)")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    a = p.parse_args(argv)
    try:
        write_depth_mix(a.out, a.train, a.test, parse_mix(a.mix), a.seed)
    except ValueError as e:
        print(f"python -m generator.depth_mix: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
