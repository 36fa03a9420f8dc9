"""Weight versions written and announced: a step's publication written (or taken and then hashed
and written beside the next step, weights.pending) and announced in version order:
digests.jsonl first (write-ahead), then the publisher's transfers to the generators;
non-finite weights end the run unpublished (docs/PIPELINE.md, "Weight publication";
docs/ARCHITECTURE.md, "The walk of a weight set")."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import NonFiniteWeightsError
from pipeline.backends.trainer_api import Trainer
from pipeline.config.outputs import PublishSection
from pipeline.core import faults
from pipeline.core.coordinator_errors import CoordinatorError, NonFinitePublication
from pipeline.core.timeline import StepTimeline
from weights.pending import PublicationQueue, Snapshot
from weights.publication import Publication, prune_weights, weights_dir
from weights.publisher import WeightPublisher

log = logging.getLogger("pipeline.core.coordinator")  # the coordinator's lines, one logger name


def _log_failure(what: str) -> Callable[[Future[Any]], None]:
    """A done callback that logs ``what`` failed with the future's exception, if it did."""

    def done(f: Future[Any]) -> None:
        if f.exception() is not None:
            log.warning("%s failed: %s", what, f.exception())

    return done


@dataclass
class Written:
    """A version written whole on the trainer thread (publish.max_pending 0, or a trainer
    without a two-part publication): announced when its step completes."""

    publication: Publication
    stages: dict[str, float]
    """Its seconds: the trainer's and the Publication's stages (``stage_s``), ``total``."""


class WeightAnnouncer:
    """The weight versions of a run, from the trainer's weights to the generators.

    Loop: on the trainer thread, after a step that publishes, ``prepare(v)`` writes version v
    whole (``Written``) or takes the weights for ``pending`` to hash and write beside the next
    steps (``Snapshot``); on the coordinator's thread, when that step completes, ``hand_over``
    announces a written version at once or queues a taken one, and ``announce_ready`` (every
    turn) announces the queued versions whose write is done, oldest first.

    Invariants: versions are announced in strictly increasing order, each once (``again``, a
    resume's offer of the newest, records nothing new); a version is in
    RUN_DIR/weights/digests.jsonl before any generator can hear of it, so a resume never reuses
    the number of weights that were announced (pipeline.core.resume); non-finite weights are
    never written nor announced (NonFinitePublication ends the run)."""

    def __init__(
        self,
        cfg: PublishSection,
        run_dir: Path,
        *,
        trainer: Trainer,
        publisher: WeightPublisher,
        pending: PublicationQueue | None,
        timeline: StepTimeline,
        set_status: Callable[[int], None],
    ) -> None:
        """``publisher``: the transport's publisher (weights.transports: announce, chunks,
        collective rounds); ``pending``: the versions being hashed and written beside the next steps
        (None: each written before the next step starts); ``set_status``: tells the endpoint
        the newest announced version (its heartbeats carry it)."""
        self.cfg, self.run_dir, self.trainer, self.publisher = cfg, run_dir, trainer, publisher
        self.pending, self.timeline, self.set_status = pending, timeline, set_status
        self.version = 0
        """The newest version announced to the generators (a resume sets it: core.resume)."""
        self.last_digest = ""
        self.announced_bytes = 0
        """The newest announced version's blob size (bytes)."""
        self._announced_stages: dict[str, float] = {}  # since the last metrics row
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="prune-weights")

    @property
    def writing(self) -> int:
        """Versions taken from the trainer and still being hashed and written."""
        return len(self.pending) if self.pending is not None else 0

    # -- the trainer thread ------------------------------------------------------------------------
    def prepare(self, v: int, step: int) -> Snapshot | Written:
        """Version ``v`` from the trainer's weights after ``step``: taken now (the trainer's
        snapshot, after waiting for room among the ``pending``), or written whole when nothing
        is pending (publish.max_pending 0, synchronous mode) or the trainer has no two-part
        publication."""
        if self.pending is None:
            return self.write(v, step)
        room = self.pending.make_room()
        t1 = time.perf_counter()
        taken = self._guarded(v, step, lambda out: self.trainer.snapshot(out, v))
        if taken is None:
            return self.write(v, step)
        publisher, finish = self.publisher, taken.finish
        stages = {**taken.stage_s, "snapshot": time.perf_counter() - t1, "room_wait": room}
        device, first = taken.device, getattr(publisher, "device_first", False)
        if first and device is not None:  # cuda_ipc, directories when_free: announced from the GPU
            # packed and digested now (milliseconds on the card), so the snapshot's copy is let
            # go before the next step allocates; the queue only keeps the announce in order
            t2 = time.perf_counter()
            packed = publisher.prepare_device(device)  # type: ignore[attr-defined]
            stages["snapshot"] += time.perf_counter() - t2
            return Snapshot(v, lambda: packed, stages)
        return Snapshot(v, lambda: publisher.prepare(finish()), stages)

    def write(self, v: int, step: int) -> Written:
        """The trainer writes RUN_DIR/weights/v<v>; read back (digest, finiteness); then the
        transport's part before an announce (``WeightPublisher.prepare``: shm's /dev/shm copy)."""
        t0 = time.perf_counter()
        pub = self._guarded(v, step, lambda out: self.trainer.publish(out, v))
        if pub is None:
            raise CoordinatorError(f"the trainer returned no publication for v{v}")
        self.publisher.prepare(pub)
        return Written(pub, {**pub.stage_s, "total": time.perf_counter() - t0})

    def _guarded(self, v: int, step: int, take: Callable[[Path], Any]) -> Any:
        """``take(RUN_DIR/weights/v<v>)``; non-finite weights end the run, nothing written."""
        out = weights_dir(self.run_dir, v)
        try:
            return take(out)
        except NonFiniteWeightsError as e:  # never announced; nothing non-finite is served
            shutil.rmtree(out, ignore_errors=True)
            raise NonFinitePublication(
                f"step {step}: the trainer's weights are not finite ({e}); version "
                f"v{v} was not published (generators keep v{v - 1}); resume from the last "
                "checkpoint with a lower optimizer.lr or a tighter optimizer.grad_clip"
            ) from e

    # -- the coordinator's thread ------------------------------------------------------------------
    def hand_over(
        self, made: Snapshot | Written | None
    ) -> tuple[dict[str, float] | None, float | None]:
        """A completed step's version (``prepare``'s, None when it published none): a written
        one announced now, a taken one queued (announced by ``announce_ready`` when written);
        then every queued version that is ready. Returns what the step's metrics row reports
        (pipeline.core.timeline ``publish`` and ``announce_s``): this step's publication stages
        and those of the versions announced since the last row."""
        announce_s, stages = None, None
        if isinstance(made, Snapshot):  # hashed and written beside the next step
            assert self.pending is not None
            stages = dict(made.stages)  # before the publishing thread adds its own
            self.pending.submit(made)
        elif made is not None:
            t_ann = time.perf_counter()
            self._announce(made.publication)
            announce_s = time.perf_counter() - t_ann
            self.timeline.announced(made.publication.version)
            stages = made.stages
        self.announce_ready()
        if self._announced_stages:  # versions of earlier steps announced since the last row
            stages = {**(stages or {}), **self._announced_stages}
            announce_s = self._announced_stages.pop("announce")
            self._announced_stages = {}
        return stages, announce_s

    def announce_ready(self, *, wait: bool = False) -> int:
        """Announce the versions whose hash and write are done, in order (``wait``: every
        pending one, waited for); the number announced."""
        q = self.pending
        if q is None or not len(q):
            return 0
        done = q.wait_all() if wait else q.ready()
        for pub, stages in done:
            t = time.perf_counter()
            self._announce(pub)
            ann = time.perf_counter() - t
            self.timeline.announced(pub.version)
            log.debug("v%d published: snapshot %.3f s, hash + write %.3f s beside training, "
                      "waited %.3f s for room, announced %.3f s after", pub.version,
                      stages.get("snapshot", 0.0), stages.get("total", 0.0),
                      stages.get("room_wait", 0.0), stages.get("lag", 0.0))  # fmt: skip
            acc = self._announced_stages
            for key in ("total", "blob", "digest", "write"):  # the finish's, summed
                if key in stages:
                    acc[key] = acc.get(key, 0.0) + stages[key]
            acc["lag"] = max(acc.get("lag", 0.0), stages.get("lag", 0.0))
            acc["announce"] = acc.get("announce", 0.0) + ann
        return len(done)

    def publish(self, step: int) -> None:
        """Write the trainer's current weights as version + 1 and announce it, now (resume,
        tests; a step's version goes through ``prepare``); ``step``: the step it follows."""
        self.announce_ready(wait=True)
        self._announce(self.write(self.version + 1, step).publication)

    def announce_again(self, pub: Publication) -> None:
        """Resume at the newest announced version ``pub`` (read back from its directory, its
        digest the one digests.jsonl recorded): the publisher offers it to every generator
        that does not serve it, e.g. one started after the learner stopped."""
        self.announce_ready(wait=True)
        assert pub.version == self.version, "announce_again: not current"
        self._announce(pub, again=True)

    def _announce(self, pub: Publication, *, again: bool = False) -> None:
        """Announce the trainer's Publication as it is (its digest is not computed again).
        ``again``: a version announced before this learner started (a resume at the newest
        version: generators that join now need it), not recorded a second time."""
        v = pub.version
        if pub.path is None and not pub.on_device_only:
            raise CoordinatorError(f"publication v{v} has no directory")
        assert again or v > self.version, f"v{v} announced after v{self.version}"
        if not again:
            # Write-ahead: a version is in digests.jsonl before any generator can hear of it, so
            # a resume never reuses the number of weights that were announced (core.resume).
            (self.run_dir / "weights").mkdir(parents=True, exist_ok=True)  # a device-only v
            with (self.run_dir / "weights" / "digests.jsonl").open("a") as f:
                f.write(json.dumps(pub.record()) + "\n")  # with its digest kind
            faults.kill_at("announce", v)  # the crash tests' kill -9: written, never announced
        self.publisher.publish(pub)  # the transport's announce and transfers
        self.version, self.last_digest = v, pub.digest
        # what a generator reads: the adapter set alone when the version carries one
        self.announced_bytes = int(pub.adapter["bytes"]) if pub.adapter else pub.nbytes
        self.set_status(v)
        # every directory older than the newest publish.keep (0: all kept), a killed run's too:
        # on a thread of its own (deleting a 1.1 GB file took 0.2 s of the coordinator's turn)
        self._pruner.submit(prune_weights, self.run_dir, v, self.cfg.keep).add_done_callback(
            _log_failure(f"pruning weights below v{v}")
        )

    def close(self) -> None:
        """Wait for the versions being written (the publisher is closed after: shm removes
        this run's /dev/shm files then)."""
        if self.pending is not None:
            self.pending.close()
        self._pruner.shutdown(wait=True)
