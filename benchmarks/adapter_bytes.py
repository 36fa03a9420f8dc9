"""Bytes a version carries to a generator, full set vs adapter set (learner.lora.publish,
weights.adapters), from the model's shapes alone (built on the meta device: no memory).

    PYTHONPATH=. python -m benchmarks.adapter_bytes --size 0125 --rank 16 --dtype bfloat16
    PYTHONPATH=. python -m benchmarks.adapter_bytes --size tiny --rank 16 --dtype float32

The full set is every stored tensor (a tied head once); the adapter set A [r, in] and
B [out, r] of each linear the default learner.lora.targets match, plus every RMSNorm weight
(learner.lora.train_norms, the default), in the given dtype (the learner's parameter dtype).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from learner.config import LoraConfig
from learner.lora import linear_names, select_targets
from models.layers import RMSNorm
from models.random_init import model_config
from models.reference import build_model
from models.ties import tied_from_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="huginn")
    ap.add_argument("--size", default="0125")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    item = torch.finfo(getattr(torch, a.dtype)).bits // 8
    with torch.device("meta"):
        model = build_model(model_config(a.family, a.size), seed=0)
    tied = set(tied_from_module(model))
    full = sum(t.numel() for n, t in model.state_dict().items() if n not in tied and
               t.is_floating_point())  # fmt: skip
    modules = dict(model.named_modules())
    targets = select_targets(linear_names(model), LoraConfig(rank=a.rank).targets)
    factors = 0
    for name in targets:
        lin = modules[name]
        assert isinstance(lin, nn.Linear)
        factors += a.rank * (lin.in_features + lin.out_features)
    norms = sum(m.weight.numel() for m in model.modules() if isinstance(m, RMSNorm))
    adapter = factors + norms
    print(f"{a.family} {a.size}, rank {a.rank}, {len(targets)} adapted linears, {a.dtype}:")
    print(f"  full set    {full * item / 1e9:9.3f} GB  ({full:,} elements)")
    print(f"  adapter set {adapter * item / 1e6:9.3f} MB  ({factors:,} factor + {norms:,} norm"
          f" elements), {full / adapter:,.0f}x fewer bytes")  # fmt: skip


if __name__ == "__main__":
    main()
