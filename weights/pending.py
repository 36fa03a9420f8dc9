"""Publication off the critical path: versions hashed and written while the next steps train.

A step that publishes ends with the trainer's ``snapshot(out_dir, v)``: the weights gathered
and copied (on the trainer thread, every rank). What is left, the blob, the tree digest and
the directory (``finish()``, with the transport's ``WeightPublisher.prepare``: shm's /dev/shm
copy), runs here, on one publishing thread, while the next step trains; with
``max_pending`` > 1 each pending version's on its own thread, so consecutive versions overlap
their stages (one builds its blob from the device while the one before it is written to
disk: the disk, not the sum of the stages, then sets the pace). The coordinator announces a
version when its ``finish()`` is done, in version order:
a version counts as published when its digest is announced, so the staleness gate sees what
it saw before. At most ``max_pending`` versions are unfinished at once: the trainer thread
waits (``make_room``) before taking the next snapshot, so a slow disk slows training down
instead of piling up copies.

Per version (seconds, ``stages``): ``snapshot`` (the trainer's part, on the critical path),
``total`` (the finish, off it: the metrics row's ``time/publish``) and the finish's own
``blob``, ``digest`` and ``write`` (``Publication.stage_s``), ``room_wait`` (the
trainer waiting for a free slot), ``lag`` (handed to the publishing thread -> announced).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from weights.publication import Publication

Finish = Callable[[], Publication]


@dataclass
class Snapshot:
    """A version's weights taken from the trainer: ``finish()`` still to run."""

    version: int
    finish: Finish
    stages: dict[str, float] = field(default_factory=dict)


@dataclass
class _Pending:
    version: int
    future: Future[Publication]
    stages: dict[str, float]
    t0: float


class PublicationQueue:
    """See the module docstring. ``submit``/``ready``/``wait_all`` on the coordinator's
    thread; ``make_room`` on the trainer thread."""

    def __init__(
        self,
        max_pending: int,
        clock: Callable[[], float] = time.perf_counter,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """``on_done``: called on the publishing thread when a version's finish ends (the
        coordinator's waker: the version is announced at once)."""
        if max_pending < 1:
            raise ValueError(f"max_pending: expected >= 1, got {max_pending}")
        self.max_pending, self.clock, self.on_done = max_pending, clock, on_done
        self._pool = ThreadPoolExecutor(max_pending, thread_name_prefix="publish")
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, snap: Snapshot) -> None:
        """Start ``snap.finish()`` on the publishing thread."""
        t0 = self.clock()

        def run() -> Publication:
            t = self.clock()
            pub = snap.finish()
            snap.stages.update(pub.stage_s)  # blob, digest, write (learner.publish)
            snap.stages["total"] = self.clock() - t
            return pub

        fut = self._pool.submit(run)
        if self.on_done is not None:
            done = self.on_done
            fut.add_done_callback(lambda _f: done())
        with self._lock:
            self._pending.append(_Pending(snap.version, fut, snap.stages, t0))

    def make_room(self) -> float:
        """Block until fewer than ``max_pending`` versions are unfinished; the seconds waited."""
        t = self.clock()
        while True:
            with self._lock:
                busy = [p.future for p in self._pending if not p.future.done()]
            if len(busy) < self.max_pending:
                return self.clock() - t
            busy[0].exception()  # waited for; an error is raised where it is announced

    def ready(self) -> list[tuple[Publication, dict[str, float]]]:
        """The finished versions at the head of the queue, oldest first (an error raised by a
        finish is raised here, for its version, and the rest wait)."""
        out: list[tuple[Publication, dict[str, float]]] = []
        while True:
            with self._lock:
                if not self._pending or not self._pending[0].future.done():
                    return out
                p = self._pending.popleft()
            out.append(self._take(p))

    def wait_all(self) -> list[tuple[Publication, dict[str, float]]]:
        """Every pending version, waited for, oldest first."""
        out: list[tuple[Publication, dict[str, float]]] = []
        while True:
            with self._lock:
                if not self._pending:
                    return out
                p = self._pending.popleft()
            p.future.result()
            out.append(self._take(p))

    def _take(self, p: _Pending) -> tuple[Publication, dict[str, float]]:
        pub = p.future.result()
        if pub.version != p.version:
            raise RuntimeError(f"publication v{pub.version} finished for version v{p.version}")
        p.stages["lag"] = self.clock() - p.t0
        return pub, p.stages

    def close(self) -> None:
        self._pool.shutdown(wait=True)
