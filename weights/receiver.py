"""The generator's end of the weights channel: ``WeightReceiver``, every transport's receiver.

It takes every record of the weights channel a transport of its own does not claim
(weights.transports): an announce of a directory (shared_fs, shm: nothing else travels) is
handed out at once as ``VerifiedWeights.of_directory``, checked when the engine reads it; an
announce with chunks (zmq, and collective's fallback) is assembled from its ``WeightChunk``s
here, its digest checked, and handed out as ``VerifiedWeights`` in memory. The learner's end:
weights.publisher.

Loop (generator.loop)::

    rx = WeightReceiver(conn)                 # or weights.transports.open_receiver
    ready = rx.handle(record)                 # every record from the weights channel
    if ready: engine.load_weights(ready); rx.loaded(ready.version)   # -> Ack(kind="weights")
    (the engine refused it: rx.load_failed(ready.version, why))      # -> Nack(kind="weights")

Credits: one ``Ack(kind="chunk", ref="<version>/<index>")`` for every chunk frame taken off the
wire, whatever is done with it (the publisher keeps at most its window uncredited).

Digest check (weights.check, docs/CONTRACTS.md 6): a tree-digest announce (digest_kind
"sha256-tree") carries the sha256 of every ``digest_chunk_bytes`` piece; the receiver first
checks that those leaves hash to the announced digest, then hashes each piece once, as soon as
its bytes are in, against its leaf (``PieceCheck``). A piece that does not match is named in
the log and in ``Nack(kind="chunk", ref="<version>/<chunk index>")`` for each WeightChunk it
spans, on which the publisher sends those chunks again (at most ``max_refetch`` times per
piece, then the whole transfer is refused). The set is handed out once every piece matched:
the bytes were hashed once, and nobody hashes them again. A flat-digest announce (digest_kind
"" or "sha256": runs before the tree, opaque test payloads) is checked over the whole blob at
the end.

Invariants: the receiver hands out a blob only after its digest equals the announced digest,
so a generator never serves weights that do not match; a chunk with a bad crc32, index,
offset or size, or a flat digest mismatch, discards the transfer and sends
``Nack(kind="weights")``, on which the publisher resends that version. Duplicate and
out-of-order chunks are harmless (a chunk of a version never announced, its announce lost on a
reconnect, is answered by a Nack, so the publisher restarts); a newer announce supersedes an
incomplete older transfer; a version announced again while it is being loaded is not handed
out twice.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from proto.records import Ack, ErrorMsg, Nack, WeightAnnounce, WeightChunk
from weights.check import PieceCheck, WeightsRefused, check_digest, tensors_of
from weights.digest import TREE
from weights.verified import VerifiedWeights

log = logging.getLogger(__name__)


class GeneratorSide(Protocol):
    """The generator's connection as a receiver replies through it (generator.collaborators)."""

    def send(self, record: Any, *, channel: Any = ...) -> bool: ...


class Receiver(Protocol):
    """What the generator loop needs from a receiver (generator.loop; built by
    weights.transports.open_receiver); replies (credits, Acks, Nacks) go out through its own
    connection."""

    def handle(self, rec: Any) -> VerifiedWeights | None:
        """One record of the weights channel; a version ready to load, or None."""
        ...

    def loaded(self, version: int) -> None:
        """The engine serves ``version`` now: acknowledge it to the learner."""
        ...

    def load_failed(self, version: int, reason: str) -> None:
        """The engine refused ``version``: refuse it to the learner (which sends it again)."""
        ...


@dataclass
class _Transfer:
    ann: WeightAnnounce
    buf: bytearray
    have: bytearray  # one flag per chunk
    count: int = 0
    check: PieceCheck | None = None  # tree kind: the per-piece digest check


class WeightReceiver:
    """Generator side; see the module docstring for the loop and the invariants."""

    def __init__(
        self,
        conn: GeneratorSide,
        *,
        serving_version: int = -1,
        max_total_bytes: int = 1 << 40,
        max_refetch: int = 3,
    ) -> None:
        self.conn = conn
        self.max_refetch = max_refetch
        self.serving = serving_version
        self.max_total_bytes = max_total_bytes
        self._t: _Transfer | None = None
        self._verified = -1  # newest version handed out and not yet confirmed by loaded()
        self._refused = -1  # newest version Nacked
        self.counts: Counter[str] = Counter()

    @property
    def receiving(self) -> int:
        """Version being assembled, -1 none."""
        return -1 if self._t is None else self._t.ann.version

    def handle(self, rec: Any) -> VerifiedWeights | None:
        """Feed one record from the weights channel; returns weights ready to load (an
        announced directory is not read here: the engine checks what it reads)."""
        if isinstance(rec, WeightAnnounce):
            return self._announce(rec)
        if isinstance(rec, WeightChunk):
            return self._chunk(rec)
        if isinstance(rec, ErrorMsg):
            log.warning("learner error on the weights channel: %s: %s", rec.code, rec.message)
        return None

    def loaded(self, version: int) -> None:
        """The engine serves ``version`` now: acknowledge it to the learner."""
        self.serving = max(self.serving, version)
        self.conn.send(Ack("weights", str(version), version), channel="weights")

    def load_failed(self, version: int, reason: str) -> None:
        """The engine could not load verified weights: refuse them (the learner retries)."""
        self._verified = -1
        self._nack(version, f"engine could not load: {reason}")

    def _nack(self, version: int, reason: str) -> None:
        log.warning("refusing weights v%d: %s", version, reason)
        self._refused = max(self._refused, version)
        self.counts["nacked"] += 1
        self.conn.send(Nack("weights", str(version), reason, version), channel="weights")

    def _announce(self, a: WeightAnnounce) -> VerifiedWeights | None:
        v, t = a.version, self._t
        if v <= self.serving:  # already serving it (our Ack was lost) or older: re-ack
            self.conn.send(Ack("weights", str(self.serving), self.serving), channel="weights")
            return None
        if v == self._verified or (t is not None and v < t.ann.version):
            self.counts["ignored"] += 1  # being loaded, or older than the transfer under way
            return None
        if t is not None and v == t.ann.version and a == t.ann:
            self.counts["resumed"] += 1  # the publisher restarted: keep what we have
            return None
        if t is not None:
            self.counts["superseded"] += 1
        self._t = None
        if a.total_bytes > self.max_total_bytes:
            self._nack(v, f"{a.total_bytes} bytes exceed max_total_bytes {self.max_total_bytes}")
            return None
        if a.num_chunks == 0 and (a.total_bytes or not a.chunk_bytes):  # a directory alone
            if not a.path:
                self._nack(v, "announce with neither chunks nor a path")
                return None
            self._verified = v
            self.counts["on_disk"] += 1
            return VerifiedWeights.of_directory(a)  # checked as the engine reads it
        t = _Transfer(a, bytearray(a.total_bytes), bytearray(a.num_chunks))
        if a.digest_kind == TREE:
            try:
                t.check = PieceCheck(a)
            except WeightsRefused as e:
                self._nack(v, f"bad tree digest or tensor metadata: {e}")
                return None
        self._t = t
        return self._finish() if a.num_chunks == 0 else None

    def _refetch(self, t: _Transfer, bad: list[int]) -> str:
        """Drop the chunks of the pieces that failed their leaves and ask for them again;
        why the transfer is refused (a piece over ``max_refetch``), or ""."""
        a, check = t.ann, t.check
        assert check is not None
        for j in bad:
            names = tensors_of(a, j)[:4]
            size = a.digest_chunk_bytes
            log.warning("weights v%d: piece %d (bytes %d..%d, tensors %s) does not match its "
                        "digest; fetching it again", a.version, j, j * size,
                        min((j + 1) * size, a.total_bytes), names)  # fmt: skip
            self.counts["pieces_refetched"] += 1
            if check.refetched[j] > self.max_refetch:
                return f"piece {j} did not match its digest after {self.max_refetch} re-fetches"
            for k in check.chunks_of(j):
                if t.have[k]:
                    t.have[k], t.count = 0, t.count - 1
                    check.chunk_out(k)
                why = f"piece {j} (tensors {names}) does not match its digest"
                self.conn.send(Nack("chunk", f"{a.version}/{k}", why, a.version), channel="weights")
        return ""

    def _chunk(self, c: WeightChunk) -> VerifiedWeights | None:
        self.conn.send(Ack("chunk", f"{c.version}/{c.index}", c.version), channel="weights")
        t = self._t
        if t is None or c.version != t.ann.version:
            self.counts["ignored"] += 1  # superseded, discarded or never announced
            newest = max(self.serving, self._verified, self._refused, self.receiving)
            if c.version > newest:  # its announce was lost (reconnect): ask for a restart
                self._nack(c.version, "chunk of a version never announced")
            return None
        a, why = t.ann, ""
        want = min(a.chunk_bytes, a.total_bytes - c.index * a.chunk_bytes)
        if c.index >= a.num_chunks:
            why = f"chunk index {c.index} >= num_chunks {a.num_chunks}"
        elif c.offset != c.index * a.chunk_bytes or len(c.data) != want:
            why = f"chunk {c.index}: offset {c.offset} / {len(c.data)} bytes, expected {want}"
        elif zlib.crc32(c.data) != c.crc32:
            why = f"chunk {c.index}: crc32 mismatch"
        if why:
            self._t = None
            self._nack(a.version, why)
            return None
        if t.have[c.index]:
            self.counts["duplicate"] += 1
            return None
        t.buf[c.offset : c.offset + len(c.data)] = c.data
        t.have[c.index] = 1
        t.count += 1
        if t.check is not None and (bad := t.check.chunk_in(c.index, t.buf)):
            if why := self._refetch(t, bad):
                self._t = None
                self._nack(a.version, why)
            return None
        return self._finish() if t.count == a.num_chunks else None

    def _finish(self) -> VerifiedWeights | None:
        t = self._t
        assert t is not None
        self._t = None
        a = t.ann
        try:
            if t.check is not None:  # every piece was hashed as it came in: no second pass
                check_digest(a, t.check.digest())
                ready = VerifiedWeights(a, t.buf)  # decodes the metadata (sizes x dtypes)
            else:
                ready = VerifiedWeights.of_blob(a, t.buf)  # the flat kind: all bytes at the end
        except WeightsRefused as e:
            self._nack(a.version, f"{e}")
            return None
        self._verified = t.ann.version
        self.counts["verified"] += 1
        return ready


__all__ = ["GeneratorSide", "Receiver", "WeightReceiver"]
