"""Publication off the critical path: weights.pending's queue, the
copies a snapshot holds, and the coordinator training the next step while a version is being
hashed and written, announcing versions in order with the staleness bound unchanged."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from models.checkpoint import load_checkpoint, save_checkpoint
from models.ties import detached_copy
from pipeline.backends.results import SnapshotResult
from tests.pipeline.fakes import (
    FakeGenerator,
    FakeTrainer,
    make_coordinator,
    reference_trainer_and_pair,
)
from weights.pending import PublicationQueue, Snapshot
from weights.publication import Publication


def _pub(tmp: Path, v: int) -> Publication:
    out = tmp / f"v{v}"
    save_checkpoint({"w": torch.tensor([float(v)])}, {"architectures": ["Fake"]}, out)
    return Publication.from_dir(out, v)


def test_queue_announces_in_order_and_bounds_the_work_in_flight(tmp_path: Path) -> None:
    gates = {v: threading.Event() for v in (1, 2)}

    def finish(v: int) -> Any:
        def run() -> Publication:
            gates[v].wait(5)
            return _pub(tmp_path, v)

        return run

    q = PublicationQueue(1)
    q.submit(Snapshot(1, finish(1), {"snapshot": 0.01}))
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(q.make_room()))
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "make_room returned while v1 was still being written"
    assert q.ready() == [] and len(q) == 1
    gates[1].set()
    t.join(5)
    assert not t.is_alive() and waited[0] >= 0.25
    q.submit(Snapshot(2, finish(2)))
    gates[2].set()
    done = q.ready() + q.wait_all()
    assert [p.version for p, _ in done] == [1, 2] and len(q) == 0
    s1 = done[0][1]
    assert s1["snapshot"] == 0.01 and s1["total"] >= 0.25 and s1["lag"] >= s1["total"]
    q.close()


def test_two_pending_versions_overlap_and_are_announced_in_order(tmp_path: Path) -> None:
    """max_pending 2: v2's finish runs while v1's is still going (each on its own thread);
    v2 done first is still announced after v1; a third version waits for room."""
    gates = {v: threading.Event() for v in (1, 2)}
    running: set[int] = set()

    def finish(v: int) -> Any:
        def run() -> Publication:
            running.add(v)
            gates[v].wait(5)
            return _pub(tmp_path, v)

        return run

    q = PublicationQueue(2)
    q.submit(Snapshot(1, finish(1)))
    q.submit(Snapshot(2, finish(2)))
    deadline = time.monotonic() + 5
    while running != {1, 2} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running == {1, 2}, "v2's finish did not start while v1's ran"
    gates[2].set()
    time.sleep(0.2)
    assert q.ready() == [], "v2 announced before v1"
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(q.make_room()))
    t.start()
    t.join(5)  # v2 done: one slot free
    assert waited and not t.is_alive()
    gates[1].set()
    done = q.wait_all()
    assert [p.version for p, _ in done] == [1, 2]
    q.close()


def test_queue_raises_a_failed_version_where_it_is_announced(tmp_path: Path) -> None:
    def bad() -> Publication:
        raise OSError("disk full")

    q = PublicationQueue(1)
    q.submit(Snapshot(1, bad))
    assert q.make_room() >= 0.0  # the trainer thread waits, it does not raise
    with pytest.raises(OSError, match="disk full"):
        q.ready()
    q.submit(Snapshot(2, lambda: _pub(tmp_path, 3)))  # a finish that names another version
    with pytest.raises(RuntimeError, match="v3 finished for version v2"):
        q.wait_all()
    q.close()
    with pytest.raises(ValueError, match="max_pending"):
        PublicationQueue(0)


def test_detached_copy_keeps_ties_and_survives_in_place_updates() -> None:
    w = torch.arange(6.0).reshape(2, 3)
    other = torch.ones(2)  # already a copy: not live
    state = {"a": w, "b": w, "t": w.t(), "o": other}
    out = detached_copy(state, live=[w])
    w.add_(100.0)
    assert torch.equal(out["a"], torch.arange(6.0).reshape(2, 3))
    assert out["a"] is out["b"] and out["t"] is not out["a"]
    assert torch.equal(out["t"], out["a"].t())
    assert out["o"] is other
    assert detached_copy({"o": other})["o"] is not other  # live None: everything cloned


def test_reference_trainer_snapshot_is_the_weights_at_the_snapshot(tmp_path: Path) -> None:
    """ReferenceTrainer.snapshot: a training step after it does not reach what finish()
    writes; publish() afterwards writes the new weights."""
    import dataclasses

    tr, rolls = reference_trainer_and_pair(tmp_path)
    rolls = [dataclasses.replace(r, reward=float(i)) for i, r in enumerate(rolls)]
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    finish = tr.snapshot(tmp_path / "v1", 1).finish
    tr.step(rolls, [False, False])
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    pub = finish()
    _, state = load_checkpoint(tmp_path / "v1")
    live = tr.model.state_dict()
    assert state and all(torch.equal(state[k], before[k]) for k in state if k in before)
    assert any(not torch.equal(state[k], live[k]) for k in state if k in live)
    assert tr.publish(tmp_path / "v2", 2).digest != pub.digest


class SlowPublisher(FakeTrainer):
    """A FakeTrainer whose publication takes ``finish_s`` to hash and write (off the step)."""

    def __init__(self, finish_s: float, step_s: float) -> None:
        super().__init__()
        self.finish_s, self.step_s = finish_s, step_s
        self.events: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()

    def _event(self, kind: str, n: int) -> None:
        with self.lock:
            self.events.append((kind, n, time.perf_counter()))

    def step(self, rollouts: Any, needs_correction: Any, logp_bounds: Any = None) -> Any:
        self._event("step_start", self.steps + 1)
        time.sleep(self.step_s)
        out = super().step(rollouts, needs_correction, logp_bounds)
        self._event("step_end", self.steps)
        return out

    def snapshot(self, out_dir: Path, version: int) -> Any:
        value = float(self.steps)  # the weights now

        def finish() -> Publication:
            self._event("finish_start", version)
            time.sleep(self.finish_s)
            save_checkpoint({"w": torch.tensor([value])}, {"architectures": ["Fake"]}, out_dir)
            self._event("finish_end", version)
            return Publication.from_dir(out_dir, version)

        return SnapshotResult(finish)

    def publish(self, out_dir: Path, version: int) -> Publication:
        return self.snapshot(out_dir, version).finish()


def _run(tmp: Path, over: list[str], steps: int,
         setup: Any = None) -> tuple[Any, SlowPublisher, list[dict]]:  # fmt: skip
    t = SlowPublisher(finish_s=0.4, step_s=0.1)
    # the learner process runs steps on a trainer thread (background mode)
    c, net, _ = make_coordinator(tmp, over, trainer=t, background=True)
    if setup is not None:  # e.g. a test's watch on what the coordinator sends
        setup(c)
    rows: list[dict] = []
    c.on_step = rows.append
    gens = [FakeGenerator(net, "g0"), FakeGenerator(net, "g1", seed=1)]
    deadline = time.monotonic() + 120  # by the clock: a turn's pace depends on the host
    while c.step < steps:
        assert time.monotonic() < deadline, f"only {c.step} of {steps} steps in 120 s"
        c.turn(0.002)
        for g in gens:
            g.step()
    c.drain()
    return c, t, rows


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_next_step_trains_while_a_version_is_written(tmp_path: Path, max_staleness: int) -> None:
    c, t, rows = _run(tmp_path, [f"staleness.max_staleness={max_staleness}"], 6)
    try:
        # every version written once, announced in order, each holding the step it ended
        recs = [
            json.loads(x) for x in (tmp_path / "weights" / "digests.jsonl").read_text().splitlines()
        ]
        assert [r["version"] for r in recs] == list(range(1, c.step + 1))
        assert c.version == c.step >= 6
        for v in range(1, c.step + 1):
            _, st = load_checkpoint(tmp_path / "weights" / f"v{v}")
            assert float(st["w"]) == v
        # overlap: steps ran while the version before was being hashed and written
        spans = {(k, n): ts for k, n, ts in t.events}
        overlapped = [
            v for v in range(1, c.step)
            if ("step_start", v + 1) in spans and ("finish_end", v) in spans
            and spans[("step_start", v + 1)] < spans[("finish_end", v)]
        ]  # fmt: skip
        # (max_staleness 0: step v + 1 needs rollouts of v, so it waits for v's announcement)
        assert len(overlapped) >= 3 if max_staleness else not overlapped, t.events
        # the staleness bound against the announced version is unchanged
        for b_versions, row in zip(t.versions_trained, rows):
            assert max(row["version"] - v for v in b_versions) <= max_staleness
        # the finish's time is reported (off the critical path), with its lag
        pub_rows = [r for r in rows if "time/publish" in r]
        assert pub_rows and all(r["time/publish"] >= 0.35 for r in pub_rows)
        # with the Publication's own stages (Publication.stage_s: from_dir has no write)
        assert all(0 <= r["time/publish_digest"] < r["time/publish"] for r in pub_rows)
        assert all(r["time/publish_blob"] >= 0 for r in pub_rows)
    finally:
        c.close()


def test_max_pending_0_publishes_before_the_next_step(tmp_path: Path) -> None:
    c, t, rows = _run(tmp_path, ["publish.max_pending=0"], 4)
    try:
        spans = {(k, n): ts for k, n, ts in t.events}
        for v in range(1, c.step):
            assert spans[("finish_end", v)] < spans[("step_start", v + 1)]
        assert c.version == c.step
    finally:
        c.close()
