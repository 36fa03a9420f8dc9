"""Weight delivery to a generator process on the learner's host, publish.transport shm vs
shared_fs (weights/shm.py): one JSON line.

    python benchmarks/shm_delivery.py --gib 7.1 --device cuda               # Huginn-0125's size
    python benchmarks/shm_delivery.py --gib 0.75 --device cpu --transport shared_fs

This process plays the learner: a state of `--gib` GiB of bf16 tensors (64 MiB each, the last
smaller), its Publication (blob + tree digest: `Publication.stage_s`), its directory written as
the trainer writes it (`save_checkpoint` into `--dir`, default a temporary directory under
/tmp: `learner_dir_write_s`) and, with shm, the blob written once more into /dev/shm
(`publish_shm`, where the run writes it: `learner_shm_write_s`). A second process, started
before (spawn, torch imported, CUDA initialised), plays a local generator: handed the announce
(over a pipe) and holding a tensor per announced one on the device (an engine's parameters),
it takes delivery as an engine does (``--load``): ``overlapped`` (default), the torch engine's
`load_mapped`: the shm copy mapped and copied into those tensors while its tree digest is
checked on another thread (`open_verify_s` is then the whole of it, `to_device_s` 0);
``staged``, the torch engine's path on a GPU (`load_staged`): the shm copy read into a pinned
buffer (allocated before the clock, as the engine keeps it between versions:
`staging_alloc_s`), each piece hashed as it is read, then, checked, copied from there into the
tensors (DMA; `open_verify_s` is the whole of it);
``checked_first``, `VerifiedWeights.state()` then the copy: `mapped_copy` (shm: map the file,
check the tree digest per piece), else, for shared_fs or a refused copy, read the safetensors
directory and hash it (`open_verify_s`), then the copy into the tensors (`to_device_s`,
synchronised).
`delivery_s` = from the announce sent to the weights in the device tensors; `*_cpu_s` = CPU seconds of each process's part (all
its threads). The target: the Huginn-0125 set (7.1 GB) to a generator process in under 1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def generator(conn: Any, device: str, load: str) -> None:
    """The generator side: its "parameters" allocated on ``device`` (a tensor per announced
    one, as an engine holds them, before the clock), then, handed the announce, delivery as the
    engine takes it, into those tensors: ``load`` overlapped = the torch engine's path
    (`load_mapped`: the copy while the digest is checked; shared_fs or no copy: as below),
    checked_first = `VerifiedWeights.state()` (map and check, or read and hash the
    directory), then the copy (the vLLM engine's order, and the torch engine's before)."""
    import torch

    from weights.shm import load_mapped, load_staged, mapped_copy
    from weights.verified import VerifiedWeights

    metas, total = conn.recv()
    dst = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
           for name, dtype, shape in metas}  # fmt: skip
    ta = time.time()  # staged: the engine's buffer, kept between versions (allocated once)
    pinned = (
        torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")
        if load == "staged"
        else None
    )
    alloc_s = time.time() - ta
    if device == "cuda":
        torch.cuda.synchronize()
    conn.send("ready")
    announce, root, sent = conn.recv()
    t0, c0 = time.time(), time.process_time()

    def copy(state: Any) -> None:  # what load_into's load_state_dict does per parameter
        for k, v in state.items():
            dst[k].copy_(v)
        if device == "cuda":
            torch.cuda.synchronize()

    mapped, digest, dev_s = False, "", 0.0
    if load == "overlapped" and load_mapped(announce, copy, root):
        mapped, digest = True, announce.digest  # (load_mapped raised if it did not match)
        t1 = time.time()
    elif pinned is not None and load_staged(announce, copy, lambda n: pinned.numpy(), root):
        mapped, digest = True, announce.digest  # (read and checked, then copied)
        t1 = time.time()
    else:
        mapping = mapped_copy(announce, root)  # what VerifiedWeights.state() tries first
        mapped = mapping is not None
        ready = (VerifiedWeights(announce, mapping) if mapped  # checked by mapped_copy
                 else VerifiedWeights.of_directory(announce))  # fmt: skip
        state, digest = ready.state(local_copy=False), announce.digest  # (raises on a mismatch)
        t1 = time.time()
        copy(state)
        dev_s = time.time() - t1
        del state
        ready.close()
    done = time.time()
    conn.send({"open_verify_s": t1 - t0, "to_device_s": dev_s, "delivery_s": done - sent,
               "cpu_s": time.process_time() - c0, "tensors": len(dst), "digest": digest,
               "mapped": mapped, "staging_alloc_s": alloc_s})  # fmt: skip


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
    ap.add_argument("--transport", choices=("shm", "shared_fs"), default="shm")
    ap.add_argument("--root", default=None,
                    help="the shared-memory directory (default /dev/shm when it has room for "
                    "the set, else /tmp: a page-cached file, mapped the same way)")  # fmt: skip
    ap.add_argument("--dir", default=None, help="where the version's directory goes (default /tmp)")
    ap.add_argument("--load", choices=("staged", "overlapped", "checked_first"), default="staged",
                    help="staged: the torch engine's path on a GPU (load_staged: read and "
                    "checked into a pinned buffer, then copied); overlapped: its path on the "
                    "CPU (load_mapped: copy while checking); checked_first: check, then copy "
                    "(the vLLM engine's order)")  # fmt: skip
    a = ap.parse_args()
    import torch

    from models.checkpoint import save_checkpoint
    from weights.publication import Publication
    from weights.shm import prune_shm, publish_shm

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=generator, args=(there, a.device, a.load))
    proc.start()
    total = int(a.gib * 2**30) // 2 * 2
    per = 64 << 20
    state = {f"t{i:04d}": torch.ones(min(per, total - o) // 2, dtype=torch.bfloat16)
             for i, o in enumerate(range(0, total, per))}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="shm-bench-", dir=a.dir))
    vdir = work / "weights" / "v1"
    c0 = time.process_time()
    pub = Publication.of_state(state, 1, vdir)
    t0 = time.time()
    save_checkpoint(state, {"model_type": "bench"}, vdir)
    dir_s = time.time() - t0
    del state
    root = a.root or pick_root(len(pub.blob))
    shm_s = 0.0
    if a.transport == "shm":
        t0 = time.time()
        publish_shm(pub, root)
        shm_s = time.time() - t0
    learner_cpu = time.process_time() - c0
    announce = pub.announce(0)
    announce.path = str(vdir.resolve())
    try:
        here.send(([(m.name, m.dtype, list(m.shape)) for m in announce.tensors],
                   announce.total_bytes))  # fmt: skip
        assert here.recv() == "ready"
        here.send((announce, root, time.time()))
        got = here.recv()
        proc.join(60)
    finally:
        prune_shm(vdir.parent, 1 << 62, 0, root)
        shutil.rmtree(work, ignore_errors=True)
    nbytes = len(pub.blob)
    res = {
        "bench": "shm_delivery", "transport": a.transport, "load": a.load, "device": a.device,
        "bytes": nbytes,
        "gb": round(nbytes / 1e9, 3), "root": root, "mapped": got["mapped"],
        "learner_blob_s": round(pub.stage_s["blob"], 3),
        "learner_digest_s": round(pub.stage_s["digest"], 3),
        "learner_dir_write_s": round(dir_s, 3),
        "learner_shm_write_s": round(shm_s, 3),
        "learner_cpu_s": round(learner_cpu, 3),
        "open_verify_s": round(got["open_verify_s"], 3),
        "verify_gb_s": round(nbytes / got["open_verify_s"] / 1e9, 2),
        "to_device_s": round(got["to_device_s"], 3),
        "staging_alloc_s": round(got["staging_alloc_s"], 3),
        "delivery_s": round(got["delivery_s"], 3),
        "generator_cpu_s": round(got["cpu_s"], 3),
        "digest_ok": got["digest"] == pub.digest, "tensors": got["tensors"],
        "meets_1s_target": got["delivery_s"] < 1.0, "command": " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
