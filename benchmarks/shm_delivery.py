"""Same-host weight delivery through shared memory (models/weights/shm.py): one JSON line.

    python benchmarks/shm_delivery.py --gib 7.1 --device cuda   # the Huginn-0125 set's size
    python benchmarks/shm_delivery.py --gib 0.05 --device cpu   # a CPU smoke run

This process plays the learner: a state of `--gib` GiB of bf16 tensors (64 MiB each, the last
smaller), its Publication (blob + tree digest: `Publication.stage_s`), written once into
`--root` (default /dev/shm if it has room, else /tmp) with `write_shm`. A second process, started before (spawn, torch
imported, CUDA initialised), plays a local generator: told the file is there (the announce, over
a pipe), it maps it and checks the digest (`open_shm`: `open_verify_s`), then copies the checked
blob to the device as one uint8 tensor (`to_device_s`, synchronised; 0 on cpu). `delivery_s` =
from the announce sent to the weights on the device in the generator process. The issue's
target: the Huginn-0125 set (7.1 GB) to a generator process in under 1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def generator(conn: Any, device: str) -> None:
    """The generator side: wait for (announce, path), map + check, copy to ``device``."""
    import torch

    from models.weights.shm import open_shm

    if device == "cuda":
        torch.zeros(1, device="cuda")  # the context, before the clock
    conn.send("ready")
    announce, path, sent = conn.recv()
    t0 = time.time()
    w = open_shm(announce, path)
    t1 = time.time()
    dev_s = 0.0
    if device == "cuda":
        flat = torch.frombuffer(w.blob, dtype=torch.uint8)
        on_dev = flat.to("cuda")
        torch.cuda.synchronize()
        dev_s = time.time() - t1
        del flat, on_dev
    done = time.time()
    conn.send({"open_verify_s": t1 - t0, "to_device_s": dev_s, "delivery_s": done - sent,
               "tensors": len(w), "digest": w.digest})  # fmt: skip
    w.close()


def pick_root(nbytes: int) -> str:
    """/dev/shm when it can hold ``nbytes`` with 1 GiB to spare (a container's may be 64 MiB),
    else /tmp."""
    for root in ("/dev/shm", "/tmp"):
        try:
            if shutil.disk_usage(root).free > nbytes + (1 << 30):
                return root
        except OSError:
            continue
    raise SystemExit(f"no room for {nbytes} bytes in /dev/shm or /tmp (pass --root)")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gib", type=float, default=7.1 / 1.073741824)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--root", default=None,
                    help="the shared-memory directory (default /dev/shm when it has room for "
                    "the set, else /tmp: a page-cached file, mapped the same way)")  # fmt: skip
    a = ap.parse_args()
    import torch

    from models.weights.publication import Publication
    from models.weights.shm import remove_shm, shm_path, write_shm

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=generator, args=(there, a.device))
    proc.start()
    total = int(a.gib * 2**30) // 2 * 2
    per = 64 << 20
    state = {f"t{i:04d}": torch.ones(min(per, total - o) // 2, dtype=torch.bfloat16)
             for i, o in enumerate(range(0, total, per))}  # fmt: skip
    pub = Publication.of_state(state, 1, None)
    del state
    root = a.root or pick_root(len(pub.blob))
    path = shm_path("bench", 1, root)
    t0 = time.time()
    write_shm(pub, path)
    write_s = time.time() - t0
    announce = pub.announce(1 << 20)
    try:
        assert here.recv() == "ready"
        here.send((announce, str(path), time.time()))
        got = here.recv()
        proc.join(60)
    finally:
        remove_shm(path)
    nbytes = len(pub.blob)
    res = {
        "bench": "shm_delivery", "device": a.device, "bytes": nbytes,
        "gb": round(nbytes / 1e9, 3), "root": str(path.parent),
        "learner_blob_s": round(pub.stage_s["blob"], 3),
        "learner_digest_s": round(pub.stage_s["digest"], 3),
        "learner_write_s": round(write_s, 3),
        "open_verify_s": round(got["open_verify_s"], 3),
        "verify_gb_s": round(nbytes / got["open_verify_s"] / 1e9, 2),
        "to_device_s": round(got["to_device_s"], 3),
        "delivery_s": round(got["delivery_s"], 3),
        "digest_ok": got["digest"] == pub.digest, "tensors": got["tensors"],
        "meets_1s_target": got["delivery_s"] < 1.0, "command": " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
