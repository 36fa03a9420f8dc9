"""One adapter-only version end to end at a model's shapes (learner.lora.publish=adapters,
weights.adapters): the learner's AdapterLine writes the base (v0) and v1's adapter set, and a
generator's AdapterReceiver (real files, a fake connection) reads the base once, then v1 as
its adapter set, merges it onto the base on this host's CPU and checks the merged digest.

    PYTHONPATH=. python -m benchmarks.adapter_delivery --size 0125 --rank 16 --out /tmp/ad
    PYTHONPATH=. python -m benchmarks.adapter_delivery --size tiny --out /tmp/ad   # a smoke run

The weights are random (bf16; the shapes and names are the model's, built on the meta
device); what is timed is the generator's part: reading the adapter set (the delivery), the
merge and the merged digest. Prints one line per stage.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.config import LoraConfig
from learner.lora import linear_names, select_targets
from models.checkpoint import save_checkpoint
from models.layers import RMSNorm
from models.lora import lora_delta, merged_weight
from models.random_init import model_config
from models.reference import build_model
from models.ties import tied_from_module
from weights.adapters import AdapterLine, AdapterReceiver
from weights.publication import Publication
from weights.receiver import WeightReceiver


class _Conn:
    def send(self, record: Any, *, channel: Any = None) -> bool:
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0125")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="/tmp/adapter_delivery")
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    config = model_config("huginn", a.size)
    with torch.device("meta"):
        model = build_model(config, seed=0)
    tied = tied_from_module(model)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    base = {n: (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16)
            for n, t in model.state_dict().items() if n not in tied}  # fmt: skip
    modules = dict(model.named_modules())
    targets = select_targets(linear_names(model), LoraConfig(rank=a.rank).targets)
    norms = sorted(f"{n}.weight" for n, m in modules.items() if isinstance(m, RMSNorm))
    factors = {}
    for m in targets:
        lin = modules[m]
        assert isinstance(lin, nn.Linear)
        factors[m] = (torch.randn(a.rank, lin.in_features, generator=gen).to(torch.bfloat16),
                      torch.randn(lin.out_features, a.rank, generator=gen).to(torch.bfloat16))  # fmt: skip
    scale = 16.0 / a.rank
    frozen = {f"{m}.weight": base[f"{m}.weight"] for m in targets}
    print(f"random weights: {time.perf_counter() - t0:.1f} s")
    cfg = {**config.to_hf_dict(), "torch_dtype": "bfloat16"}
    line = AdapterLine(out, scale)
    pubs = []
    for v in (0, 1):
        state = dict(base)
        if v:
            for m, (fa, fb) in factors.items():
                state[f"{m}.weight"] = merged_weight(base[f"{m}.weight"], lora_delta(fa, fb, scale))
        t0 = time.perf_counter()
        d = out / "weights" / f"v{v}"
        save_checkpoint(state, cfg, d)
        pub = line.publication(Publication.from_dir(d, v), factors, frozen, norms)
        pubs.append(pub)
        print(
            f"learner v{v}: merged set written, hashed, adapter line {time.perf_counter() - t0:.1f} s"
        )
    v1 = pubs[1]
    print(
        f"v1: merged set {len(v1.blob) / 1e9:.3f} GB, adapter set {v1.adapter['bytes'] / 1e6:.2f} MB"
    )
    conn = _Conn()
    rx = AdapterReceiver(conn, WeightReceiver(conn), "g0")
    rx.base = {}  # read below, timed on its own
    t0 = time.perf_counter()
    rx.base = rx._read(str(v1.adapter["base_path"]), 1, v1.adapter, str(v1.adapter["base_digest"]))
    rx.base_digest = str(v1.adapter["base_digest"])
    print(f"generator: the base read and checked once: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    adapter = rx._read(str(v1.adapter["path"]), 1, v1.adapter, str(v1.adapter["digest"]))
    print(f"generator: v1's adapter set read and checked (the delivery): "
          f"{time.perf_counter() - t0:.3f} s")  # fmt: skip
    del adapter
    t0 = time.perf_counter()
    w = rx.handle(v1.announce(0))
    assert w is not None and w.digest == v1.digest, rx.counts
    print(f"generator: v1 whole (adapter read, merge onto the base, merged digest): "
          f"{time.perf_counter() - t0:.2f} s; counts {dict(rx.counts)}")  # fmt: skip


if __name__ == "__main__":
    main()
