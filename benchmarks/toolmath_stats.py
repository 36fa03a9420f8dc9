"""What a configs/toolmath.yaml run learned, from its recorded conversations (one JSON line).

    python benchmarks/toolmath_stats.py RUN_DIR [--window 20]

Reads RUN_DIR/steps.jsonl (which rollouts each step trained) and RUN_DIR/stream, joins each
rollout to its data row (prompt_id = the row's id in task.path's train split, for its kind:
ask, direct or copy) and prints, for the first and the last ``window`` steps: reward_mean and
solved (the environment's ``correct``) over all trained conversations, and on the "ask" rows
(the question alone, what the test split holds): solved, the share of conversations that call
the calculator (``tool_calls`` > 0), that call it on exactly the question's expression, and
that answer the tool's result after calling it; plus the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.chat import ChatRenderer  # noqa: E402
from pipeline.config.run import load_config  # noqa: E402
from pipeline.core.recorder import read_rollouts  # noqa: E402


def turns_of(tokens: list[int], mask: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    prev = 0
    for t, m in zip(tokens, mask):
        if m and not prev:
            out.append([])
        if m:
            out[-1].append(t)
        prev = m
    return out


def window_stats(rolls: list[Any], rows: dict[str, dict], decode: Any) -> dict[str, float]:
    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4) if xs else float("nan")

    ask = [r for r in rolls if rows[r.prompt_id]["kind"] == "ask"]
    exact, copied, calls = [], [], []
    for r in ask:
        texts = [decode(t).strip() for t in turns_of(r.tokens.tolist(), r.token_mask.tolist())]
        q = rows[r.prompt_id]["prompt"][0]["content"]
        expr = re.search(r"(\d+\*\d+)", q).group(1)  # type: ignore[union-attr]
        call = bool(texts) and texts[0].startswith("calc")
        calls.append(float(call))
        exact.append(float(call and texts[0].replace(" ", "") == f"calc{expr}"))
        if call and len(texts) > 1:
            copied.append(float(r.reward_info.get("correct", 0) == 1))
    return {
        "reward_mean": mean([float(r.reward or 0.0) for r in rolls]),
        "solved": mean([float(r.reward_info.get("correct", 0)) for r in rolls]),
        "ask_solved": mean([float(r.reward_info.get("correct", 0)) for r in ask]),
        "ask_calls_tool": mean(calls),
        "ask_calls_exact_expression": mean(exact),
        "ask_answers_after_call_correct": mean(copied),
        "conversations": len(rolls),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--window", type=int, default=20)
    a = ap.parse_args(argv)
    cfg = load_config(a.run_dir / "config.yaml")
    data = Path(cfg.task.path)
    rows = {}
    for line in (data / f"{cfg.task.split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["id"]] = row
    steps = [json.loads(x) for x in (a.run_dir / "steps.jsonl").read_text().splitlines()]
    by_id = {r.rollout_id: r for _, r in read_rollouts(a.run_dir / "stream")}
    tok_dir = a.run_dir / "init" if (a.run_dir / "init" / "tokenizer.json").is_file() else None
    decode = ChatRenderer.from_checkpoint(tok_dir or Path(cfg.model.path)).decode
    first = [by_id[i] for s in steps[: a.window] for i in s["rollout_ids"] if i in by_id]
    last = [by_id[i] for s in steps[-a.window :] for i in s["rollout_ids"] if i in by_id]
    metrics = [json.loads(x) for x in (a.run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {
        "run_dir": str(a.run_dir), "seed": cfg.seed, "steps": len(steps), "window": a.window,
        "first": window_stats(first, rows, decode), "last": window_stats(last, rows, decode),
        "rl_s": round(float(metrics[-1].get("elapsed_s", float("nan"))), 1),
    }  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
