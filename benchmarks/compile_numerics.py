"""Does inductor (vLLM's CPU compile backend) keep the looped blocks' fast-mode bits?

    OMP_NUM_THREADS=1 python benchmarks/compile_numerics.py

The CPU part of the compiled decode's numerics. Two checks, printed as JSON lines:

1. per primitive of a tiny Huginn `SandwichBlock` (32 rows, fast numerics): how many output
   elements `torch.compile(backend="inductor")` changes against eager (rms_norm, RoPE,
   silu * up, linear, the block's `qkv` and `post`);
2. the tiny Huginn reference forward (2 x 24 tokens, all positions, FixedDepth = 6) with
   every block's `qkv` / `post` compiled by inductor: max |log-prob - eager log-prob| over
   every vocabulary entry, once as is and once with `models.numerics.rms_norm` made opaque to
   inductor (a `torch.library` custom op running the eager kernels).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import numerics as nx  # noqa: E402
from models.checkpoint import load_model  # noqa: E402
from models.huginn import precompute_freqs_cis  # noqa: E402
from models.layers import SandwichBlock  # noqa: E402
from models.random_init import init_checkpoint  # noqa: E402

_EAGER_RMS_NORM = nx.rms_norm


@torch.library.custom_op("looprl_bench::rms_norm", mutates_args=())
def _opaque_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _EAGER_RMS_NORM(x, weight, eps, "fast")


@_opaque_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def _rms_norm_opaque(x: Tensor, weight: Tensor, eps: float, mode: str = "fast") -> Tensor:
    if mode == "fast":
        return _opaque_rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    return _EAGER_RMS_NORM(x, weight, eps, mode)


def primitives() -> None:
    torch.manual_seed(0)
    blk = SandwichBlock(64, 2, 128, 1e-6, True)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.3)
    x, attn, w = torch.randn(32, 64), torch.randn(32, 64), torch.randn(64)
    rope = precompute_freqs_cis(32, 512, 50000.0)[0, torch.arange(32) + 7, 0]
    q = torch.randn(32, 2, 2, 32)
    fns: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]] = {
        "rms_norm": (lambda t: nx.rms_norm(t, w, 1e-6, "fast"), x),
        "rope_adjacent": (lambda t: nx.rope_adjacent(t, rope[:, None, None], "fast"), q),
        "silu_mul": (lambda t: nx.silu_mul(t, 2 * t, "fast"), x),
        "linear": (lambda t: nx.linear(t, blk.attn.Wqkv.weight, None, "fast"), x),
        "qkv": (lambda t: torch.cat([a.reshape(32, -1) for a in blk.qkv(t, rope, "fast")], -1), x),
        "post": (lambda t: blk.post(t, attn, "fast"), x),
    }
    with torch.no_grad():
        for name, (f, arg) in fns.items():
            eager = f(arg)
            comp = torch.compile(f, backend="inductor", fullgraph=True)(arg)
            differ = int((eager.view(torch.int32) != comp.view(torch.int32)).sum())
            line = {"primitive": name, "elements": eager.numel(), "differ": differ,
                    "max_abs": float((eager - comp).abs().max())}  # fmt: skip
            print(json.dumps(line), flush=True)


def model_logprobs(opaque_norm: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        model: Any = load_model(init_checkpoint("huginn", "tiny", Path(tmp) / "h"))[1].eval()
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = torch.log_softmax(model(ids, [11, 12], numerics="fast"), -1)
        if opaque_norm:
            nx.rms_norm = _rms_norm_opaque  # type: ignore[assignment]
        try:
            for blk in model.modules():
                if isinstance(blk, SandwichBlock):
                    blk.qkv = torch.compile(blk.qkv, backend="inductor", dynamic=False)  # type: ignore[method-assign]
                    blk.post = torch.compile(blk.post, backend="inductor", dynamic=False)  # type: ignore[method-assign]
            comp = torch.log_softmax(model(ids, [11, 12], numerics="fast"), -1)
        finally:
            nx.rms_norm = _EAGER_RMS_NORM  # type: ignore[assignment]
    return float((eager - comp).abs().max())


def main() -> int:
    torch.set_num_threads(1)
    primitives()
    for opaque in (False, True):
        torch._dynamo.reset()
        diff = model_logprobs(opaque)
        print(json.dumps({"model": "huginn tiny reference, blocks compiled",
                          "rms_norm_opaque": opaque, "max_abs_logprob_diff": diff}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
