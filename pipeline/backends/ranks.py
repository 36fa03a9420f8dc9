"""Several learner ranks (torchrun): rank 0 leads, the other ranks repeat its trainer calls.

The coordinator runs on global rank 0 only. Every trainer call of learner.trainer /
learner.publish / learner.checkpoint is a collective, so rank 0's trainer is wrapped in
``Leader``, which first broadcasts the call (op + arguments, rollouts as one encoded
RolloutBatch frame: proto.codec, never pickle) to all ranks, then runs it; the other ranks
sit in ``follow(trainer)``, which receives each call and runs it the same way, until "stop".

    torchrun --nproc-per-node 2 -m pipeline.cli learner tp=2 ...

Order of calls on every rank: the same sequence of step / publish / save / load, with the
same rollouts in the same order (the trainer sorts them itself).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.backends.results import SnapshotResult, StepResult
from proto.codec import Codec
from proto.records import Rollout, RolloutBatch


def _device() -> Any:

    return (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )


def _bcast(data: bytes | None) -> bytes:
    """Rank 0's bytes on every rank (length first, then the bytes as a uint8 tensor)."""

    dev = _device()
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data else None
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    if buf is None or buf.numel() == 0:
        return b""
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


class Leader:
    """Rank 0's trainer: broadcasts every call, then runs it (same interface as the trainer)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.codec = Codec(level=1)

    def _send(self, op: str, **args: Any) -> None:
        _bcast(json.dumps({"op": op, **args}).encode())

    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
        logp_bounds: Sequence[float] | None = None,
    ) -> StepResult:  # fmt: skip
        bounds = None if logp_bounds is None else [float(b) for b in logp_bounds]
        self._send("step", flags=list(needs_correction), bounds=bounds)  # every rank: one verdict
        _bcast(self.codec.encode(RolloutBatch(list(rollouts))))
        return self.trainer.step(rollouts, needs_correction, bounds)  # type: ignore[no-any-return]

    def audit(self, rollouts: Sequence[Rollout]) -> list[float | None]:
        """Rank 0 alone (the audit's forward is no collective: nothing is broadcast)."""
        return self.trainer.audit(rollouts)  # type: ignore[no-any-return]

    def publish(self, out_dir: Path, version: int) -> Any:
        self._send("publish", out_dir=str(out_dir), version=version)
        return self.trainer.publish(out_dir, version)

    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult | None:
        """The other ranks run their whole publish (their part is the gather); rank 0 keeps
        the hash and write for later (its ``finish()``)."""
        self._send("publish", out_dir=str(out_dir), version=version)
        return self.trainer.snapshot(out_dir, version)  # type: ignore[no-any-return]

    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path:
        self._send("save", run_dir=str(run_dir), keep=keep)
        return self.trainer.save(run_dir, pipeline_state, keep)  # type: ignore[no-any-return]

    def latest(self, run_dir: Path) -> Path | None:
        return self.trainer.latest(run_dir)  # type: ignore[no-any-return]

    def load(self, ckpt: Path) -> dict[str, Any]:
        self._send("load", ckpt=str(ckpt))
        return self.trainer.load(ckpt)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._send("stop")
        self.trainer.close()


def follow(trainer: Any) -> int:
    """Ranks > 0: run rank 0's trainer calls until it says stop; returns the steps run."""
    codec, steps = Codec(), 0
    try:
        while True:
            cmd = json.loads(_bcast(None))
            op = cmd["op"]
            if op == "step":
                batch = codec.decode(_bcast(None))
                assert isinstance(batch, RolloutBatch)
                trainer.step(batch.rollouts, cmd["flags"], cmd.get("bounds"))
                steps += 1
            elif op == "publish":
                trainer.publish(Path(cmd["out_dir"]), int(cmd["version"]))
            elif op == "save":
                trainer.save(Path(cmd["run_dir"]), {}, int(cmd["keep"]))
            elif op == "load":
                trainer.load(Path(cmd["ckpt"]))
            elif op == "stop":
                return steps
            else:
                raise ValueError(f"unknown learner op {op!r} from rank 0")
    finally:
        trainer.close()
