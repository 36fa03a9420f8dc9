"""Refused rollouts, kept where a person can look at them, never where training reads.

    RUN_DIR/quarantine/        a rollout stream (proto.stream, `looprl stream inspect` reads
                               it) holding each refused rollout as it arrived
    RUN_DIR/quarantine.jsonl   one JSON line per refused rollout: {"time", "generator",
                               "rollout_id", "work_id", "sample_index", "reason", "detail",
                               "seq" (its frame in quarantine/), "source" ("live" or "resume")}

Written by the coordinator's intake (live rollouts) and by resume (invalid rollouts found in
the training stream of an older run); always on, also when ``record.enabled`` is false. The
training stream (RUN_DIR/stream) and the step log never name a quarantined rollout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from proto.codec import Codec
from proto.records import Rollout, RolloutBatch
from proto.stream.writer import StreamWriter

QUARANTINE_DIR = "quarantine"
QUARANTINE_LOG = "quarantine.jsonl"


class Quarantine:
    """Append-only store of refused rollouts (see the module docstring); opened lazily."""

    def __init__(self, run_dir: Path) -> None:
        self.stream_path = run_dir / QUARANTINE_DIR
        self.log_path = run_dir / QUARANTINE_LOG
        self._codec = Codec(level=1)
        self._w: StreamWriter | None = None
        self.count = 0

    def put(self, r: Rollout, *, generator: str, reason: str, detail: str,
            source: str = "live") -> None:  # fmt: skip
        if self._w is None:
            self._w = StreamWriter(self.stream_path, fsync="batch")
        seq = self._w.append(self._codec.encode(RolloutBatch([r])))
        self._w.flush()
        line = {"time": time.time(), "generator": generator, "rollout_id": r.rollout_id,
                "work_id": r.work_id, "sample_index": int(r.sample_index), "reason": reason,
                "detail": detail, "seq": seq, "source": source}  # fmt: skip
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.count += 1

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


def read_quarantine(run_dir: Path) -> list[dict[str, object]]:
    """The quarantine log's lines (empty if nothing was refused)."""
    p = run_dir / QUARANTINE_LOG
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line]
