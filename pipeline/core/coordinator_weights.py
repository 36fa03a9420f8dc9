"""Weight versions (a mixin of pipeline.core.coordinator.Coordinator): a step's publication
written (or hashed and written beside the next step, pipeline.core.publishing) and announced
in version order: digests.jsonl first (write-ahead), then the publisher's transfers to the
generators; non-finite weights end the run unpublished. The state it reads is the
Coordinator's, built in its ``__init__``."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from models.errors import NonFiniteWeightsError
from models.weights.publication import Publication, prune_weights, weights_dir
from models.weights.shm import prune_shm, publish_shm
from pipeline.backends.trainer_api import Trainer
from pipeline.config import RunConfig
from pipeline.core import faults
from pipeline.core.coordinator_errors import CoordinatorError, NonFinitePublication
from pipeline.core.dispatch import Dispatcher
from pipeline.core.publishing import PublicationQueue
from pipeline.core.timeline import StepTimeline

log = logging.getLogger("pipeline.core.coordinator")


class WeightPublishing:
    """Publication and announcement of weight versions (see the module docstring)."""

    cfg: RunConfig
    run_dir: Path
    trainer: Trainer
    endpoint: Any
    dispatcher: Dispatcher
    publisher: Any
    publications: PublicationQueue | None
    timeline: StepTimeline
    version: int
    last_digest: str
    step: int
    version_step: int
    _job: Any
    _publish_times: dict[str, float]
    _announced_stages: dict[str, float]

    def announce_ready(self, *, wait: bool = False) -> int:
        """Announce the versions whose hash and write are done, in order (``wait``: every
        pending one, waited for); the number announced."""
        q = self.publications
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

    def publish(self) -> None:
        """Publish the trainer's current weights as version + 1 (on disk, and sent if set).
        Only while no step runs (resume, tests); steps publish through their job."""
        assert self._job is None, "publish() while a step is running"
        self.announce_ready(wait=True)
        self._announce(self._write_publication(self.version + 1))
        self.version_step = self.step

    def announce_again(self, pub: Publication) -> None:
        """Resume at the newest announced version ``pub`` (read back from its directory, its
        digest the one digests.jsonl recorded): the publisher offers it to every generator
        that does not serve it, e.g. one started after the learner stopped."""
        self.announce_ready(wait=True)
        assert self._job is None and pub.version == self.version, "announce_again: not current"
        self._announce(pub, again=True)

    def _write_publication(self, v: int) -> Publication:
        """The trainer writes RUN_DIR/weights/v<v>; read back (digest, finiteness)."""
        t0 = time.perf_counter()
        pub = self._guarded(v, lambda out: self.trainer.publish(out, v))
        if pub is None:
            raise CoordinatorError(f"the trainer returned no publication for v{v}")
        self._with_shm(lambda: pub)()
        self._publish_times = {**pub.stage_s, "total": time.perf_counter() - t0}
        return pub

    def _with_shm(self, finish: Callable[[], Publication]) -> Callable[[], Publication]:
        """``finish`` then, with publish.transport shm, the same bytes once more into /dev/shm
        (models.weights.shm; its seconds in ``pub.stage_s["shm_write"]``)."""
        if self.cfg.publish.transport != "shm":
            return finish

        def run() -> Publication:
            pub = finish()
            t0 = time.perf_counter()
            publish_shm(pub)
            pub.stage_s["shm_write"] = time.perf_counter() - t0
            return pub

        return run

    def _guarded(self, v: int, take: Callable[[Path], Any]) -> Any:
        """``take(RUN_DIR/weights/v<v>)``; non-finite weights end the run, nothing written."""
        out = weights_dir(self.run_dir, v)
        try:
            return take(out)
        except NonFiniteWeightsError as e:  # never announced; nothing non-finite is served
            shutil.rmtree(out, ignore_errors=True)
            raise NonFinitePublication(
                f"step {self.step + 1}: the trainer's weights are not finite ({e}); version "
                f"v{v} was not published (generators keep v{v - 1}); resume from the last "
                "checkpoint with a lower optimizer.lr or a tighter optimizer.grad_clip"
            ) from e

    def _announce(self, pub: Publication, *, again: bool = False) -> None:
        """Announce the trainer's Publication as it is (its digest is not computed again).
        ``again``: a version announced before this learner started (a resume at the newest
        version: generators that join now need it), not recorded a second time."""
        v = pub.version
        if pub.path is None:
            raise CoordinatorError(f"publication v{v} has no directory")
        if not again:
            # Write-ahead: a version is in digests.jsonl before any generator can hear of it, so
            # a resume never reuses the number of weights that were announced (core.resume).
            with (self.run_dir / "weights" / "digests.jsonl").open("a") as f:
                f.write(json.dumps(pub.record()) + "\n")  # with its digest kind
            faults.kill_at("announce", v)  # the crash tests' kill -9: written, never announced
        self.publisher.publish(
            v, pub.blob, tensors=pub.tensor_metas(), config_json=pub.config_json,
            path=str(Path(pub.path).resolve()), digest=pub.digests,
            chunked=self.cfg.publish.transport not in ("shared_fs", "shm"),  # collective: blob too
        )  # fmt: skip
        self.version, self.last_digest = v, pub.digest
        self.endpoint.set_status(v, self.dispatcher.inflight())
        # every directory older than the newest publish.keep (0: all kept), a killed run's too
        prune_weights(self.run_dir, v, self.cfg.publish.keep)
        if self.cfg.publish.transport == "shm":  # bounded like the directories
            prune_shm(self.run_dir / "weights", v, self.cfg.publish.keep)
