"""The learner's end of the weights channel: ``WeightPublisher``, every transport's publisher.

It announces each version to every generator (``WeightAnnounce``: version, digest, tensor
metadata, the directory) and keeps, per generator, the version it serves and the transfer
under way, from its Acks and Nacks. What follows the announce is the transport's
(weights.transports): nothing for shared_fs (the directory is read where the generator is) and
shm (``weights.shm.ShmPublisher``: a /dev/shm copy beside the directory); the blob in chunks
for zmq, here (the generator's end: weights.receiver); a broadcast for collective
(weights.collective.learner, a subclass, with the chunks as its fallback).

Loop, on the coordinator's thread::

    pub = WeightPublisher(endpoint, chunk_bytes=..., window=...)   # or transports.open_publisher
    pub.add_generator(gid, serving_version)   # on Hello: a late joiner gets the current version
    pub.publish(publication)                  # new weights (strictly increasing versions)
    pub.handle(peer, record)                  # every Ack/Nack from the weights channel
    pub.observe(gid, heartbeat.weight_version)   # what the generator says it serves
    pub.remove_generator(gid)                 # on Goodbye / death
    pub.pump()                                # after each of the above and every loop turn

Flow control (zmq): per generator at most ``window`` chunks are sent and not yet credited;
the receiver returns one credit, ``Ack(kind="chunk", ref="<version>/<index>")``, for every
chunk frame it takes off the wire, whatever it does with it. So the learner never holds more
than window x chunk_bytes queued per generator, however slow that generator is (ZMQ SNDHWM is
only a backstop). A transfer whose credits stop coming for ``stall_timeout_s`` (frames lost on
a reconnect) restarts from the announce; chunks the receiver already holds are ignored. A
piece whose digest did not match comes back as ``Nack(kind="chunk", ref="<version>/<chunk
index>")`` for each chunk it spans, and those chunks are sent again.

Invariants: versions are announced in strictly increasing order and only the newest is ever
sent; a refused transfer, ``Nack(kind="weights")``, is started again for that generator after
``retry_delay_s``, then twice that, ... (at most ``max_attempts`` transfers, then it gives up and
counts it; the transports' publishers wait RETRY_DELAY_S).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from proto.records import Ack, Nack, TensorMeta, WeightAnnounce, WeightChunk
from weights.check import WeightsRefused
from weights.digest import FLAT, TREE, Digest, check_kind, num_chunks, weights_digest
from weights.publication import Publication

log = logging.getLogger(__name__)


class LearnerSide(Protocol):
    """The learner's endpoint as a publisher sends through it (pipeline.net.transport)."""

    def send(self, peer: str, record: Any, *, channel: Any = ...) -> bool: ...


class PublishSettings(Protocol):
    """What the publishers read of the run's publish settings (pipeline's PublishSection)."""

    @property
    def chunk_bytes(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def keep(self) -> int: ...
    @property
    def max_pending(self) -> int: ...
    @property
    def collective_host(self) -> str: ...
    @property
    def collective_port(self) -> int: ...
    @property
    def collective_backend(self) -> str: ...
    @property
    def collective_timeout_s(self) -> float: ...
    @property
    def collective_chunk_bytes(self) -> int: ...
    @property
    def directories(self) -> str: ...


@dataclass
class _Gen:
    serving: int = -1  # version the generator acknowledged (verified and loaded)
    sending: int = -1  # version being transferred, -1 none
    next_chunk: int = -1  # next chunk index to send; -1: the announce is not out yet
    outstanding: int = 0  # chunks sent whose credit has not come back
    resend: list[int] = field(default_factory=list)  # chunk indices a receiver asked again for
    attempts: int = 0  # transfers of ``sending`` started
    progress_at: float = 0.0  # clock time of the last send or credit
    not_before: float = 0.0  # clock time before which a refused transfer is not started again


class WeightPublisher:
    """Learner side; see the module docstring for the loop and the invariants. ``chunked``
    False (shared_fs, shm): the announce alone travels, naming the directory."""

    def __init__(
        self,
        endpoint: LearnerSide,
        *,
        chunk_bytes: int = 16 << 20,
        window: int = 4,
        max_attempts: int = 3,
        stall_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        chunked: bool = True,
        retry_delay_s: float = 0.0,
    ) -> None:
        if chunk_bytes < 1 or window < 1 or max_attempts < 1 or stall_timeout_s <= 0:
            raise ValueError("chunk_bytes, window, max_attempts, stall_timeout_s must be > 0")
        self.endpoint, self.chunked = endpoint, chunked
        self.chunk_bytes, self.window, self.max_attempts = chunk_bytes, window, max_attempts
        self.stall_timeout_s = stall_timeout_s
        self.retry_delay_s = retry_delay_s
        """A refused transfer starts again after retry_delay_s, then twice that, ... (a
        generator that cannot take a version now, out of memory beside the learner, gets time)."""
        self.clock = clock
        self.announce: WeightAnnounce | None = None
        self._blob: bytes | memoryview = b""
        self._gens: dict[str, _Gen] = {}
        self.external: set[str] = set()
        """Generators whose transfers another transport carries (weights.collective.learner):
        their state is kept here (versions, Acks, Nacks), but ``pump`` sends them nothing."""
        self.counts: Counter[str] = Counter()

    @property
    def version(self) -> int:
        return -1 if self.announce is None else self.announce.version

    def prepare(self, pub: Publication) -> Publication:
        """What the transport does with a version before it is announced, on the thread that
        finished it (weights.pending, beside the next step): nothing here but letting go of
        the snapshot's device copy (shm: its /dev/shm copy, weights.shm.ShmPublisher;
        cuda_ipc: the device buffer, weights.cuda_ipc)."""
        pub.device_state.clear()
        return pub

    def publish(self, pub: Publication) -> WeightAnnounce:
        """Announce ``pub`` (its directory written) and start sending it: its digest as it
        is (``Publication.digests``, not computed again)."""
        path = "" if pub.path is None else str(Path(pub.path).resolve())
        return self.publish_blob(pub.version, pub.blob, tensors=pub.tensor_metas(),
                                 config_json=pub.config_json, path=path, digest=pub.digests,
                                 adapter=pub.adapter)  # fmt: skip

    def publish_blob(
        self,
        version: int,
        blob: bytes | memoryview,
        *,
        tensors: Sequence[TensorMeta] = (),
        config_json: str = "",
        path: str = "",
        digest: Digest | str | None = None,
        adapter: Mapping[str, Any] | None = None,
    ) -> WeightAnnounce:
        """Make ``blob`` (canonical tensor bytes) version ``version`` and start sending it.

        ``digest``: what the caller computed (trusted, not computed again; a bare string is a
        flat-kind digest); None: computed here from the blob (the tree kind for tensors, the
        flat sha256 of an opaque test payload). ``adapter``: the announce's adapter field
        (weights.adapters; a directory announce only). Not ``chunked``: only the announce travels,
        with ``path`` (required) and the digest (required); the generator's engine loads the
        directory and checks that digest. WeightsRefused for a version not newer than the
        last, or a set that cannot be announced (no path or digest, an unknown digest kind)."""
        chunked = self.chunked
        if version <= self.version:
            raise WeightsRefused(f"version {version} is not newer than {self.version}")
        if not chunked and (not path or digest is None):
            raise WeightsRefused("an on-disk publication needs its path and canonical digest")
        try:
            if digest is None:
                kind = TREE if tensors else FLAT
                digest = weights_digest(blob, tensors, kind, self.chunk_bytes)
            elif isinstance(digest, str):
                digest = Digest(digest)
            check_kind(digest.kind, digest.chunk_bytes)
        except ValueError as e:
            raise WeightsRefused(f"weight set v{version}: {e}") from e
        n = len(blob)
        ann = WeightAnnounce(
            version=version,
            digest=digest.hex,
            total_bytes=n,
            chunk_bytes=self.chunk_bytes if chunked else 0,
            num_chunks=num_chunks(n, self.chunk_bytes) if chunked else 0,
            tensors=list(tensors),
            path=path,
            config_json=config_json,
            created_at=time.time(),
            digest_kind=digest.kind,
            digest_chunk_bytes=digest.chunk_bytes,
            chunk_digests=list(digest.chunks),
            adapter=dict(adapter or {}),
        )
        ann.validate()
        # a read-only blob (bytes, or weights.digest.blob_and_meta's view) is kept as
        # it is; a writable one is copied (its owner may reuse it)
        keep = (
            blob
            if isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly)
            else bytes(blob)
        )
        return self.publish_announce(ann, keep if chunked else b"")

    def publish_announce(
        self, ann: WeightAnnounce, blob: bytes | memoryview = b""
    ) -> WeightAnnounce:
        """Make the validated ``ann`` current (``blob``: what its chunks are cut from, when
        ``chunked``) and start it towards every generator that serves an older version.
        WeightsRefused for a version not newer than the last."""
        if ann.version <= self.version:
            raise WeightsRefused(f"version {ann.version} is not newer than {self.version}")
        self.announce, self._blob = ann, blob
        for g in self._gens.values():
            if g.serving < ann.version:
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
                if now < g.not_before:  # a refused transfer, waiting to start again
                    continue
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
        """Release what the transport holds (nothing for ZeroMQ chunks); after the last
        version was announced."""

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
                    g.not_before = g.progress_at + self.retry_delay_s * 2 ** (g.attempts - 2)
                    self.counts["retries"] += 1
        else:
            return False
        return True


RETRY_DELAY_S = 1.0
"""The transports' wait before a refused version is announced again (1 s, then 2 s: a generator
that could not take it, for want of memory beside the learner, gets 3 s before it is given up)."""


def shared_fs_publisher(
    endpoint: LearnerSide, settings: PublishSettings, run_dir: Path
) -> WeightPublisher:
    """publish.transport=shared_fs: the announce of RUN_DIR/weights/vN alone (every host
    reads the directory; weights.transports)."""
    return WeightPublisher(endpoint, chunk_bytes=settings.chunk_bytes, window=settings.window,
                           chunked=False, retry_delay_s=RETRY_DELAY_S)  # fmt: skip


def zmq_publisher(
    endpoint: LearnerSide, settings: PublishSettings, run_dir: Path
) -> WeightPublisher:
    """publish.transport=zmq: the announce, then the blob in credit-windowed chunks."""
    return WeightPublisher(endpoint, chunk_bytes=settings.chunk_bytes, window=settings.window,
                           retry_delay_s=RETRY_DELAY_S)  # fmt: skip


__all__ = [
    "LearnerSide",
    "PublishSettings",
    "RETRY_DELAY_S",
    "WeightPublisher",
    "shared_fs_publisher",
    "zmq_publisher",
]
