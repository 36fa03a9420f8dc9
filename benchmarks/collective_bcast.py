"""The collective transport's broadcast alone: one learner rank, N generator ranks, real processes.

    python benchmarks/collective_bcast.py --backend gloo --gens 1,4,16 --sizes-mb 10,100
    python benchmarks/collective_bcast.py --backend nccl --gens 1 --sizes-mb 100,1000,7000

The group and the broadcast are the product's (weights/collective/group.py: a group on a TCPStore the
rank-0 process hosts, a uint8 tensor broadcast from rank 0); what is left out is the ZeroMQ
announce and the coordinator (benchmarks/scale.py --weights measures those too). Each
generator rank receives, then (``--digest``) computes sha256 over the received bytes on its
own CPU (the cost of the digest check, which every generator pays in parallel). Reported per
(size, N): the group set-up (``group_s``), the first broadcast on the new group (what one
product round pays: NCCL connects lazily, on the first collective), a second one on the same
group, and the time to the last generator's digest; ratios to N = 1. nccl: rank r uses GPU r,
so N <= GPUs - 1. Loads weights/collective/group.py by path (torch only: runs where the rest of the
project's dependencies are not installed). Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _coll() -> Any:
    spec = importlib.util.spec_from_file_location(
        "looprl_collective", ROOT / "weights" / "collective.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rank_main(rank: int, world: int, port: int, nbytes: int, backend: str, digest: bool,
              chunk: int, out: Any) -> None:  # fmt: skip
    import torch

    coll = _coll()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = (coll.host_store("127.0.0.1", port, 120) if rank == 0
             else coll.join_store(f"127.0.0.1:{port}", 120))  # fmt: skip
    t0 = time.time()
    group = coll.open_group(store, "bench", rank, world, backend=backend, timeout_s=120,
                            hostname="127.0.0.1")  # fmt: skip
    group_s = time.time() - t0
    if rank == 0:
        base = torch.randint(0, 256, (min(nbytes, 64 << 20),), dtype=torch.uint8)
        src = base.repeat(-(-nbytes // max(1, base.numel())))[:nbytes]  # 64 MiB of noise, tiled
        t = src.cuda() if backend == "nccl" else src
        want = hashlib.sha256(src.numpy().data).hexdigest() if digest else ""
        store.set("want", want)
    else:
        host, t = coll.buffer_tensor(nbytes, backend)
    times = {}
    for k in ("first", "second"):
        store.add(f"ready-{k}", 1)
        while int(store.add(f"ready-{k}", 0)) < world:  # start together
            time.sleep(0.0005)
        s = time.time()
        coll.deliver(group, t, rank, world, chunk_bytes=chunk, timeout_s=120)
        times[k] = (s, time.time())
    done = time.time()
    ok = True
    if rank > 0:
        if backend == "nccl":
            torch.frombuffer(host, dtype=torch.uint8).copy_(t)  # device -> host, one copy
        if digest:
            ok = hashlib.sha256(host).hexdigest() == store.get("want").decode()
        done = time.time()
    out.put({"rank": rank, "group_s": group_s, "times": times, "done": done, "ok": ok})
    store.add("finished", 1)
    if rank == 0:  # the store lives until everyone read from it
        while int(store.add("finished", 0)) < world:
            time.sleep(0.01)


def measure(n: int, mb: float, backend: str, digest: bool, port: int, chunk_mb: float = 0.0
            ) -> dict[str, Any]:  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    nbytes, chunk = int(mb * 1e6), int(chunk_mb * (1 << 20))
    ps = [ctx.Process(target=rank_main, args=(r, n + 1, port, nbytes, backend, digest, chunk, out))
          for r in range(n + 1)]  # fmt: skip
    for p in ps:
        p.start()
    res = [out.get(timeout=600) for _ in ps]
    for p in ps:  # stopped by pid
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    r0 = next(r for r in res if r["rank"] == 0)
    gens = [r for r in res if r["rank"] > 0]
    first = max(g["times"]["first"][1] for g in gens) - r0["times"]["first"][0]
    second = max(g["times"]["second"][1] for g in gens) - r0["times"]["second"][0]
    to_digest = max(g["done"] for g in gens) - r0["times"]["second"][0]
    return {"bench": "collective_bcast", "backend": backend, "generators": n, "mb": mb,
            "chunk_mb": chunk_mb,
            "group_s": round(max(r["group_s"] for r in res), 4),
            "first_bcast_s": round(first, 4), "second_bcast_s": round(second, 4),
            "to_last_digest_s": round(to_digest, 4), "digest_ok": all(g["ok"] for g in gens),
            "gb_per_s_per_generator": round(mb / 1e3 / second, 2)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--gens", default="1,4,16", help="comma-separated generator counts")
    ap.add_argument("--sizes-mb", default="10,100", help="comma-separated sizes (MB)")
    ap.add_argument("--no-digest", action="store_true", help="skip the receivers' sha256")
    ap.add_argument("--port", type=int, default=29731, help="the store's port")
    ap.add_argument("--chunk-mb", default=f"{_coll().DEFAULT_PIPE_BYTES / (1 << 20):g}",
                    help="comma-separated publish.collective_chunk_bytes values in MiB, each "
                         "measured (0: one whole broadcast, gloo's tree; > 0: pipelined)")  # fmt: skip
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    measure(1, 1.0, args.backend, False, args.port - 1)  # warm-up (page cache, first imports)
    port = args.port
    for mb in [float(x) for x in args.sizes_mb.split(",")]:
        for chunk_mb in [float(x) for x in args.chunk_mb.split(",")]:
            base = None
            for n in (int(x) for x in args.gens.split(",")):
                port += 1
                row = measure(n, mb, args.backend, not args.no_digest, port, chunk_mb)
                base = base or row
                for k in ("first_bcast_s", "second_bcast_s", "to_last_digest_s"):
                    row[k.replace("_s", "_ratio")] = round(row[k] / base[k], 2)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
