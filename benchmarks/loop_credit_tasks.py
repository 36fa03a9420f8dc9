"""The synthetic tasks of benchmarks/loop_credit.py (its --task): multi-step questions whose
one-digit answers need several steps (variable tracking, chained sums, reversed addition,
parity, comparison) and ``mix``, the mixed-depth task (generator.depth_mix: half copying,
half tracking through ``chain`` assignments), the jsonl splits the benchmark writes, and
`Task`: the splits rendered as plain text and the exact-match scorer, and the held-out
evaluation (greedy, under an exit policy and at fixed depths; by class where the rows carry
``hops``). Split from loop_credit.py by concern."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from generator.depth_mix import write_depth_mix
from generator.rewards import exact_match
from models.chat import eos_token_ids
from models.exits import ExitPolicy, FixedDepth
from models.noise import derive_latent_seed
from models.reference import SamplingParams, generate
from pipeline.core.dispatch import Prompt

__all__ = ["TASKS", "TASK_NAMES", "Task", "eval_all", "evaluate", "make_rows", "write_data"]


def _sum_row(rng: random.Random, chain: int) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(chain + 1)]
    return "+".join(map(str, digits)) + "=", str(sum(digits) % 10)


def _vars_row(rng: random.Random, chain: int) -> tuple[str, str]:
    """Two pointer chains of ``chain`` assignments each ("x=7,y=x,z=y"), from two different
    digits, over distinct letters, all assignments shuffled; the query names the end of the
    first chain: "y=x,b=4,x=7,c=b,z=y?z" -> "7"."""
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", 2 * chain)
    roots = rng.sample(range(10), 2)
    parts, query = [], ""
    for c in range(2):
        names = letters[c * chain : (c + 1) * chain]
        parts.append(f"{names[0]}={roots[c]}")
        parts += [f"{b}={a}" for a, b in zip(names, names[1:])]
        query = query or names[-1]
    rng.shuffle(parts)
    return ",".join(parts) + "?" + query, str(roots[0])


def _add_row(rng: random.Random, chain: int) -> tuple[str, str]:
    """Two ``chain``-digit numbers, their sum written least significant digit first (the
    order the carries run): "37+45=" -> "28" (82), "57+65=" -> "221" (122)."""
    a, b = (rng.randrange(10**chain) for _ in range(2))
    return f"{a:0{chain}d}+{b:0{chain}d}=", str(a + b)[::-1]


def _parity_row(rng: random.Random, chain: int) -> tuple[str, str]:
    """``chain`` + 1 bits, their parity: "10110=" -> "1"."""
    bits = [rng.randint(0, 1) for _ in range(chain + 1)]
    return "".join(map(str, bits)) + "=", str(sum(bits) % 2)


def _cmp_row(rng: random.Random, chain: int) -> tuple[str, str]:
    """Two ``chain``-digit numbers, "1" if the first is smaller else "0": "37<45=" -> "1"
    (digit by digit from the most significant: the next digit decides only on a tie)."""
    a, b = (rng.randrange(10**chain) for _ in range(2))
    return f"{a:0{chain}d}<{b:0{chain}d}=", str(int(a < b))


TASKS = {
    "cmp": _cmp_row,
    "sum": _sum_row,
    "vars": _vars_row,
    "add": _add_row,
    "parity": _parity_row,
}
"""--task: a row builder (rng, chain) -> (question, one-digit answer)."""

TASK_NAMES = (*sorted(TASKS), "mix")
"""--task's choices: TASKS, and ``mix`` (generator.depth_mix, classes of 1 and ``chain`` hops
in equal shares)."""


def make_rows(n: int, task: str, chain: int, seed: int, split: str,
              avoid: set[str]) -> list[dict[str, str]]:  # fmt: skip
    """``n`` distinct questions of ``task`` (TASKS) with ``chain`` steps, and their answers."""
    if task == "sum" and n + len(avoid) > 10 ** (chain + 1):
        raise SystemExit(f"--chain {chain} has only {10 ** (chain + 1)} distinct questions")
    rng = random.Random(f"{seed}/{split}")
    rows: list[dict[str, str]] = []
    seen = set(avoid)
    while len(rows) < n:
        q, a = TASKS[task](rng, chain)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt": q, "answer": a})
    return rows


def write_data(out: Path, train: int, test: int, task: str, chain: int, seed: int) -> None:
    if task == "mix":
        if chain < 2:
            raise SystemExit(f"--task mix: --chain is the tracking class's hops, >= 2; got {chain}")
        write_depth_mix(out, train, test, {1: 0.5, chain: 0.5}, seed)
        return
    out.mkdir(parents=True, exist_ok=True)
    tr = make_rows(train, task, chain, seed, "train", set())
    te = make_rows(test, task, chain, seed, "test", {r["prompt"] for r in tr})
    for name, rows in (("train", tr), ("test", te)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


class Task:
    """The splits rendered as plain text (bos + the question's tokens; the target: the answer's
    tokens + EOS, what ``looprl sft`` trains on with task.template=plain), and the scorer."""

    def __init__(self, data: Path, tok_dir: Path) -> None:
        self.tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        self.stops = tuple(eos_token_ids(tok_dir))
        self.train, self.test = (self._rows(data / f"{s}.jsonl", s) for s in ("train", "test"))

    def _rows(self, path: Path, split: str) -> list[Prompt]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [Prompt(f"{split}-{i}", list(self.tok.encode(r["prompt"]).ids),
                       {k: r[k] for k in ("answer", "hops") if k in r})
                for i, r in enumerate(rows)]  # fmt: skip

    def target(self, p: Prompt) -> list[int]:
        ids = list(self.tok.encode(str(p.task["answer"]), add_special_tokens=False).ids)
        return [*ids, self.stops[0]]

    def score(self, tokens: list[int], task: dict[str, Any]) -> float:
        text = self.tok.decode(tokens, skip_special_tokens=True)
        return float(exact_match(text, tokens, task)[0])


def _scores(model: Any, task: Task, policy: ExitPolicy | None, max_tokens: int,
            numerics: str) -> tuple[list[float], list[int]]:  # fmt: skip
    """(each test question's greedy exact match, every generated token's exit depth)."""
    sp = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=task.stops, greedy=True)
    seeds = [derive_latent_seed(0, f"eval/{p.prompt_id}", 0) for p in task.test]
    with torch.no_grad():
        gens = generate(model, [p.tokens for p in task.test], seeds, sp, policy, numerics)
    acc = [task.score([int(t) for t in g.tokens], dict(p.task)) for p, g in zip(task.test, gens)]
    return acc, [d for g in gens for d in g.exit_depths]


def evaluate(model: Any, task: Task, policy: ExitPolicy | None, max_tokens: int,
             numerics: str) -> tuple[float, float]:  # fmt: skip
    """(greedy test accuracy, token-mean exit depth) under ``policy`` (None: full depth)."""
    acc, depths = _scores(model, task, policy, max_tokens, numerics)
    return sum(acc) / len(acc), sum(depths) / max(len(depths), 1)


def eval_all(model: Any, task: Task, policy: ExitPolicy | None, depths: list[int],
             max_tokens: int, numerics: str) -> dict[str, float]:  # fmt: skip
    """Greedy test accuracy and mean exit depth under ``policy``, the accuracy at each fixed
    depth ("accuracy@d"); where the rows carry ``hops`` (--task mix) also each class's
    ("accuracy/hops=h", "accuracy@d/hops=h")."""
    was = model.training
    model.eval()
    classes = sorted({int(p.task["hops"]) for p in task.test if "hops" in p.task})

    def figures(suffix: str, pol: ExitPolicy | None) -> dict[str, float]:
        acc, ds = _scores(model, task, pol, max_tokens, numerics)
        out = {f"accuracy{suffix}": sum(acc) / len(acc)}
        for h in classes:
            mine = [a for a, p in zip(acc, task.test) if int(p.task["hops"]) == h]
            out[f"accuracy{suffix}/hops={h}"] = sum(mine) / len(mine)
        if not suffix:
            out["mean_depth"] = sum(ds) / max(len(ds), 1)
        return out

    out = figures("", policy)
    for d in depths:
        out |= figures(f"@{d}", FixedDepth(d))
    model.train(was)
    return out
