"""Triton `token_stats` against the PyTorch path on a GPU: correctness and speed, one JSON line.

    python benchmarks/token_stats_gpu.py            # N=4096, V=151936 and V=32768, bf16

Checks, per vocabulary size (fresh random logits: new ~ 2 N(0,1), old = new + 0.3 N(0,1) with
a quarter of the rows top-50 truncated to -inf, temperature 0.8):
- values (logp, entropy, kl, logp_old) and d logits_new of a random weighted loss, Triton vs
  `learner.vocab_ops.token_stats` on the same bf16 inputs (max abs diffs; grads also as a
  relative norm), and both against an fp64 run of the PyTorch path on the first 256 rows;
- timing with `triton.testing.do_bench` (median ms), forward only and forward + backward, for
  the Triton kernels (after a small sweep of tile width / warps) and the PyTorch path, with
  the effective bandwidth of the Triton kernels (minimal bytes: forward reads both logit
  tensors, backward reads both and writes the gradient).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.kernels.token_stats import TritonConfig, token_stats_triton  # noqa: E402
from learner.vocab_ops import TokenStats, token_stats  # noqa: E402

FIELDS = ("logp", "entropy", "kl", "logp_old")
SWEEP = ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))
TEMPERATURE = 0.8


DEVICE = "cuda"


def make_inputs(n: int, v: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    new = torch.randn(n, v, device=DEVICE, generator=gen) * 2.0
    old = new + 0.3 * torch.randn(n, v, device=DEVICE, generator=gen)
    trunc = torch.arange(n, device=DEVICE) % 4 == 0
    kth = old.topk(50, dim=-1).values[:, -1:]
    old = torch.where(trunc[:, None] & (old < kth), float("-inf"), old)
    targets = torch.randint(0, v, (n,), device=DEVICE, generator=gen)
    top = old.argmax(-1)
    targets = torch.where(trunc, top, targets)  # truncated rows: a target inside the support
    weights = torch.randn(3, n, device=DEVICE, generator=gen)
    return new.to(dtype), old.to(dtype), targets, weights


def weighted_loss(out: TokenStats, w: torch.Tensor) -> torch.Tensor:
    assert out.kl is not None
    return (w[0] * out.logp).sum() + (w[1] * out.entropy).sum() + (w[2] * out.kl).sum()


def run_with_grad(fn: Any, new: torch.Tensor, old: torch.Tensor, tg: torch.Tensor, w: Any) -> Any:
    x = new.detach().requires_grad_()
    out = fn(x, old, tg, TEMPERATURE)
    (grad,) = torch.autograd.grad(weighted_loss(out, w), x)
    return out, grad


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isinf(a) & torch.isinf(b), 0.0, d)
    return float(d.max()) if same_inf else float("inf")


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(n: int, v: int, seed: int) -> dict[str, Any]:
    new, old, tg, w = make_inputs(n, v, torch.bfloat16, seed)
    tri, g_tri = run_with_grad(token_stats_triton, new, old, tg, w)
    ref, g_ref = run_with_grad(token_stats, new, old, tg, w)
    res: dict[str, Any] = {
        f"{f}_maxabs_vs_torch": max_abs(getattr(tri, f), getattr(ref, f)) for f in FIELDS
    }
    res["grad_maxabs_vs_torch"] = max_abs(g_tri.float(), g_ref.float())
    res["grad_relnorm_vs_torch"] = rel_norm(g_tri.float(), g_ref.float())
    res["grad_dtype"] = str(g_tri.dtype).replace("torch.", "")
    res["nan"] = bool(
        any(torch.isnan(getattr(tri, f)).any() for f in FIELDS) or g_tri.isnan().any()
    )
    m = 256  # fp64 truth on a slice of rows
    ref64, g64 = run_with_grad(
        token_stats, new[:m].double(), old[:m].double(), tg[:m], w[:, :m].double()
    )
    for name, out, g in (("triton", tri, g_tri), ("torch", ref, g_ref)):
        res[f"{name}_vs_fp64_maxabs"] = max(
            max_abs(getattr(out, f)[:m], getattr(ref64, f)) for f in FIELDS
        )
        res[f"{name}_grad_vs_fp64_relnorm"] = rel_norm(g[:m].float(), g64)
    return res


def bench(n: int, v: int, seed: int) -> dict[str, Any]:
    from triton.testing import do_bench

    new, old, tg, w = make_inputs(n, v, torch.bfloat16, seed + 1)
    x = new.detach().requires_grad_()

    def fwd(fn: Any) -> Any:
        return lambda: fn(new, old, tg, TEMPERATURE)

    def fwd_bwd(fn: Any) -> Any:
        return lambda: torch.autograd.grad(weighted_loss(fn(x, old, tg, TEMPERATURE), w), x)

    def ms(f: Any) -> float:
        return float(do_bench(f, warmup=50, rep=300, return_mode="median"))

    sweep = {}
    for block, warps in SWEEP:
        TritonConfig.fwd_block = TritonConfig.bwd_block = block
        TritonConfig.fwd_warps = TritonConfig.bwd_warps = warps
        sweep[f"{block}x{warps}"] = (ms(fwd(token_stats_triton)), ms(fwd_bwd(token_stats_triton)))
    best_fwd = min(sweep, key=lambda k: sweep[k][0])
    best_bwd = min(sweep, key=lambda k: sweep[k][1] - sweep[k][0])
    TritonConfig.fwd_block, TritonConfig.fwd_warps = (int(s) for s in best_fwd.split("x"))
    TritonConfig.bwd_block, TritonConfig.bwd_warps = (int(s) for s in best_bwd.split("x"))
    t_fwd, t_fb = ms(fwd(token_stats_triton)), ms(fwd_bwd(token_stats_triton))
    r_fwd, r_fb = ms(fwd(token_stats)), ms(fwd_bwd(token_stats))
    elem = n * v * new.element_size()
    return {
        "triton_fwd_ms": round(t_fwd, 4),
        "triton_fwd_bwd_ms": round(t_fb, 4),
        "torch_fwd_ms": round(r_fwd, 4),
        "torch_fwd_bwd_ms": round(r_fb, 4),
        "speedup_fwd": round(r_fwd / t_fwd, 2),
        "speedup_fwd_bwd": round(r_fb / t_fb, 2),
        "triton_fwd_GBps": round(2 * elem / t_fwd / 1e6, 1),
        "triton_bwd_GBps": round(3 * elem / max(t_fb - t_fwd, 1e-6) / 1e6, 1),
        "best_fwd_cfg": best_fwd,
        "best_bwd_cfg": best_bwd,
        "sweep_ms_fwd_fwdbwd": {k: [round(a, 4), round(b, 4)] for k, (a, b) in sweep.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 32768])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="checks only, on CPU (TRITON_INTERPRET=1)"
    )
    args = ap.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("token_stats_gpu.py needs a CUDA device")
    result: dict[str, Any] = {
        "bench": "token_stats_gpu",
        "device": "cpu" if args.cpu_smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "n": args.n,
        "dtype": "bfloat16",
        "temperature": TEMPERATURE,
    }
    for v in args.vocab:
        timing = {} if args.cpu_smoke else bench(args.n, v, args.seed)
        result[f"V{v}"] = {**check(args.n, v, args.seed), **timing}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
