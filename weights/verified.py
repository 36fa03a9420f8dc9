"""The weight digest check, in one file: what a receiver hands the engine, and how it checked it.

Where a weight set's digest (weights.digest, docs/CONTRACTS.md 6) is checked:

- ``PieceCheck``: a ZeroMQ chunk stream (weights.chunked.WeightReceiver), tree kind:
  the announced per-piece leaves must hash to the announced digest; then each piece is hashed
  once, as soon as its bytes are in, against its leaf; a piece that differs is named (index,
  bytes, tensors) and re-fetched alone;
- ``verify_blob``: a whole received blob (the collective receive; a flat-kind chunk stream at
  its end): the pieces hashed in parallel, the bad ones named;
- ``weights.reading.read_weights``: what the engine reads itself (an ``OnDisk``
  directory, from this host's checked /dev/shm copy first; a plain mapping or path), built
  on this module and weights.shm.

``VerifiedWeights`` is the one "verified weights" type of the weight path: {name: tensor}
views of a blob (decoded by ``weights.digest.state_from_blob``, no copy) whose digest a
receiver checked against ``announce``; only ``PieceCheck``'s receiver and ``verify_blob``
build one. ``WeightSink`` is what the generator loop needs from a receiver (generator.loop); the
loop calls ``handle`` for every record of the weights channel, then ``loaded`` or ``load_failed``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from proto.records import WeightAnnounce
from weights.digest import (
    TREE,
    blob_head,
    check_kind,
    chunk_sha256,
    state_from_blob,
    tree_root,
    weights_digest,
)


class _Announced:
    """A weight set's version and digest, read from the announce it carries."""

    announce: WeightAnnounce

    @property
    def version(self) -> int:
        return self.announce.version

    @property
    def digest(self) -> str:
        return self.announce.digest


class VerifiedWeights(_Announced, dict):  # type: ignore[type-arg]
    """{name: tensor} views of ``blob`` whose digest matched ``announce`` (the caller owns
    ``blob``; an opaque blob, with no tensor metadata, maps no names)."""

    def __init__(self, announce: WeightAnnounce, blob: bytearray) -> None:
        tensors = announce.tensors
        super().__init__(
            state_from_blob(blob, tensors, verify=False, copy=False) if tensors else {}
        )
        self.announce, self.blob = announce, blob


class OnDisk(_Announced, str):
    """Weights announced as a directory (no chunks; publish.transport shared_fs): the path
    itself (a str, what a loader opens) carrying its ``announce``. Not checked by any
    receiver: the engine loads the directory and checks its digest (kind
    ``announce.digest_kind``) on what it read."""

    announce: WeightAnnounce
    local_copy: bool
    """Whether a reader may take this host's /dev/shm copy of it (weights.shm) instead
    of the directory; False after that copy was refused (``directory_only``)."""

    def __new__(cls, announce: WeightAnnounce, local_copy: bool = True) -> OnDisk:
        obj = super().__new__(cls, announce.path)
        obj.announce, obj.local_copy = announce, local_copy
        return obj

    def directory_only(self) -> OnDisk:
        """The same announce, read from its directory alone."""
        return OnDisk(self.announce, local_copy=False)

    @property
    def blob(self) -> bytearray:
        """No bytes travel with an on-disk set."""
        return bytearray()


class WeightSink(Protocol):
    """A receiver of weight records (chunked.WeightReceiver, collective_generator's sink);
    replies (credits, Acks, Nacks) go out through its own connection."""

    def handle(self, rec: Any) -> VerifiedWeights | OnDisk | None: ...
    def loaded(self, version: int) -> None: ...
    def load_failed(self, version: int, reason: str) -> None: ...


def verify_blob(announce: WeightAnnounce, blob: bytearray) -> VerifiedWeights:
    """``blob`` as VerifiedWeights once its digest (kind ``announce.digest_kind``) matches the
    announce; ValueError saying why otherwise, naming every piece (and its tensors) whose
    sha256 differs from its announced leaf. A tree digest's pieces are hashed in parallel."""
    check_blob(announce, blob)
    return VerifiedWeights(announce, blob)


def check_blob(announce: WeightAnnounce, blob: Any) -> None:
    """``verify_blob``'s check alone (no views made): None when ``blob``'s digest matches the
    announce, else ValueError naming the pieces that differ."""
    a = announce
    kind = check_kind(a.digest_kind, a.digest_chunk_bytes)
    if len(blob) != a.total_bytes:
        raise ValueError(f"{len(blob)} bytes received, {a.total_bytes} announced")
    got = weights_digest(blob, a.tensors, kind, a.digest_chunk_bytes)
    if kind == TREE and a.chunk_digests:
        bad = [j for j, h in enumerate(got.chunks) if h != a.chunk_digests[j]]
        if bad:
            where = [f"{j} ({tensors_of(a, j)[:3]})" for j in bad[:8]]
            raise ValueError(f"pieces {', '.join(where)} do not match their digests")
    if got.hex != a.digest:
        raise ValueError(f"digest {got.hex} != announced {a.digest}")


def tensors_of(a: WeightAnnounce, piece: int) -> list[str]:
    """The tensors whose bytes lie (partly) in digest piece ``piece``."""
    lo, hi = piece * a.digest_chunk_bytes, (piece + 1) * a.digest_chunk_bytes
    return [m.name for m in a.tensors if m.offset < hi and m.offset + m.nbytes > lo]


class PieceCheck:
    """A tree-digest chunk stream checked piece by piece as it fills its buffer (one transfer).

    Loop (the receiver's): ``PieceCheck(ann)`` (ValueError: the announced leaves do not hash
    to the digest, or bad metadata); per chunk stored, ``chunk_in(i, buf)`` returns the
    pieces it completed that do not match their leaves (the receiver drops and re-fetches
    their chunks, telling ``chunk_out``); once every chunk is in, ``digest()`` is the root of
    the checked leaves. Invariant: each byte is hashed once per time it arrives."""

    def __init__(self, ann: WeightAnnounce) -> None:
        self.ann, a = ann, ann
        self.head = blob_head(a.total_bytes, a.tensors) if a.tensors else hashlib.sha256().digest()
        if a.chunk_digests:
            leaves = [bytes.fromhex(h) for h in a.chunk_digests]
            if tree_root(self.head, leaves, a.digest_chunk_bytes, a.total_bytes) != a.digest:
                raise ValueError("the announced chunk_digests do not hash to the announced digest")
        n = -(-a.total_bytes // a.digest_chunk_bytes)
        self.leaves: list[bytes | None] = [None] * n
        self.missing = [len(self.chunks_of(j)) for j in range(n)] if a.num_chunks else [0] * n
        self.refetched = [0] * n

    def pieces_of(self, index: int) -> range:
        """The digest pieces chunk ``index`` overlaps."""
        a, size = self.ann, self.ann.digest_chunk_bytes
        start = index * a.chunk_bytes
        end = min(start + a.chunk_bytes, a.total_bytes)
        return range(start // size, (end - 1) // size + 1)

    def chunks_of(self, piece: int) -> range:
        """The chunks digest piece ``piece`` spans."""
        a, size = self.ann, self.ann.digest_chunk_bytes
        start = piece * size
        end = min(start + size, a.total_bytes)
        return range(start // a.chunk_bytes, (end - 1) // a.chunk_bytes + 1)

    def chunk_in(self, index: int, buf: bytearray) -> list[int]:
        """Chunk ``index`` is in ``buf``: hash the pieces it completed; the ones that differ."""
        a, size, bad = self.ann, self.ann.digest_chunk_bytes, []
        for j in self.pieces_of(index):
            self.missing[j] -= 1
            if self.missing[j]:
                continue
            leaf = chunk_sha256(memoryview(buf)[j * size : min((j + 1) * size, a.total_bytes)])
            if not a.chunk_digests or leaf.hex() == a.chunk_digests[j]:
                self.leaves[j] = leaf
            else:
                self.refetched[j] += 1
                bad.append(j)
        return bad

    def chunk_out(self, index: int) -> None:
        """Chunk ``index`` was dropped (its piece failed): its pieces wait for it again."""
        for j in self.pieces_of(index):
            self.missing[j] += 1
            self.leaves[j] = None

    def digest(self) -> str:
        """The tree digest of the checked leaves (every piece must be in)."""
        if not all(x is not None for x in self.leaves):
            raise ValueError("a piece was not checked")
        leaves = [x for x in self.leaves if x is not None]
        return tree_root(self.head, leaves, self.ann.digest_chunk_bytes, self.ann.total_bytes)


__all__ = [
    "OnDisk",
    "check_blob",
    "PieceCheck",
    "VerifiedWeights",
    "WeightSink",
    "tensors_of",
    "verify_blob",
]
