"""Weight push over a torch.distributed broadcast (publish.transport=collective), learner side.

``CollectivePublisher`` is a ``WeightPublisher`` (weights.publisher) whose generators get
each version by one broadcast from the learner (rank 0) instead of one chunk stream each; the
coordinator drives it exactly like the ZMQ publisher (publish / add_generator / handle / observe
/ remove_generator / pump / close). weights.collective.group has the rendezvous keys. Loop, on the
coordinator's thread, every ``pump()``::

    a round finished?  ok: its members are "delivered" (they Ack over ZMQ once verified, loaded)
                       failed: members that did not Ack fall back to ZMQ chunks (see below)
    no round running and collective generators lag the current version vN (not delivered)?
        round r := those generators; each gets WeightAnnounce(vN, collective={store, round r,
        backend, timeout_s}) on the weights channel, then a worker thread runs the round:
            wait <= timeout_s for every member's join key; roster := those that joined
            group (rank 0 + roster) on the store, deliver the blob, drop the group

Delivery (weights.collective.deliver): with ``pipe_bytes`` > 0 (publish.collective_chunk_bytes,
4 MiB by default; the announce carries it as collective.chunk_bytes so every rank cuts the same
pieces) gloo forwards the blob piece by piece along the chain learner -> 1 -> 2 -> ... (hops
overlap: about one copy's time + a piece per extra generator, against gloo's tree broadcast,
log2(N + 1) whole copies in sequence); nccl broadcasts piece by piece. 0: one broadcast.

A new group per round: its members are exactly the generators that lack the version, so a
generator that joins mid-run (its Hello -> ``add_generator``) gets the current version in a
round of its own through the same path, and a membership change never touches a live group.
Group set-up costs milliseconds on gloo (measured in docs/PERFORMANCE.md); on NCCL it is larger,
which is what a cached group for an unchanged membership would save (not built).

Failure, bounded: every wait of a round (joins, group, broadcast) is at most ``timeout_s``, on
a thread of its own, so the coordinator keeps taking rollouts meanwhile. A generator that does
not join in time, a round whose group or broadcast fails (a member died mid-round), and a
generator that Nacks the collective announce (its receive failed, its digest did not match, or
it predates protocol 1.2) fall back to the ZMQ chunk stream for that version and every later one
until it reconnects (``add_generator`` puts it back on the collective): a dead or unreachable
generator costs at most one bounded round, never a hang. A dead generator is then dropped as
always, by its heartbeat expiring.

Invariants (as the ZMQ publisher): a generator serves a version only after its own digest
check (weights.collective.generator); versions are announced in increasing order; only the
newest version is ever sent.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.records import Nack
from proto.schema import Scalar
from weights.collective import group as coll
from weights.publisher import LearnerSide, PublishSettings, WeightPublisher

log = logging.getLogger(__name__)


@dataclass
class _Round:
    name: str
    version: int
    members: list[str]
    future: Future[tuple[list[str], dict[str, float]]]
    started: float


class CollectivePublisher(WeightPublisher):
    """Learner side of the collective transport; see the module docstring for the loop."""

    def __init__(
        self,
        endpoint: LearnerSide,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 5.0,
        pipe_bytes: int = coll.DEFAULT_PIPE_BYTES,
        chunk_bytes: int = 16 << 20,
        window: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(endpoint, chunk_bytes=chunk_bytes, window=window, clock=clock)
        if backend not in coll.BACKENDS:
            raise ValueError(f"collective backend {backend!r}: expected one of {coll.BACKENDS}")
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.pipe_bytes = coll.check_pipe_bytes(pipe_bytes)
        self.store = coll.host_store(host, port, timeout_s)
        self.address = f"{host}:{self.store.port}"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-collective")
        self._round: _Round | None = None
        self._rounds = 0
        self._delivered: dict[str, int] = {}  # gid -> version its last good round carried
        self.round_log: list[dict[str, Any]] = []  # per finished round: members, joined, s, error

    # -- WeightPublisher interface (the blob is kept: it is broadcast, and the fallback) ------
    def add_generator(self, gid: str, serving_version: int = -1) -> None:
        """A (re)connected generator takes the collective path (again), whatever it did before."""
        self._delivered.pop(gid, None)
        self.external.add(gid)
        super().add_generator(gid, serving_version)

    def remove_generator(self, gid: str) -> None:
        self._delivered.pop(gid, None)
        super().remove_generator(gid)

    def handle(self, peer: str, rec: Any) -> bool:
        """A Nack of weights from a collective generator: it falls back to ZMQ chunks."""
        if isinstance(rec, Nack) and rec.kind == "weights" and peer in self.external:
            self.counts["collective_nacked"] += 1
            log.warning("generator %s refused collective weights v%d (%s): ZMQ chunks from now",
                        peer, rec.version, rec.reason)  # fmt: skip
            self._fall_back(peer)
            return True
        return super().handle(peer, rec)

    def pump(self) -> int:
        self._reap()
        if self._round is None:
            self._start_round()
        return super().pump()

    def close(self) -> None:
        """Wait for a round in flight (bounded by its timeouts), then free the store."""
        self._pool.shutdown(wait=True)
        self._reap()
        del self.store

    # -- rounds -------------------------------------------------------------------------------
    def lagging(self) -> list[str]:
        """Collective generators that lack the current version and no good round carried it."""
        v = self.version
        return sorted(
            gid for gid in self.external
            if self.serving(gid) < v and self._delivered.get(gid, -1) < v
        )  # fmt: skip

    def _start_round(self) -> None:
        ann = self.announce
        members = self.lagging() if ann is not None else []
        if ann is None or not members:
            return
        self._rounds += 1
        name = f"v{ann.version}/r{self._rounds}"
        info: dict[str, Scalar] = {"store": self.address, "round": name, "backend": self.backend,
                "timeout_s": float(self.timeout_s), "chunk_bytes": self.pipe_bytes}  # fmt: skip
        out = dataclasses.replace(ann, chunk_bytes=0, num_chunks=0, path="", collective=info)
        sent = [gid for gid in members if self.endpoint.send(gid, out, channel="weights")]
        if not sent:
            return
        fut = self._pool.submit(self._run, name, sent, self._blob)
        self._round = _Round(name, ann.version, sent, fut, self.clock())
        self.counts["collective_rounds"] += 1

    def _run(
        self, name: str, members: list[str], blob: bytes | memoryview
    ) -> tuple[list[str], dict[str, float]]:
        """The worker thread: rendezvous, group, broadcast; returns the ids that were in it and
        the seconds of each phase."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        keys = {gid: coll.join_key(name, gid) for gid in members}
        joined: list[str] = []
        while time.monotonic() < deadline:
            joined = [gid for gid in members if self.store.check([keys[gid]])]
            if len(joined) == len(members):
                break
            time.sleep(0.002)
        self.store.set(coll.roster_key(name), coll.encode_roster(joined))
        t1 = t2 = time.monotonic()
        if joined:
            group = coll.open_group(self.store, name, 0, len(joined) + 1, backend=self.backend,
                                    timeout_s=self.timeout_s, hostname=self.host)  # fmt: skip
            t2 = time.monotonic()
            coll.deliver(group, coll.blob_tensor(blob, self.backend), 0, len(joined) + 1,
                         chunk_bytes=self.pipe_bytes, timeout_s=self.timeout_s)  # fmt: skip
            del group
        t3 = time.monotonic()
        return joined, {"join_s": t1 - t0, "group_s": t2 - t1, "broadcast_s": t3 - t2}

    def _reap(self) -> None:
        r = self._round
        if r is None or not r.future.done():
            return
        self._round = None
        exc = r.future.exception()
        joined, phases = ([], {}) if exc is not None else r.future.result()
        entry: dict[str, Any] = {"round": r.name, "members": len(r.members),
                                 "joined": len(joined), "seconds": round(self.clock() - r.started, 4),
                                 "error": "" if exc is None else str(exc)[:300]}  # fmt: skip
        entry.update({k: round(v, 4) for k, v in phases.items()})
        self.round_log.append(entry)
        del self.round_log[:-64]
        if exc is not None:
            self.counts["collective_failed"] += 1
            log.warning("collective round %s failed (%s): its generators fall back to ZMQ",
                        r.name, exc)  # fmt: skip
        for gid in r.members:
            if gid not in self.external:
                continue  # gone, or already fallen back (its Nack came first)
            if gid in joined:
                self._delivered[gid] = r.version
                self.counts["collective_delivered"] += 1
            elif self.serving(gid) < r.version:
                log.warning("generator %s missed collective round %s: ZMQ chunks from now",
                            gid, r.name)  # fmt: skip
                self._fall_back(gid)

    def _fall_back(self, gid: str) -> None:
        """``gid`` leaves the collective until it reconnects; the current version goes by ZMQ."""
        self.external.discard(gid)
        self._delivered.pop(gid, None)
        self.counts["collective_fallbacks"] += 1
        g = self._gens.get(gid)
        if g is not None and self.announce is not None and g.serving < self.version:
            self._start(g)


def collective_publisher(
    endpoint: LearnerSide, settings: PublishSettings, run_dir: Path
) -> CollectivePublisher:
    """publish.transport=collective (weights.transports): a broadcast round per version, ZMQ
    chunks for a generator that falls out of it."""
    s = settings
    return CollectivePublisher(
        endpoint, host=s.collective_host, port=s.collective_port, backend=s.collective_backend,
        timeout_s=s.collective_timeout_s, pipe_bytes=s.collective_chunk_bytes,
        chunk_bytes=s.chunk_bytes, window=s.window,
    )  # fmt: skip


__all__ = ["CollectivePublisher", "collective_publisher"]
