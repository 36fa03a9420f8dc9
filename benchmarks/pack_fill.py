"""How full the packed rows of benchmarks/trainer_gpu.py's spread are, in training order (next
fit, the earlier rule) and in first-fit-decreasing bins (`learner.batching.pack_updates`):
a function of the rollouts' lengths alone, so no model and no GPU. One JSON line.

    python benchmarks/pack_fill.py                       # Huginn-0125 shape, 16 and 64 rollouts
    python benchmarks/pack_fill.py --batches 16,64,256 --budget 8192 --steps 7

Rows: trainer_gpu.py's own `spread_rollouts` (responses U(--resp-min, --resp-max) after the
shape's prompt) for steps 0..--steps-1, built into the learner's batch (`build_batch`), one
update per step on one rank; each micro-batch padded to the budget (trainer_gpu's
``--pack-multiple`` = ``--budget``: one compiled shape). fill = real tokens / positions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.trainer_gpu import SHAPES, prompt_len, spread_rollouts  # noqa: E402
from learner.batching import build_batch  # noqa: E402
from models.token_rows import micro_spans, pack_order  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shape", default="huginn_0125", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="16,64", help="rollouts a step, comma-separated")
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--resp-min", type=int, default=256)
    ap.add_argument("--resp-max", type=int, default=4096)
    ap.add_argument(
        "--steps", type=int, default=7, help="steps drawn (trainer_gpu: warm-up + timed)"
    )
    a = ap.parse_args()
    out = []
    for batch in (int(x) for x in a.batches.split(",") if x):
        s = dict(SHAPES[a.shape], batch=batch, vocab=1000)  # (the tokens' values do not matter)
        s["seq"] = max(s["seq"], prompt_len(s) + a.resp_max - 1)  # as trainer_gpu widens it
        real = nf = ffd = 0
        for step in range(a.steps):
            lens = build_batch(spread_rollouts(s, step, 0, 0, a.resp_min, a.resp_max)).seq_lens
            lens = lens.numpy()
            real += int(lens.sum())
            nf += a.budget * len(micro_spans(lens, a.budget))
            ffd += a.budget * len(micro_spans(lens[pack_order(lens, a.budget)], a.budget))
        out.append({"rollouts_a_step": batch, "real_tokens": real,
                    "positions_next_fit": nf, "fill_next_fit": round(real / nf, 3),
                    "positions_ffd": ffd, "fill_ffd": round(real / ffd, 3)})  # fmt: skip
    print(json.dumps({"bench": "pack_fill", "shape": a.shape, "budget": a.budget,
                      "resp": [a.resp_min, a.resp_max], "steps": a.steps, "rows": out}))  # fmt: skip


if __name__ == "__main__":
    main()
