"""A decode step's draw on the card: the spec's ops as the torch engine ran them (the fp32 cast,
the temperature, torch's log_softmax, the compiled race, the picked log-prob) against the fused
kernel pair of models.kernels.draw, at the 1b decode's shape (256 rows x vocabulary 65,536, bf16
logits), inside fused_generation like the engine. One JSON line: microseconds a draw each, and
how many of the rows' tokens the two agree on (the spec's eager race is the reference).

    python benchmarks/draw_gpu.py                    # 256 x 65,536
    python benchmarks/draw_gpu.py --rows 64 --vocab 65536
    python benchmarks/draw_gpu.py --sweep            # + "sweep": us per (block, splits, warps)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import numerics as nx  # noqa: E402
from models.kernels.draw import draw_step, draw_triton  # noqa: E402
from models.reference import behaviour_logprobs  # noqa: E402
from models.sampling import draw_keys  # noqa: E402


def spec_draw(logits: torch.Tensor, vocab: int, temp: float, keys: torch.Tensor,
              steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    lp = behaviour_logprobs(logits, vocab, temp, 1.0, "fast")
    tok = draw_keys(lp, keys, steps)  # compiled inside fused_generation
    return tok, lp.gather(1, tok[:, None])[:, 0]


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the kernel at other tiles, splits and warps")  # fmt: skip
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(a.rows, a.vocab, generator=gen) * 3).to(torch.bfloat16).cuda()
    keys = torch.randint(-(2**63), 2**63 - 1, (a.rows,), dtype=torch.int64, generator=gen).cuda()
    steps = torch.arange(a.rows, dtype=torch.int64).cuda()
    with torch.no_grad(), nx.fused_generation():
        spec_us = timed(lambda: spec_draw(logits, a.vocab, a.temperature, keys, steps), a.reps)
        fused_us = timed(lambda: draw_triton(logits, a.vocab, a.temperature, keys, steps), a.reps)
        tok, _ = draw_step(logits, a.vocab, a.temperature, 1.0, "fast", keys, steps)
        sweep = {}
        for block, splits, warps in ([(b, s, w) for b in (512, 1024, 2048) for s in (8, 16, 32)
                                      for w in (4, 8)] if a.sweep else []):  # fmt: skip
            sweep[f"{block}/{splits}/{warps}"] = round(timed(lambda b=block, s=splits, w=warps: (
                draw_triton(logits, a.vocab, a.temperature, keys, steps, block=b, splits=s,
                            warps=w)), a.reps), 1)  # fmt: skip
    lp = behaviour_logprobs(logits, a.vocab, a.temperature, 1.0, "fast")
    want = draw_keys(lp, keys, steps)  # eager: the spec's race
    print(json.dumps({
        "bench": "draw", "device": torch.cuda.get_device_name(), "rows": a.rows,
        "vocab": a.vocab, "spec_us": round(spec_us, 1), "fused_us": round(fused_us, 1),
        "speedup": round(spec_us / fused_us, 2),
        "same_tokens": int((tok == want).sum()), "logit_bytes_gb_s": round(
            logits.numel() * 2 / (fused_us * 1e-6) / 1e9, 1),
        **({"sweep": sweep} if sweep else {}),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
