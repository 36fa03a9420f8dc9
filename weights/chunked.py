"""Weight push over ZeroMQ chunks (publish.transport=zmq; shared_fs sends the announce alone).

Learner -> generators: announce + chunks, credit flow control, the digest checked per piece.

Learner side (``WeightPublisher``), on the coordinator's loop::

    pub = WeightPublisher(endpoint, chunk_bytes=..., window=...)
    pub.add_generator(gid, serving_version)   # on Hello: a late joiner gets the current version
    pub.publish(version, blob)                # new weights (strictly increasing versions)
    pub.handle(peer, record)                  # every Ack/Nack from the weights channel
    pub.observe(gid, heartbeat.weight_version)   # what the generator says it serves
    pub.remove_generator(gid)                 # on Goodbye / death
    pub.pump()                                # after each of the above and every loop turn

Generator side (``WeightReceiver``)::

    rx = WeightReceiver(conn)
    ready = rx.handle(record)                 # every record from the weights channel
    if ready: engine.load_weights(ready, ...); rx.loaded(ready.version)   # -> Ack(kind="weights")

Flow control: per generator at most ``window`` chunks are sent and not yet credited; the
receiver returns one credit, ``Ack(kind="chunk", ref="<version>/<index>")``, for every chunk
frame it takes off the wire, whatever it does with it. So the learner never holds more than
window x chunk_bytes queued per generator, however slow that generator is (ZMQ SNDHWM is only
a backstop). A transfer whose credits stop coming for ``stall_timeout_s`` (frames lost on a
reconnect) restarts from the announce; chunks the receiver already holds are ignored.

Digest check (the one place a received chunk stream is checked; weights.digest):
a tree-digest announce (digest_kind "sha256-tree") carries the sha256 of every
``digest_chunk_bytes`` piece; the receiver first checks that those leaves hash to the
announced digest, then hashes each piece once, as soon as its bytes are in, against its leaf.
A piece that does not match is named in the log and in ``Nack(kind="chunk",
ref="<version>/<chunk index>")`` for each WeightChunk it spans, on which the publisher sends
those chunks again (at most ``max_refetch`` times per piece, then the whole transfer is
refused). The set is handed out as ``VerifiedWeights`` once every piece matched: the bytes
were hashed once, and nobody hashes them again. A flat-digest announce (digest_kind "" or
"sha256": runs before the tree, opaque test payloads) is checked over the whole blob at the end.

Invariants: the receiver hands out a blob only after its digest equals the announced digest,
so a generator never serves weights that do not match; a chunk with a bad crc32, index,
offset or size, or a flat digest mismatch, discards the transfer and sends
``Nack(kind="weights")``, on which the publisher resends that version to that generator (at
most ``max_attempts`` transfers, then it gives up and counts it). Duplicate and out-of-order
chunks are harmless (a chunk of a version never announced, its announce lost on a
reconnect, is answered by a Nack, so the publisher restarts); a newer announce supersedes
an incomplete older transfer; the publisher only ever sends the newest version.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proto.records import Ack, ErrorMsg, Nack, TensorMeta, WeightAnnounce, WeightChunk
from weights.digest import FLAT, TREE, Digest, check_kind, weights_digest
from weights.verified import OnDisk, PieceCheck, VerifiedWeights, tensors_of, verify_blob

log = logging.getLogger(__name__)


class WeightSyncError(ValueError):
    """Bad publisher / receiver settings or use."""


class _LearnerSide(Protocol):
    def send(self, peer: str, record: Any, *, channel: Any = ...) -> bool: ...


class _GeneratorSide(Protocol):
    def send(self, record: Any, *, channel: Any = ...) -> bool: ...


@dataclass
class _Gen:
    serving: int = -1  # version the generator acknowledged (verified and loaded)
    sending: int = -1  # version being transferred, -1 none
    next_chunk: int = -1  # next chunk index to send; -1: the announce is not out yet
    outstanding: int = 0  # chunks sent whose credit has not come back
    resend: list[int] = field(default_factory=list)  # chunk indices a receiver asked again for
    attempts: int = 0  # transfers of ``sending`` started
    progress_at: float = 0.0  # clock time of the last send or credit


class WeightPublisher:
    """Learner side; see the module docstring for the loop and the invariants."""

    def __init__(
        self,
        endpoint: _LearnerSide,
        *,
        chunk_bytes: int = 16 << 20,
        window: int = 4,
        max_attempts: int = 3,
        stall_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if chunk_bytes < 1 or window < 1 or max_attempts < 1 or stall_timeout_s <= 0:
            raise WeightSyncError("chunk_bytes, window, max_attempts, stall_timeout_s must be > 0")
        self.endpoint = endpoint
        self.chunk_bytes, self.window, self.max_attempts = chunk_bytes, window, max_attempts
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.announce: WeightAnnounce | None = None
        self._blob: bytes | memoryview = b""
        self._gens: dict[str, _Gen] = {}
        self.external: set[str] = set()
        """Generators whose transfers another transport carries (weights.collective_learner):
        their state is kept here (versions, Acks, Nacks), but ``pump`` sends them nothing."""
        self.counts: Counter[str] = Counter()

    @property
    def version(self) -> int:
        return -1 if self.announce is None else self.announce.version

    def publish(
        self,
        version: int,
        blob: bytes | memoryview,
        *,
        tensors: Sequence[TensorMeta] = (),
        config_json: str = "",
        path: str = "",
        digest: Digest | str | None = None,
        chunked: bool = True,
    ) -> WeightAnnounce:
        """Make ``blob`` (canonical tensor bytes) version ``version`` and start sending it.

        ``digest``: what the caller computed (weights.publication's ``Publication.digests``;
        trusted, not computed again; a bare string is a flat-kind digest); None: computed here
        from the blob (the tree kind for tensors, the flat sha256 of an opaque test payload).
        ``chunked=False`` (publish transport "shared_fs"): only the announce travels, with
        ``path`` (required) and the digest (required); the generator's engine loads the
        directory and checks that digest."""
        if version <= self.version:
            raise WeightSyncError(f"version {version} is not newer than {self.version}")
        if not chunked and (not path or digest is None):
            raise WeightSyncError("an on-disk publication needs its path and canonical digest")
        try:
            if digest is None:
                kind = TREE if tensors else FLAT
                digest = weights_digest(blob, tensors, kind, self.chunk_bytes)
            elif isinstance(digest, str):
                digest = Digest(digest)
            check_kind(digest.kind, digest.chunk_bytes)
        except ValueError as e:
            raise WeightSyncError(f"weight set v{version}: {e}") from e
        n = len(blob)
        ann = WeightAnnounce(
            version=version,
            digest=digest.hex,
            total_bytes=n,
            chunk_bytes=self.chunk_bytes if chunked else 0,
            num_chunks=-(-n // self.chunk_bytes) if chunked else 0,
            tensors=list(tensors),
            path=path,
            config_json=config_json,
            created_at=time.time(),
            digest_kind=digest.kind,
            digest_chunk_bytes=digest.chunk_bytes,
            chunk_digests=list(digest.chunks),
        )
        ann.validate()
        # a read-only blob (bytes, or weights.digest.blob_and_meta's view) is kept as
        # it is; a writable one is copied (its owner may reuse it)
        keep = (
            blob
            if isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly)
            else bytes(blob)
        )
        self.announce, self._blob = ann, keep if chunked else b""
        for g in self._gens.values():
            if g.serving < version:
                self._start(g)
        self.counts["published"] += 1
        return ann

    def add_generator(self, gid: str, serving_version: int = -1) -> None:
        """A generator (re)connected serving ``serving_version``; its old transfer state is void."""
        g = self._gens[gid] = _Gen(serving=serving_version)
        if self.announce is not None and serving_version < self.version:
            self._start(g)

    def remove_generator(self, gid: str) -> None:
        self._gens.pop(gid, None)
        self.external.discard(gid)

    def observe(self, gid: str, serving_version: int) -> None:
        """A Heartbeat says ``gid`` serves ``serving_version`` (covers a lost final Ack)."""
        g = self._gens.get(gid)
        if g is not None and serving_version > g.serving:
            g.serving = serving_version
            if serving_version >= g.sending:
                g.sending = -1

    def serving(self, gid: str) -> int:
        return self._gens[gid].serving

    def generators(self) -> dict[str, int]:
        """Generator id -> version it acknowledged serving."""
        return {k: g.serving for k, g in self._gens.items()}

    def target(self, gid: str) -> int:
        """The version ``gid`` will serve once the transfer in progress (if any) is loaded."""
        g = self._gens.get(gid)
        return -1 if g is None else max(g.serving, g.sending)

    def gave_up(self, gid: str) -> bool:
        """True when ``gid`` lags the current version and no transfer to it is running."""
        g = self._gens[gid]
        return g.serving < self.version and g.sending != self.version

    def _start(self, g: _Gen) -> None:
        if g.sending != self.version:
            g.attempts = 0
        g.sending, g.next_chunk, g.attempts = self.version, -1, g.attempts + 1
        g.resend.clear()
        g.progress_at = self.clock()

    def _chunk(self, i: int) -> WeightChunk:
        assert self.announce is not None
        off = i * self.chunk_bytes
        data = bytes(self._blob[off : off + self.chunk_bytes])
        return WeightChunk(self.announce.version, i, off, data, zlib.crc32(data))

    def pump(self) -> int:
        """Send what the credit windows allow; returns the number of frames sent."""
        ann, sent, now = self.announce, 0, self.clock()
        if ann is None:
            return 0
        for gid, g in self._gens.items():
            if g.sending != ann.version or gid in self.external:
                continue
            if g.outstanding and now - g.progress_at > self.stall_timeout_s:
                log.warning("weights v%d to %s stalled; restarting the transfer", g.sending, gid)
                self.counts["stalled"] += 1
                g.outstanding, g.next_chunk = 0, -1
            if g.next_chunk < 0:
                if not self.endpoint.send(gid, ann, channel="weights"):
                    continue
                g.next_chunk, g.progress_at, sent = 0, now, sent + 1
            while g.resend and g.next_chunk >= 0 and g.outstanding < self.window:
                if not self.endpoint.send(gid, self._chunk(g.resend[0]), channel="weights"):
                    break
                g.resend.pop(0)
                g.outstanding += 1
                g.progress_at, sent = now, sent + 1
                self.counts["chunks_resent"] += 1
            while g.next_chunk < ann.num_chunks and g.outstanding < self.window:
                if not self.endpoint.send(gid, self._chunk(g.next_chunk), channel="weights"):
                    break
                g.next_chunk += 1
                g.outstanding += 1
                g.progress_at, sent = now, sent + 1
        self.counts["frames"] += sent
        return sent

    def close(self) -> None:
        """Release what the transport holds (nothing for ZeroMQ chunks)."""

    def handle(self, peer: str, rec: Any) -> bool:
        """Consume an Ack/Nack from the weights channel; False if it is not ours."""
        g = self._gens.get(peer)
        if g is None or not isinstance(rec, Ack | Nack):
            return False
        if isinstance(rec, Ack) and rec.kind == "chunk":
            g.outstanding = max(0, g.outstanding - 1)
            g.progress_at = self.clock()
        elif isinstance(rec, Ack) and rec.kind == "weights":
            g.serving = max(g.serving, rec.version)
            if rec.version >= g.sending:
                g.sending = -1
            self.counts["acked"] += 1
        elif isinstance(rec, Nack) and rec.kind == "chunk":
            v, _, idx = rec.ref.partition("/")
            if rec.version == g.sending == self.version and idx.isdigit():
                i = int(idx)
                if self.announce is not None and i < self.announce.num_chunks and i not in g.resend:
                    g.resend.append(i)  # a piece whose digest did not match: send it again
        elif isinstance(rec, Nack) and rec.kind == "weights":
            self.counts["nacked"] += 1
            log.warning("generator %s refused weights v%d: %s", peer, rec.version, rec.reason)
            if rec.version == g.sending == self.version:
                if g.attempts >= self.max_attempts:
                    log.error("giving up weights v%d for %s", rec.version, peer)
                    g.sending = -1
                    self.counts["gave_up"] += 1
                else:
                    self._start(g)
                    self.counts["retries"] += 1
        else:
            return False
        return True


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
        conn: _GeneratorSide,
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

    def handle(self, rec: Any) -> VerifiedWeights | OnDisk | None:
        """Feed one record from the weights channel; returns weights ready to load (an
        ``OnDisk`` announce is not checked here: the engine checks the files it reads)."""
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

    def _announce(self, a: WeightAnnounce) -> VerifiedWeights | OnDisk | None:
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
        if a.num_chunks == 0 and a.total_bytes:  # published on disk only: nothing to assemble
            if not a.path:
                self._nack(v, "announce with neither chunks nor a path")
                return None
            self._verified = v
            self.counts["on_disk"] += 1
            return OnDisk(a)  # the engine checks the digest of the files it reads
        t = _Transfer(a, bytearray(a.total_bytes), bytearray(a.num_chunks))
        if a.digest_kind == TREE:
            try:
                t.check = PieceCheck(a)
            except ValueError as e:
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

    def _chunk(self, c: WeightChunk) -> VerifiedWeights | OnDisk | None:
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
                if t.check.digest() != a.digest:
                    raise ValueError(f"digest {t.check.digest()} != announced {a.digest}")
                ready = VerifiedWeights(a, t.buf)  # decodes the metadata (sizes x dtypes)
            else:
                ready = verify_blob(a, t.buf)  # the flat kind: all bytes at the end
        except ValueError as e:
            self._nack(a.version, f"{e}")
            return None
        self._verified = t.ann.version
        self.counts["verified"] += 1
        return ready
