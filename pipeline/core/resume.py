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

Nothing accepted is lost: staleness after a resume is measured on the restored line of
weights (pipeline.core.staleness.VersionLineage), so the rollouts restored from the stream are
trained when they are within ``max_staleness`` of the weights the learner really has, and
dispatched again (not dropped) when they are not. Every rollout read back passes the door
(pipeline.core.validation) first: one that an older learner accepted although it breaks a rule is
quarantined (RUN_DIR/quarantine, source "resume") and its sample dispatched again, so a bad
recorded rollout can never crash-loop a resume. A sample dispatched again is recorded again
under the same rollout id; RUN_DIR/voided.jsonl names the voided copies (id, seq, reason), and
replay takes the last copy of an id, the only one a surviving step can name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pipeline.core import faults
from pipeline.core.coordinator import Coordinator
from pipeline.core.dispatch import counter_of, work_id_of
from pipeline.core.ledger import InFlightLedger
from pipeline.core.recorder import read_rollouts
from pipeline.core.staleness import VersionLineage
from pipeline.core.validation import Refusal, check_rollout, sanitize_reward
from proto.records import Rollout
from weights.publication import Publication, weights_dir

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
        "lineage": c.gate.lineage.to_list(),
        "version_step": c.version_step,
    }


def save(c: Coordinator, keep: int) -> Path:
    """Checkpoint now (the trainer's layout; it stores the pipeline state with its own), after
    announcing every version still being written (the state names the announced version)."""
    c.announcer.announce_ready(wait=True)
    name = f"step_{c.step:08d}"  # the crash tests' kill -9 mid-checkpoint (learner.checkpoint)
    root = c.run_dir / "checkpoints"
    faults.kill_while_writing("checkpoint", c.step, root / f".tmp-{name}", root / name)
    path = c.trainer.save(c.run_dir, pipeline_state(c), keep)
    log.info("checkpoint %s", path)
    return path


def latest_checkpoint(c: Coordinator) -> Path | None:
    return c.trainer.latest(c.run_dir)


def rewind_metrics(path: Path, step: int) -> int:
    """Resume: metrics.jsonl keeps one row per step up to the checkpoint's ``step`` (the last
    copy of a step's row: an eval result re-logs it); rows of steps the killed learner took
    after the checkpoint go, since those steps are taken again. Rewritten in place, so a
    writer that has the file open for appending keeps appending to it. Returns rows dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: dict[int, str] = {}
    for line in lines:
        try:
            s = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the kill
        if s <= step:
            rows[s] = line
    kept = [rows[s] for s in sorted(rows)]
    with open(path, "r+", encoding="utf-8") as f:
        f.truncate(0)
        f.write("".join(x + "\n" for x in kept))
    return len(lines) - len(kept)


def _announce_again(c: Coordinator) -> bool:
    """A resume at the newest announced version v (the checkpoint's): offer v again from
    RUN_DIR/weights/vN, so that a generator started after the learner stopped (serving
    nothing) loads it; one that serves v already is not sent it. False when the directory is
    gone or its digest is not the recorded one."""
    v = c.version
    recorded = _recorded_digests(c.run_dir).get(v)
    try:
        pub = Publication.from_dir(weights_dir(c.run_dir, v), v)
    except (OSError, ValueError) as e:
        log.warning("resume: weights v%d cannot be offered again (%s): publishing v%d", v, e, v + 1)
        return False
    if recorded is None or pub.digest_as(recorded.get("digest_kind", ""),
                                         int(recorded.get("digest_chunk_bytes", 0))) != recorded["digest"]:  # fmt: skip
        log.warning("resume: weights/v%d is not the announced set: publishing v%d", v, v + 1)
        return False
    c.announcer.announce_again(pub)
    return True


def _recorded_digests(run_dir: Path) -> dict[int, dict[str, Any]]:
    """version -> its last record in weights/digests.jsonl."""
    path = run_dir / "weights" / "digests.jsonl"
    out: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                d = json.loads(line)
                out[int(d["version"])] = d
    return out


def _max_published(run_dir: Path) -> int:
    """The newest version in weights/digests.jsonl (written before a version is announced). A
    weights/vN directory beyond it was written by a learner killed before announcing it: no
    generator heard of it, so it is removed and its number published again."""
    vs: list[int] = []
    path = run_dir / "weights" / "digests.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                vs.append(int(json.loads(line)["version"]))
            except (ValueError, KeyError):
                break
    newest = max(vs, default=0)
    for p in (run_dir / "weights").glob("v*"):
        if p.name[1:].isdigit() and int(p.name[1:]) > newest and p.is_dir():
            log.info("resume: removing %s (written, never announced)", p)
            shutil.rmtree(p, ignore_errors=True)
    return newest


def _refusal(c: Coordinator, r: Rollout, newest: int) -> Refusal | None:
    """The door's rules for a rollout read back from the stream (its sender is unknown)."""
    spec = c.dispatcher.spec(r.work_id)
    if spec is None:
        return Refusal("prompt_mismatch", f"{r.work_id} is not a work id of this run")
    exp = dataclasses.replace(c.intake.expected(spec, r.sample_index, None), min_version=0,
                              max_version=max(newest, c.version))  # fmt: skip
    return check_rollout(r, expect=exp, limits=c.limits, rules=c.intake.rules)


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
    # Versions: published after the checkpoint means void; the restored weights will be
    # published as newest + 1, and staleness is measured on the restored line of weights.
    c.announcer.version = int(state["version"])
    c.gate.lineage = VersionLineage(state.get("lineage"))
    newest = max(_max_published(c.run_dir), c.version)
    if newest > c.version:
        c.gate.lineage.add_resume(c.version, newest + 1, newest)
    c.deliveries.earlier_lives(newest)  # generators may still serve any of them: honest claims
    c.version_step = int(state.get("version_step", c.step))  # trainer updates at c.version
    target = newest + 1 if newest > c.version else c.version  # the version it trains at
    buffered = set(state["buffered"])
    cursor = int(state["recorder"]["next_seq"])
    counts = {"from_buffer": 0, "from_stream": 0, "redispatch": 0, "quarantined": 0,
              "redispatch_stale": 0}  # fmt: skip
    seen: set[str] = set()
    voided: list[dict[str, Any]] = []

    def refused(seq: int, r: Rollout) -> bool:
        r2, _ = sanitize_reward(r)
        why = _refusal(c, r2, newest)
        if why is None:
            return False
        c.quarantine.put(r, generator=r.generator_id, reason=why.reason, detail=why.detail,
                         source="resume")  # fmt: skip
        counts["quarantined"] += 1
        voided.append({"rollout_id": r.rollout_id, "seq": seq, "reason": why.reason})
        log.debug("resume: rollout %s from the stream refused (%s)", r.rollout_id, why)
        return True

    stream = c.recorder.stream_path
    if stream.is_dir() and any(stream.glob("segment-*")):
        for seq, r in read_rollouts(stream):
            if r.rollout_id in seen:
                continue
            if r.rollout_id in buffered:
                seen.add(r.rollout_id)
                if refused(seq, r):  # accepted by an older learner without the door
                    ledger.reopen(r.work_id, [r.sample_index])
                    continue
                intake.restore_accepted(sanitize_reward(r)[0])
                counts["from_buffer"] += 1
            elif seq >= cursor:
                w, i = r.work_id, r.sample_index
                if w not in d.open:
                    if ledger.is_done(w):  # settled before the checkpoint
                        continue
                    d.open[w] = d.make_spec(counter_of(w))
                    d.counter = max(d.counter, counter_of(w) + 1)
                states = ledger.state(w) if ledger.is_open(w) else None
                if states is not None and (i >= len(states) or states[i] != "unassigned"):
                    continue
                if refused(seq, r):
                    continue
                if c.gate.policy == "drop" and not c.gate.is_fresh(target, r):
                    counts["redispatch_stale"] += 1  # generated again instead of dropped
                    voided.append({"rollout_id": r.rollout_id, "seq": seq, "reason": "stale"})
                    continue
                ledger.dispatch(w, _RESTORE_GID, n, indices=[i])
                assert ledger.receive(r, sender=_RESTORE_GID) == "accepted"
                seen.add(r.rollout_id)
                intake.restore_accepted(sanitize_reward(r)[0])
                counts["from_stream"] += 1
    if voided:  # these samples are generated again: the stream will hold a later copy
        c.void(voided)
    if counts["quarantined"]:
        log.warning("resume: %d rollouts of the stream break the door's rules: quarantined "
                    "(RUN_DIR/quarantine.jsonl), their samples are dispatched again",
                    counts["quarantined"])  # fmt: skip
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
    if newest > c.version:  # versions published after the checkpoint are void: supersede them
        c.announcer.version = newest
        c.publish()  # the restored weights, as a version newer than anything published before
    elif c.version > 0 and not _announce_again(c):  # its directory is gone or differs
        c.gate.lineage.add_resume(c.version, c.version + 1, c.version)
        c.publish()  # the restored weights as the next version
    log.info("resumed from %s at step %d, version %d: %s", ckpt, c.step, c.version, counts)
    return counts
