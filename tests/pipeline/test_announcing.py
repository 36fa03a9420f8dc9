"""pipeline.core.announcing.WeightAnnouncer on fakes: versions are announced strictly in
version order even when a later one is written first, each after its line in
RUN_DIR/weights/digests.jsonl (write-ahead); a version written whole is announced when its
step is handed over; non-finite weights are neither written nor announced."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from models.checkpoint import save_checkpoint
from models.errors import NonFiniteWeightsError
from pipeline.backends.results import SnapshotResult
from pipeline.config.run import load_config
from pipeline.core.announcing import WeightAnnouncer, Written
from pipeline.core.coordinator_errors import NonFinitePublication
from pipeline.core.timeline import StepTimeline
from weights.pending import PublicationQueue, Snapshot
from weights.publication import Publication


class GatedTrainer:
    """Its weights are the version number; version v's hash and write wait for ``release(v)``
    (released at once unless ``hold``-ed)."""

    def __init__(self, hold: tuple[int, ...] = ()) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.written: dict[int, threading.Event] = {}
        self.hold = hold

    def release(self, v: int) -> None:
        self.gates.setdefault(v, threading.Event()).set()

    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult:
        gate = self.gates.setdefault(version, threading.Event())
        written = self.written.setdefault(version, threading.Event())
        if version not in self.hold:
            gate.set()

        def finish() -> Publication:
            assert gate.wait(30), f"v{version} never released"
            save_checkpoint({"w": torch.tensor([float(version)])}, {"architectures": ["F"]},
                            out_dir)  # fmt: skip
            written.set()
            return Publication.from_dir(out_dir, version)

        return SnapshotResult(finish, {"gather": 0.0})

    def publish(self, out_dir: Path, version: int) -> Publication:
        return self.snapshot(out_dir, version).finish()


class RecordingPublisher:
    """Records each announcement with the versions digests.jsonl held at that moment."""

    def __init__(self, run_dir: Path) -> None:
        self.digests = run_dir / "weights" / "digests.jsonl"
        self.announced: list[tuple[int, list[int]]] = []

    def prepare(self, pub: Publication) -> Publication:
        return pub

    def publish(self, pub: Publication) -> None:
        lines = self.digests.read_text().splitlines() if self.digests.is_file() else []
        self.announced.append((pub.version, [json.loads(x)["version"] for x in lines]))


def _announcer(run_dir: Path, trainer: Any, max_pending: int) -> tuple[WeightAnnouncer, Any, list]:
    status: list[int] = []
    pub = RecordingPublisher(run_dir)
    a = WeightAnnouncer(
        load_config(None, ["publish.keep=0"]).publish, run_dir, trainer=trainer, publisher=pub,
        pending=PublicationQueue(max_pending) if max_pending else None,
        timeline=StepTimeline(), set_status=status.append,
    )  # fmt: skip
    return a, pub, status


def test_versions_are_announced_in_order_each_after_its_digests_line(tmp_path: Path) -> None:
    """v1's write is held while v2 and v3 finish: nothing is announced until v1 is written,
    then v1, v2, v3 in that order, each once, each with its line in digests.jsonl first."""
    t = GatedTrainer(hold=(1,))
    a, pub, status = _announcer(tmp_path, t, max_pending=3)
    for v in (1, 2, 3):
        made = a.prepare(v, step=v)
        assert isinstance(made, Snapshot) and made.stages["gather"] == 0.0
        stages, announce_s = a.hand_over(made)
        assert stages is not None and "snapshot" in stages and announce_s is None
    assert a.writing == 3
    assert t.written[2].wait(30) and t.written[3].wait(30)
    threading.Event().wait(0.2)  # their finish has returned: ready to announce, but v1 is not
    assert a.announce_ready() == 0 and a.version == 0 and not pub.announced
    t.release(1)
    assert a.announce_ready(wait=True) == 3
    assert [v for v, _ in pub.announced] == [1, 2, 3] == status
    assert all(v in written for v, written in pub.announced)  # write-ahead
    assert a.version == 3 and a.writing == 0 and a.last_digest
    a.close()


def test_a_version_written_whole_is_announced_when_its_step_is_handed_over(
    tmp_path: Path,
) -> None:
    a, pub, status = _announcer(tmp_path, GatedTrainer(), max_pending=0)
    made = a.prepare(1, step=1)
    assert isinstance(made, Written) and made.stages["total"] >= 0
    assert not pub.announced and a.version == 0  # written on the trainer thread, not announced
    stages, announce_s = a.hand_over(made)
    assert pub.announced == [(1, [1])] and status == [1] and a.version == 1
    assert stages is not None and "total" in stages and announce_s is not None
    assert a.hand_over(None) == (None, None)  # a step that published nothing
    a.publish(step=1)  # resume and tests: the next version, now
    assert [v for v, _ in pub.announced] == [1, 2] and a.version == 2


class NanTrainer(GatedTrainer):
    def publish(self, out_dir: Path, version: int) -> Publication:
        out_dir.mkdir(parents=True)  # something was begun
        raise NonFiniteWeightsError("w", 1, 2, f"weights v{version}")


def test_non_finite_weights_are_neither_written_nor_announced(tmp_path: Path) -> None:
    a, pub, status = _announcer(tmp_path, NanTrainer(), max_pending=0)
    with pytest.raises(NonFinitePublication, match="step 4: .* v1 was not published"):
        a.prepare(1, step=4)
    assert not (tmp_path / "weights" / "v1").exists()
    assert not (tmp_path / "weights" / "digests.jsonl").exists()
    assert not pub.announced and not status and a.version == 0
