"""The run's record: accepted rollouts in a stream, and the step log that replay follows.

    RUN_DIR/stream/        proto.stream: one RolloutBatch frame per intake of accepted
                           rollouts, appended and flushed BEFORE they are acknowledged
    RUN_DIR/steps.jsonl    one JSON line per training step, written after the step:
                           {"step", "version", "rollout_ids" (the batch, in training
                           order), "corrections" (needs_correction flags), "publish"
                           (version published after the step, or null)}

``looprl replay`` reads every rollout of the stream by id and feeds the trainer exactly the
batches of steps.jsonl, in order, so it reaches the live run's weights bit for bit (same
machine, same settings). A checkpoint stores the stream's next seq and the step log's byte
length; a resume cuts the step log back to that length (steps after the checkpoint are
trained again) and re-reads stream frames from the checkpoint's cursor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.codec import Codec
from proto.records import Rollout, RolloutBatch
from proto.stream.reader import StreamReader
from proto.stream.writer import FsyncMode, StreamWriter

STEPS_NAME = "steps.jsonl"
STREAM_NAME = "stream"


@dataclass(frozen=True)
class StepRecord:
    """One line of the step log."""

    step: int
    version: int
    rollout_ids: list[str]
    corrections: list[bool]
    publish: int | None


class Recorder:
    """Single writer of RUN_DIR/stream and RUN_DIR/steps.jsonl (``enabled=False``: no-op)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True, fsync: FsyncMode = "batch") -> None:
        self.enabled = enabled
        self.codec = Codec(level=1)
        self.stream_path = run_dir / STREAM_NAME
        self.steps_path = run_dir / STEPS_NAME
        self._w: StreamWriter | None = None
        self._steps: Any = None
        if enabled:
            self._w = StreamWriter(self.stream_path, fsync=fsync)
            self._steps = open(self.steps_path, "a", encoding="utf-8")  # noqa: SIM115

    def record(self, rollouts: list[Rollout]) -> int | None:
        """Append accepted rollouts and make them durable; returns the frame's seq."""
        if self._w is None or not rollouts:
            return None
        seq = self._w.append(self.codec.encode(RolloutBatch(list(rollouts))))
        self._w.flush()
        return seq

    def log_step(self, rec: StepRecord) -> None:
        if self._steps is None:
            return
        self._steps.write(json.dumps(rec.__dict__) + "\n")
        self._steps.flush()
        os.fsync(self._steps.fileno())

    def cursor(self) -> dict[str, int]:
        """Where the record stands (saved in the checkpoint's pipeline_state)."""
        if self._w is None:
            return {"next_seq": 0, "steps_bytes": 0}
        self._steps.flush()
        return {"next_seq": self._w.next_seq, "steps_bytes": self.steps_path.stat().st_size}

    def rewind_steps(self, steps_bytes: int) -> None:
        """Resume: drop step-log lines written after the checkpoint."""
        if self._steps is None:
            return
        self._steps.close()
        with open(self.steps_path, "r+b") as f:
            f.truncate(steps_bytes)
        self._steps = open(self.steps_path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None
        if self._steps is not None:
            self._steps.close()
            self._steps = None


def read_rollouts(stream: Path, start_seq: int = 0) -> Iterator[tuple[int, Rollout]]:
    """(seq, rollout) for every rollout recorded at or after ``start_seq``."""
    codec = Codec()
    with StreamReader(stream) as r:
        for f in r.iter(start_seq=start_seq):
            batch = codec.decode(f.payload)
            if isinstance(batch, RolloutBatch):
                for ro in batch.rollouts:
                    yield f.seq, ro


def read_steps(path: Path) -> list[StepRecord]:
    """The step log; a torn last line (a crash while writing it) is ignored."""
    out = []
    if not path.is_file():
        raise FileNotFoundError(f"step log {path} not found (was the run recorded?)")
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            break
        out.append(StepRecord(**d))
    return out
