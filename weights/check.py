"""Where a received weight set's digest is checked against its announce, in one file, and the
one error of a refused set.

The digest itself is weights.digest (docs/CONTRACTS.md 6). It is checked here:

- ``PieceCheck``: a ZeroMQ chunk stream (weights.receiver.WeightReceiver), tree kind: the
  announced per-piece leaves must hash to the announced digest; then each piece is hashed
  once, as soon as its bytes are in, against its leaf; a piece that differs is named (index,
  bytes, tensors) and re-fetched alone;
- ``check_blob``: a whole received blob (the collective receive, a /dev/shm copy, a flat-kind
  chunk stream at its end): the pieces hashed in parallel, the bad ones named;
- ``check_digest``: a digest computed elsewhere (a /dev/shm copy read piece by piece,
  weights.shm.read_checked) against the announce.

A directory the engine reads itself is checked by ``weights.verified.VerifiedWeights.state``
(its tensors hashed with the announced kind). Every refusal is a ``WeightsRefused`` whose
message says what was wrong.
"""

from __future__ import annotations

from typing import Any

from proto.records import WeightAnnounce
from weights.digest import (
    TREE,
    Digest,
    blob_head,
    check_kind,
    chunk_sha256,
    num_chunks,
    tree_of,
    weights_digest,
)


class WeightsRefused(ValueError):
    """This weight set is refused: its digest, its bytes (torn, short), its metadata or its
    version is not what it must be; the message names what was wrong. Every receiver's check
    raises it (the receiver Nacks the version with the message), and so do
    ``VerifiedWeights.state``, an engine's version check (the engine keeps serving the
    version it had) and the publisher, for a version it cannot announce."""


def check_blob(announce: WeightAnnounce, blob: Any) -> None:
    """None when ``blob``'s digest (kind ``announce.digest_kind``) matches the announce;
    WeightsRefused saying why otherwise: its size, bad metadata, every piece (and its
    tensors) whose sha256 differs from its announced leaf, or the digest. A tree digest's
    pieces are hashed in parallel."""
    a = announce
    try:  # an unknown kind, a blob of another size, metadata that does not fit the blob
        kind = check_kind(a.digest_kind, a.digest_chunk_bytes)
        if len(blob) != a.total_bytes:
            raise ValueError(f"{len(blob)} bytes received, {a.total_bytes} announced")
        got = weights_digest(blob, a.tensors, kind, a.digest_chunk_bytes)
    except ValueError as e:
        raise WeightsRefused(str(e)) from None
    check_digest(a, got)


def check_digest(announce: WeightAnnounce, got: Digest) -> None:
    """WeightsRefused unless ``got`` is the announced digest: first the pieces whose leaves
    differ from the announced ones (named with their tensors), then the digest itself."""
    a = announce
    if got.kind == TREE and a.chunk_digests:
        bad = [j for j, h in enumerate(got.chunks) if h != a.chunk_digests[j]]
        if bad:
            where = [f"{j} ({tensors_of(a, j)[:3]})" for j in bad[:8]]
            raise WeightsRefused(f"pieces {', '.join(where)} do not match their digests")
    if got.hex != a.digest:
        raise WeightsRefused(f"digest {got.hex} != announced {a.digest}")


def tensors_of(a: WeightAnnounce, piece: int) -> list[str]:
    """The tensors whose bytes lie (partly) in digest piece ``piece``."""
    lo, hi = piece * a.digest_chunk_bytes, (piece + 1) * a.digest_chunk_bytes
    return [m.name for m in a.tensors if m.offset < hi and m.offset + m.nbytes > lo]


class PieceCheck:
    """A tree-digest chunk stream checked piece by piece as it fills its buffer (one transfer).

    Loop (the receiver's): ``PieceCheck(ann)`` (WeightsRefused: the announced leaves do not
    hash to the digest, or bad metadata); per chunk stored, ``chunk_in(i, buf)`` returns the
    pieces it completed that do not match their leaves (the receiver drops and re-fetches
    their chunks, telling ``chunk_out``); once every chunk is in, ``digest()`` is the tree of
    the checked leaves. Invariant: each byte is hashed once per time it arrives."""

    def __init__(self, ann: WeightAnnounce) -> None:
        self.ann, a = ann, ann
        try:
            self.head = blob_head(a.total_bytes, a.tensors)
        except ValueError as e:  # tensors out of sorted-name order
            raise WeightsRefused(str(e)) from None
        if a.chunk_digests:
            leaves = [bytes.fromhex(h) for h in a.chunk_digests]
            if tree_of(self.head, leaves, a.digest_chunk_bytes, a.total_bytes).hex != a.digest:
                raise WeightsRefused(
                    "the announced chunk_digests do not hash to the announced digest"
                )
        n = num_chunks(a.total_bytes, a.digest_chunk_bytes)
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

    def digest(self) -> Digest:
        """The tree digest of the checked leaves (every piece must be in)."""
        if not all(x is not None for x in self.leaves):
            raise WeightsRefused("a piece was not checked")
        leaves = [x for x in self.leaves if x is not None]
        return tree_of(self.head, leaves, self.ann.digest_chunk_bytes, self.ann.total_bytes)


__all__ = ["PieceCheck", "WeightsRefused", "check_blob", "check_digest", "tensors_of"]
