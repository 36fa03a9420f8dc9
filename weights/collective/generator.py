"""Weights by torch.distributed broadcast (publish.transport=collective), generator side.

``CollectiveReceiver`` is the transport's receiver (weights.receiver.Receiver; registered in
weights.transports): a WeightAnnounce whose ``collective`` field is set is received here;
every other weight record (ZMQ chunks, the fallback the learner switches a generator to when a
round fails) goes to the ``fallback`` receiver (weights.receiver.WeightReceiver), so a
generator serves whichever transport the learner picks, without a setting of its own. One announce, on the loop's
thread (weights.collective.group has the keys)::

    store := the learner's TCPStore at collective.store (one client per address, kept)
    set <round>/join/<id>; wait <= timeout_s for <round>/roster
    not in the roster (joined too late): Nack -> the learner sends this version by ZMQ
    group on the store (rank = index in roster + 1), receive the blob (<= timeout_s), forwarding
        it piece by piece to the next rank when collective.chunk_bytes > 0 (weights.collective.deliver)
    digest == announced (weights.check.check_blob: the tree's pieces hashed in parallel, a
        bad piece named)? -> VerifiedWeights to the loop, which loads it through
        engine.load_weights (views of the checked bytes: not hashed again), then Ack
    else / any failure: Nack(reason); nothing is served (the learner sends that version by ZMQ
        chunks, which re-fetch a bad piece alone)

Invariants: a set is handed out only after its digest matched the announcement, so a
corrupted broadcast is never served; every wait is bounded by the announce's ``timeout_s``, so
a dead learner or peer costs at most a few timeouts of the loop's thread (heartbeats pause
meanwhile: keep timeout_s below the learner's transport.peer_timeout_s). The receive blocks
the loop's thread (not the engine's: generation in progress goes on).
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import timedelta
from typing import Any

import torch

from proto.records import Ack, Nack, WeightAnnounce
from weights.check import WeightsRefused
from weights.collective import group as coll
from weights.receiver import GeneratorSide, Receiver
from weights.verified import VerifiedWeights

log = logging.getLogger(__name__)


class CollectiveReceiver:
    """Generator side of the collective transport; see the module docstring for the loop."""

    def __init__(
        self,
        conn: GeneratorSide,
        fallback: Receiver,
        generator_id: str,
        *,
        serving_version: int = -1,
        max_total_bytes: int = 1 << 40,
        hostname: str = "",
    ) -> None:
        self.conn, self.fallback, self.generator_id = conn, fallback, generator_id
        self.serving, self.max_total_bytes = serving_version, max_total_bytes
        self.hostname = hostname  # the address gloo binds; "": the one that reaches the learner
        self._stores: dict[str, Any] = {}
        self.counts: Counter[str] = Counter()

    def handle(self, rec: Any) -> VerifiedWeights | None:
        """One record of the weights channel; returns a verified set to load, or None."""
        if isinstance(rec, WeightAnnounce) and rec.collective:
            return self._receive(rec)
        return self.fallback.handle(rec)

    def loaded(self, version: int) -> None:
        self.serving = max(self.serving, version)
        self.fallback.loaded(version)  # the Ack (and the chunk receiver learns the version)

    def load_failed(self, version: int, reason: str) -> None:
        self.fallback.load_failed(version, reason)

    def _nack(self, version: int, reason: str) -> None:
        log.warning("refusing collective weights v%d: %s", version, reason)
        self.counts["nacked"] += 1
        self.conn.send(Nack("weights", str(version), reason[:2000], version), channel="weights")

    def _receive(self, ann: WeightAnnounce) -> VerifiedWeights | None:
        v, c = ann.version, ann.collective
        if v <= self.serving:  # already serving it: our Ack was lost
            self.conn.send(Ack("weights", str(self.serving), self.serving), channel="weights")
            return None
        if ann.total_bytes > self.max_total_bytes:
            self._nack(v, f"{ann.total_bytes} bytes exceed max_total_bytes {self.max_total_bytes}")
            return None
        limit = c["timeout_s"]  # WeightAnnounce.validate checked it is a number > 0
        assert isinstance(limit, int | float)
        name, backend, timeout_s = str(c["round"]), str(c["backend"]), float(limit)
        pipe = c.get("chunk_bytes", 0)  # absent (a 1.2 learner): one whole broadcast
        assert isinstance(pipe, int)
        try:
            store = self._store(str(c["store"]), timeout_s)
            store.set(coll.join_key(name, self.generator_id), "1")
            # the learner waits timeout_s for the joins, then writes the roster
            store.wait([coll.roster_key(name)], timedelta(seconds=2 * timeout_s))
            roster = coll.decode_roster(store.get(coll.roster_key(name)))
            if self.generator_id not in roster:
                self._nack(v, f"round {name}: not in the roster (joined after {timeout_s}s)")
                return None
            rank = roster.index(self.generator_id) + 1
            group = coll.open_group(store, name, rank, len(roster) + 1, backend=backend,
                                    timeout_s=timeout_s, hostname=self._hostname(c))  # fmt: skip
            blob, t = coll.buffer_tensor(ann.total_bytes, backend)
            coll.deliver(group, t, rank, len(roster) + 1, chunk_bytes=pipe, timeout_s=timeout_s)
            del group
            if t.is_cuda and len(blob):  # nccl: the bytes come back to host memory (the loader)
                torch.frombuffer(blob, dtype=torch.uint8).copy_(t)  # one device -> host copy
        except Exception as e:  # a timeout, a dead peer, an unreachable store: refuse, go on
            self._stores.pop(str(c.get("store")), None)
            self.counts["failed"] += 1
            self._nack(v, f"collective receive of round {name} failed: {e}")
            return None
        try:
            ready = VerifiedWeights.of_blob(ann, blob)
        except WeightsRefused as e:
            self.counts["digest_mismatch"] += 1
            self._nack(v, f"weights v{v}: {e}")
            return None
        self.counts["verified"] += 1
        return ready

    def _store(self, addr: str, timeout_s: float) -> Any:
        if addr not in self._stores:
            self._stores[addr] = coll.join_store(addr, timeout_s)
        return self._stores[addr]

    def _hostname(self, c: dict[str, Any]) -> str:
        if self.hostname:
            return self.hostname
        return coll.local_address_towards(*coll.split_address(str(c["store"])))


__all__ = ["CollectiveReceiver"]
