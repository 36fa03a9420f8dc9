"""Checkpoints of the whole learner (trainer + pipeline state) and resuming after a kill -9.

    trainer.save(RUN_DIR, pipeline_state, keep) -> RUN_DIR/checkpoints/step_<8 digits>/
    trainer.latest(RUN_DIR)                      -> the newest complete checkpoint

pipeline_state: step, version, run_id, the dispatcher's work counter, the ledger snapshot,
the buffered (accepted, untrained) rollout ids and the recorder cursor (stream next seq,
step-log bytes).

Resume (``restore``): the trainer loads its state; the ledger is restored with accepted
samples kept; the step log is cut back to the checkpoint. Then the stream is read: a rollout
listed as buffered is put back in the intake buffer; a rollout recorded after the cursor
(accepted after the checkpoint, so lost from memory, and untrained since the trainer went
back) is accepted again in the restored ledger, re-creating its work item when it was
dispatched after the checkpoint (work ids and seeds are a pure function of the counter).
Every other sample of an open work item is re-dispatched; late rollouts of the old run read
"duplicate". Finally, if versions were published after the checkpoint, the restored weights are
published as a new version above all of them, so versions strictly increase and no
generator keeps serving weights the restored learner never had.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.coordinator import Coordinator
from pipeline.dispatch import counter_of, work_id_of
from pipeline.ledger import InFlightLedger
from pipeline.recorder import read_rollouts

log = logging.getLogger(__name__)
_RESTORE_GID = "\x01restore"
STATE_VERSION = 1


def pipeline_state(c: Coordinator) -> dict[str, Any]:
    return {
        "state_version": STATE_VERSION,
        "step": c.step,
        "version": c.version,
        "run_id": c.run_id,
        "counter": c.dispatcher.counter,
        "ledger": c.ledger.snapshot(),
        "buffered": c.intake.buffered_ids(),
        "recorder": c.recorder.cursor(),
    }


def save(c: Coordinator, keep: int) -> Path:
    """Checkpoint now (the trainer's layout; it stores the pipeline state with its own)."""
    path = c.trainer.save(c.run_dir, pipeline_state(c), keep)
    log.info("checkpoint %s", path)
    return path


def latest_checkpoint(c: Coordinator) -> Path | None:
    return c.trainer.latest(c.run_dir)


def _max_published(run_dir: Path) -> int:
    vs = [int(p.name[1:]) for p in (run_dir / "weights").glob("v*") if p.name[1:].isdigit()]
    path = run_dir / "weights" / "digests.jsonl"
    if path.is_file():
        import json

        for line in path.read_text().splitlines():
            try:
                vs.append(int(json.loads(line)["version"]))
            except (ValueError, KeyError):
                break
    return max(vs, default=0)


def restore(c: Coordinator, ckpt: Path) -> dict[str, int]:
    """Resume ``c`` (freshly built on the same run dir) from ``ckpt``; returns counts."""
    state = c.trainer.load(ckpt)
    if state.get("state_version") != STATE_VERSION:
        raise ValueError(f"{ckpt}: pipeline_state of version {state.get('state_version')}")
    c.step, c.run_id = int(state["step"]), str(state["run_id"])
    ledger, _ = InFlightLedger.restore(state["ledger"])
    c.ledger = ledger
    d, intake = c.dispatcher, c.intake
    d.ledger = intake.ledger = ledger
    d.counter = int(state["counter"])
    n = c.cfg.rollout.n
    for w in state["ledger"]["items"]:
        d.open[w] = d.make_spec(counter_of(w))
    c.recorder.rewind_steps(int(state["recorder"]["steps_bytes"]))
    buffered = set(state["buffered"])
    cursor = int(state["recorder"]["next_seq"])
    counts = {"from_buffer": 0, "from_stream": 0, "redispatch": 0}
    seen: set[str] = set()
    stream = c.recorder.stream_path
    if stream.is_dir() and any(stream.glob("segment-*")):
        for seq, r in read_rollouts(stream):
            if r.rollout_id in seen:
                continue
            if r.rollout_id in buffered:
                seen.add(r.rollout_id)
                intake.restore_accepted(r)
                counts["from_buffer"] += 1
            elif seq >= cursor:
                w, i = r.work_id, r.sample_index
                if w not in d.open:
                    if ledger.is_done(w):  # settled before the checkpoint
                        continue
                    d.open[w] = d.make_spec(counter_of(w))
                    d.counter = max(d.counter, counter_of(w) + 1)
                states = ledger.state(w) if ledger.is_open(w) else None
                if states is not None and states[i] != "unassigned":
                    continue
                ledger.dispatch(w, _RESTORE_GID, n, indices=[i])
                assert ledger.receive(r, sender=_RESTORE_GID) == "accepted"
                seen.add(r.rollout_id)
                intake.restore_accepted(r)
                counts["from_stream"] += 1
    missing = buffered - seen
    if missing:
        raise ValueError(f"{ckpt}: {len(missing)} buffered rollouts not in the stream")
    for cnt in range(int(state["counter"]), d.counter):  # dispatched after the checkpoint
        w = work_id_of(cnt)
        d.open.setdefault(w, d.make_spec(cnt))
    for w in d.open:
        if not ledger.is_open(w):
            ledger.dispatch(w, _RESTORE_GID, n)
            ledger.generator_died(_RESTORE_GID)
    redo = ledger.unassigned()
    ledger.counts["released"] = 0
    d.queue_redispatch(redo)
    counts["redispatch"] = sum(len(r.indices) for r in redo)
    c.version = int(state["version"])
    newest = _max_published(c.run_dir)
    if newest > c.version:  # versions published after the checkpoint are void: supersede them
        c.version = newest
        c.publish()  # the restored weights, as a version newer than anything published before
    log.info("resumed from %s at step %d, version %d: %s", ckpt, c.step, c.version, counts)
    return counts
