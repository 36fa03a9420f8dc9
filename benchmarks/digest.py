"""The weight digest (docs/CONTRACTS.md 6, weights/digest.py) alone: GB/s of the tree digest.

    python benchmarks/digest.py --sizes-gib 1,7             # this host, every CPU
    python benchmarks/digest.py --sizes-gib 7 --workers 1,4,16

Per size: a blob of that many bytes (filled, so its pages are resident) hashed as one uint8
tensor by ``weights.digest.weights_digest`` (kind sha256-tree, 16 MiB chunks, the process's
hash pool), best of ``--repeats``; and, for the first size, the flat kind (one serial sha256,
the digest of runs recorded before the tree) over min(size, 1 GiB). ``--workers`` re-runs
the tree digest with pools of those sizes (default: the host's CPUs only). One JSON line
of results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import weights.digest as dg  # noqa: E402
from models.pool import hash_pool  # noqa: E402


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(
    dg: Any, gib: float, chunk: int, repeats: int, workers: list[int], *, flat: bool
) -> dict[str, float]:
    """The tree digest of a ``gib`` GiB blob (and the flat kind, and other pool sizes)."""
    n = int(gib * (1 << 30))
    blob = torch.empty(n, dtype=torch.uint8)
    blob.fill_(0x5A)  # resident pages: the first touch is not the digest's cost
    view = memoryview(blob.numpy()).cast("B")
    meta = [{"name": "w", "dtype": "uint8", "shape": [n], "offset": 0, "nbytes": n, "sha256": ""}]
    key, out = f"{gib:g}gib", {}
    s = _best(lambda: dg.weights_digest(view, meta, dg.TREE, chunk), repeats)
    out[f"tree_s_{key}"] = round(s, 4)
    out[f"tree_gbps_{key}"] = round(n / s / 1e9, 2)
    if flat:
        m = min(n, 1 << 30)
        f = _best(lambda: hashlib.sha256(view[:m]).digest(), 1)
        out["flat_gbps_one_core"] = round(m / f / 1e9, 3)
    segs = dg._chunk_segments([view], chunk)
    for w in workers:
        with ThreadPoolExecutor(w) as pool:
            sw = _best(lambda: list(pool.map(dg._sha, segs)), repeats)  # noqa: B023
        out[f"tree_gbps_{key}_w{w}"] = round(n / sw / 1e9, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gib", default="1,7", help="comma-separated blob sizes in GiB")
    p.add_argument("--chunk-mib", type=int, default=16, help="tree chunk size (MiB)")
    p.add_argument("--workers", default="", help="comma-separated pool sizes to compare")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    chunk = a.chunk_mib << 20
    cpus = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"bench": "digest", "host": socket.gethostname(), "cpus": cpus,
                           "load1_before": round(os.getloadavg()[0], 2), "kind": dg.TREE,
                           "chunk_mib": a.chunk_mib, "pool": hash_pool()._max_workers}  # fmt: skip
    for i, gib in enumerate(float(x) for x in a.sizes_gib.split(",")):
        workers = [int(x) for x in a.workers.split(",") if x]
        out.update(_measure(dg, gib, chunk, a.repeats, workers, flat=i == 0))
    out["load1_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
