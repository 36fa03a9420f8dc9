"""Wire throughput: encode -> ZMQ PUSH/PULL over tcp loopback -> decode, two processes.

    python benchmarks/wire.py [--rollouts 50000] [--batch 32] [--level 1]

Rollouts are realistic: 256 prompt + 1,024 response tokens, ids Zipf-distributed over a
65,536 vocabulary (through a fixed random permutation, so frequent ids are not all small),
fp32 log-probs of sampled tokens, exit depths 1..32 in runs, a 64-bit latent seed and
metadata. The sender encodes (msgpack + narrowing + byte shuffle + zstd) and pushes; the
receiver decodes and validates every rollout. Timing runs at the receiver from a start
marker to the last frame.

Prints one JSON line:
  rollouts_per_s, payload_mb_s (payload = plain msgpack of int32 ids, fp32 log-probs and
  uint8 depths), wire_mb_s, compression_ratio = payload bytes / wire bytes, raw_payload_mb_s
  (the same payload bytes sent raw over ZMQ in the same frame sizes) and
  ratio_vs_raw = payload_mb_s / raw_payload_mb_s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 65_536
PROMPT, RESPONSE = 256, 1024


def make_rollouts(n: int, seed: int = 0) -> list:
    from proto.records import Rollout

    rng = np.random.default_rng(seed)
    perm = rng.permutation(VOCAB).astype(np.int32)
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    p = 1.0 / ranks**1.1
    p /= p.sum()
    out = []
    for i in range(n):
        ids = perm[rng.choice(VOCAB, size=PROMPT + RESPONSE, p=p)]
        # Sampled-token log-probs: mostly confident, with a tail.
        lp = np.log(rng.beta(4.0, 0.6, RESPONSE)).astype(np.float32)
        lp = np.minimum(lp, 0.0).astype(np.float32)
        runs = rng.geometric(1 / 8, RESPONSE)
        depths = np.repeat(rng.integers(1, 33, RESPONSE), runs)[:RESPONSE].astype(np.uint8)
        depths[0] = 32
        out.append(
            Rollout(
                rollout_id=f"w{i}/0",
                work_id=f"w{i}",
                prompt_id=f"p{i % 997}",
                sample_index=i % 8,
                generator_id="gen-0",
                latent_seed=int(rng.integers(0, 2**63)) * 2 + 1,
                prompt_tokens=ids[:PROMPT].copy(),
                tokens=ids[PROMPT:].copy(),
                logprobs=lp,
                exit_depths=depths,
                weight_version=i // 1000,
                finish_reason="length",
                reward=float(rng.random()),
                metrics={"gen_time_s": 1.25, "queue_time_s": 0.01},
                created_at=1.7e9 + i,
            )
        )
    return out


def payload_bytes(r) -> bytes:  # type: ignore[no-untyped-def]
    """The reference payload: plain msgpack of int32 ids, fp32 log-probs, uint8 depths."""
    ids = np.concatenate([r.prompt_tokens, r.tokens]).astype(np.int32)
    return msgpack.packb([ids.tobytes(), r.logprobs.tobytes(), r.exit_depths.tobytes()])


def _sender(addr: str, mode: str, n: int, batch: int, level: int, ready: mp.Event) -> None:  # type: ignore[type-arg]
    import zmq

    from proto.codec import Codec
    from proto.records import RolloutBatch

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})  # sender on core 0, receiver on core 1
    rs = make_rollouts(min(n, 512), seed=1)
    codec = Codec(level=level)
    raw_frames = []
    if mode == "raw":
        for i in range(0, len(rs), batch):
            raw_frames.append(b"".join(payload_bytes(r) for r in rs[i : i + batch]))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.connect(addr)
    ready.wait()
    sock.send(b"start")
    sent = 0
    k = 0
    while sent < n:
        if mode == "raw":
            sock.send(raw_frames[k % len(raw_frames)], copy=False)
        else:
            start = (k * batch) % len(rs)
            chunk = rs[start : start + batch]
            sock.send(codec.encode(RolloutBatch(chunk)), copy=False)
        sent += batch
        k += 1
    sock.send(b"end")
    sock.close(linger=-1)
    ctx.term()


def _run(mode: str, n: int, batch: int, level: int) -> dict:
    import zmq

    from proto.codec import Codec

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 64)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(f"tcp://127.0.0.1:{port}", mode, n, batch, level, ready)
    )
    proc.start()
    ready.set()
    codec = Codec(level=level)
    assert sock.recv() == b"start"
    t0 = time.perf_counter()
    wire = rollouts = tokens = 0
    while True:
        frame = sock.recv(copy=False)
        buf = frame.buffer
        if len(buf) == 3 and bytes(buf) == b"end":
            break
        wire += len(buf)
        if mode == "raw":
            rollouts += batch
        else:
            rb = codec.decode(buf)
            rollouts += len(rb.rollouts)
            tokens += sum(r.num_tokens for r in rb.rollouts)
    dt = time.perf_counter() - t0
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    sock.close(linger=0)
    ctx.term()
    return {"seconds": dt, "wire": wire, "rollouts": rollouts, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=50_000, help="rollouts to send")
    ap.add_argument("--batch", type=int, default=32, help="rollouts per frame")
    ap.add_argument("--level", type=int, default=1, help="zstd level (0 = off)")
    args = ap.parse_args()

    sample = make_rollouts(min(args.rollouts, 512), seed=1)
    per_rollout_payload = float(np.mean([len(payload_bytes(r)) for r in sample]))
    ours = _run("ours", args.rollouts, args.batch, args.level)
    raw = _run("raw", args.rollouts, args.batch, args.level)
    payload = per_rollout_payload * ours["rollouts"]
    payload_mb_s = payload / ours["seconds"] / 1e6
    raw_mb_s = per_rollout_payload * raw["rollouts"] / raw["seconds"] / 1e6
    print(
        json.dumps(
            {
                "benchmark": "wire",
                "rollouts": ours["rollouts"],
                "batch": args.batch,
                "zstd_level": args.level,
                "payload_bytes_per_rollout": round(per_rollout_payload),
                "rollouts_per_s": round(ours["rollouts"] / ours["seconds"], 1),
                "payload_mb_s": round(payload_mb_s, 1),
                "wire_mb_s": round(ours["wire"] / ours["seconds"] / 1e6, 1),
                "compression_ratio": round(payload / ours["wire"], 3),
                "raw_payload_mb_s": round(raw_mb_s, 1),
                "ratio_vs_raw": round(payload_mb_s / raw_mb_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
