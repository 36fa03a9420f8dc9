"""The torch engine's decode-attention kernel (models.engine.attention) at one shape, per launch
configuration: microseconds a call and the fraction of the HBM bound (each call reads the
slot's keys and values once: B x T x G x D x 2 tensors x the dtype's bytes). One JSON line.

    python benchmarks/decode_attention.py                       # Huginn-0125 decode, batch 64
    python benchmarks/decode_attention.py --batch 64 --length 81 --heads 55 --dim 96

Default shape: the torch-engine benchmark's step (docs/PERFORMANCE.md "Toward the HBM bound":
batch 64, 64-token prompts + 16 tokens, so a cache of 81 positions, 55 heads of 96, bf16),
where the kernel took 11.6 ms of a 48 ms decode step in 132 calls (88 us each). Checks every
configuration against the first one's output (within bf16 rounding) before timing it.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.cost import card_peaks  # noqa: E402
from models.engine.attention import decode_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=81, help="cache positions T")
    ap.add_argument("--heads", type=int, default=55)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument(
        "--hbm-tb-s",
        type=float,
        default=None,
        help="the card's memory bandwidth (default: models.cost.card_peaks)",
    )
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    if a.hbm_tb_s is None:
        peaks = card_peaks(torch.cuda.get_device_name())
        a.hbm_tb_s = peaks[1] / 1e12 if peaks else 3.35
    g = torch.Generator(device=dev).manual_seed(0)
    b, t, h, d = a.batch, a.length, a.heads, a.dim
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(b, t, h, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(b, t, h, d, device=dev, dtype=dt, generator=g)
    mask = torch.ones(b, 1, t, dtype=torch.bool, device=dev)
    mask[: b // 2, :, t - 5 :] = False  # some rows see fewer keys
    ref = decode_attention(q, k, v, mask).float()
    nbytes = 2 * b * t * h * d * k.element_size()
    rows = []
    for bt, nw, ns in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3)):
        try:
            out = decode_attention(q, k, v, mask, block_t=bt, num_warps=nw, num_stages=ns)
            err = float((out.float() - ref).abs().max())
            for _ in range(10):
                decode_attention(q, k, v, mask, block_t=bt, num_warps=nw, num_stages=ns)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.reps):
                decode_attention(q, k, v, mask, block_t=bt, num_warps=nw, num_stages=ns)
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / a.reps
            rows.append({"block_t": bt, "num_warps": nw, "num_stages": ns, "us": round(us, 2),
                         "of_bound": round(nbytes / (us * 1e-6) / (a.hbm_tb_s * 1e12), 3),
                         "max_err": err})  # fmt: skip
        except Exception as e:  # noqa: BLE001  (a configuration the compiler refuses)
            rows.append({"block_t": bt, "num_warps": nw, "num_stages": ns,
                         "error": f"{type(e).__name__}: {str(e)[:120]}"})  # fmt: skip
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    kw = inspect.signature(decode_attention).parameters  # the engine's launch: the defaults
    engine = (kw["block_t"].default, kw["num_warps"].default, kw["num_stages"].default)
    default = next(
        (r for r in ok if (r["block_t"], r["num_warps"], r["num_stages"]) == engine), None
    )
    print(json.dumps({"bench": "decode_attention", "shape": vars(a), "bytes_per_call": nbytes,
                      "default": default, "best": best,
                      "configs": sorted(ok, key=lambda r: r["us"])[:12],
                      "errors": [r for r in rows if "error" in r][:4]}))  # fmt: skip


if __name__ == "__main__":
    main()
