"""The weight digest (docs/CONTRACTS.md 6), the weight blob layout and its one decoder.

Everyone who names a weight set by its digest uses this module: the learner's publication
(weights.publication), every receiver of this package (receiver.py, collective/generator.py)
and the generator's engine for the sets it reads itself. Nothing here looks at a model; a
weight set is a mapping {name: tensor} of HF-named tensors.

Canonical bytes of one tensor (`tensor_bytes`): the elements in row-major (C) order, each in
its dtype's little-endian machine representation, with no padding. bfloat16 (and float16)
elements are their raw 2-byte patterns (no conversion to fp32); bool is one byte (0 or 1).
A 0-d tensor has one element; an empty tensor has no bytes.

Header of one tensor: name (UTF-8) b"\\0", dtype name (str(dtype) without "torch.") b"\\0",
shape (decimal dims joined by ","; "" for 0-d, "0" for an empty [0]) b"\\0", byte length of its
canonical bytes as 8 bytes unsigned little-endian. Tensors are taken in ascending order of
name (Python `sorted`, i.e. by Unicode code point). The name, dtype and shape are part of
either digest: the same bytes under another name, dtype or shape give another digest.

Two digest kinds (the kind and chunk size are recorded with every version: the announce,
manifest.json, weights/digests.jsonl):

- "sha256-tree" (`TREE`, every new publication; `tree_digest`, `weights_digest`): the
  canonical bytes of all tensors concatenated in sorted-name order (exactly the blob below)
  are cut into ``chunk_bytes`` pieces (`DEFAULT_CHUNK_BYTES`, the last one shorter); leaf i =
  sha256(piece i); head = sha256(every header in order); digest = sha256 hex of
  b"looprl-weights-tree/1\\0" + chunk_bytes (8 bytes LE) + total bytes (8 bytes LE) + head +
  leaf 0 + leaf 1 + ... The leaves are hashed on a thread pool (`models.pool.hash_pool`: hashlib releases
  the GIL) and a receiver checks each piece against its announced leaf as it arrives.
- "sha256" (`FLAT`; absent or "" in a record means this kind: the runs recorded before the
  tree; `canonical_digest`, `digest_from_blob`): one sha256 over, per tensor in sorted order,
  its header then its canonical bytes. Still verified wherever a record names it.

Weight blob (`blob_and_meta`): the canonical bytes of every tensor, concatenated in sorted-name
order with no gaps, and one metadata dict per tensor with the fields of
`proto.records.TensorMeta` (name, dtype, shape, offset, nbytes, sha256 = sha256 hex of that
tensor's canonical bytes). `state_from_blob` is the one decoder of a blob (copies, or views for
a verified set: weights.verified). The flat digest is NOT sha256(blob) (the blob carries
no names, dtypes or shapes).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.pool import hash_pool

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FLAT",
    "KINDS",
    "TREE",
    "Digest",
    "blob_and_meta",
    "canonical_flat",
    "blob_layout",
    "blob_digest",
    "canonical_digest",
    "check_finite",
    "check_kind",
    "chunk_leaves",
    "digest_from_blob",
    "digest_of_state",
    "dtype_name",
    "meta_leaf",
    "num_chunks",
    "state_from_blob",
    "tensor_bytes",
    "tree_digest",
    "tree_of",
    "tree_root",
    "weights_digest",
    "with_sha256",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("weights.digest assumes a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """Dtype name as the digest writes it: str(dtype) without "torch." ("float32", ...)."""
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Canonical bytes of `t`: little-endian elements in row-major order, bf16 as raw bits."""
    view = _canonical_view(t)
    return b"" if view is None else bytes(view)


def _canonical_view(t: torch.Tensor) -> memoryview | None:
    """The canonical bytes of `t` as a read-only view of a CPU tensor's memory (no copy when
    `t` is already a contiguous CPU tensor); None for an empty tensor."""
    flat = canonical_flat(t.cpu() if isinstance(t, torch.Tensor) else t)
    return None if flat is None else memoryview(flat.numpy().data).toreadonly()


def _header(name: str, dtype: str, shape: Iterable[int], nbytes: int) -> bytes:
    dims = ",".join(str(int(d)) for d in shape)
    return (
        name.encode("utf-8")
        + b"\0"
        + dtype.encode("ascii")
        + b"\0"
        + dims.encode("ascii")
        + b"\0"
        + nbytes.to_bytes(8, "little")
    )


def canonical_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of a weight set's canonical bytes (layout: module docstring)."""

    def entries() -> Iterable[tuple[str, str, Sequence[int], memoryview]]:
        for name in sorted(state):
            t = state[name]
            raw = _canonical_view(t)  # hashed in place: a generator verifying GBs copies nothing
            yield name, dtype_name(t.dtype), t.shape, memoryview(b"") if raw is None else raw

    return _flat_digest(entries())


def _flat_digest(entries: Iterable[tuple[str, str, Sequence[int], memoryview]]) -> str:
    """The flat digest: sha256 hex over each (name, dtype, shape, canonical bytes) entry's
    header and bytes, in the given (sorted-name) order."""
    h = hashlib.sha256()
    for name, dtype, shape, raw in entries:
        h.update(_header(name, dtype, shape, len(raw)))
        h.update(raw)
    return h.hexdigest()


def check_finite(state: Mapping[str, torch.Tensor], where: str = "") -> None:
    """models.errors.NonFiniteWeightsError naming the first tensor (in sorted-name order)
    that holds NaN or inf; every publication passes this check (learner and pipeline)."""
    from models.errors import NonFiniteWeightsError

    for name in sorted(state):
        t = state[name]
        if t.is_floating_point() and t.numel():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise NonFiniteWeightsError(name, bad, t.numel(), where)


def blob_and_meta(state: Mapping[str, torch.Tensor]) -> tuple[memoryview, list[dict[str, Any]]]:
    """(blob, metadata): canonical bytes concatenated in sorted-name order, and per tensor
    {name, dtype, shape, offset, nbytes, sha256} (the fields of proto's TensorMeta).

    The blob is a read-only view of one host buffer each tensor's bytes are copied into at
    its offset (device tensors straight from the device, in the caller's CUDA stream: no
    host copy of the set first; host tensors on the thread pool); then every tensor's sha256
    on the thread pool. Each step releases the GIL (torch's copy, hashlib), so a publication
    built on a side thread leaves the trainer's Python thread running (a b"".join of 7 GB
    held it for seconds)."""
    layout = blob_layout(state)
    flats = [canonical_flat(state[m["name"]]) for m in layout]
    buf = torch.empty(sum(int(m["nbytes"]) for m in layout), dtype=torch.uint8)

    def fill(i: int) -> None:
        f, lo = flats[i], int(layout[i]["offset"])
        if f is not None:
            buf[lo : lo + int(f.numel())].copy_(f)

    on_host = [i for i, f in enumerate(flats) if f is not None and f.device.type == "cpu"]
    for i, f in enumerate(flats):  # device tensors in this thread (its stream), in order
        if f is not None and f.device.type != "cpu":
            fill(i)
    list(hash_pool().map(fill, on_host))
    view = memoryview(buf.numpy().data).toreadonly() if buf.numel() else memoryview(b"")
    return view, with_sha256(view, layout)


def blob_layout(state: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The canonical blob's layout of ``state`` without its bytes: per tensor, in sorted-name
    order, {name, dtype, shape, offset, nbytes} (``blob_and_meta``'s metadata less sha256;
    the tensors may live on a device)."""
    out, off = [], 0
    for name in sorted(state):
        t = state[name]
        n = int(t.numel()) * t.element_size()
        out.append({"name": name, "dtype": dtype_name(t.dtype), "shape": [int(d) for d in t.shape],
                    "offset": off, "nbytes": n})  # fmt: skip
        off += n
    return out


def with_sha256(blob: memoryview, layout: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``layout`` (``blob_layout``) with each tensor's sha256 over its bytes of ``blob``,
    hashed on the thread pool."""
    shas = hash_pool().map(
        lambda m: hashlib.sha256(
            blob[int(m["offset"]) : int(m["offset"]) + int(m["nbytes"])]
        ).hexdigest(),
        layout,
    )
    return [{**m, "sha256": sha} for m, sha in zip(layout, shas)]


def canonical_flat(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s canonical bytes as a flat uint8 tensor on its own device (a view when it is
    contiguous); None for an empty tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.is_complex():
        raise ValueError("canonical bytes are defined for dense real tensors only")
    flat = t.detach().resolve_neg().contiguous().reshape(-1)
    return None if flat.numel() == 0 else flat.view(torch.uint8)


def _get(m: Any, key: str) -> Any:
    """A field of a metadata entry: a dict or an object with attributes (TensorMeta)."""
    return m[key] if isinstance(m, Mapping) else getattr(m, key)


def _slices(
    blob: bytes | bytearray | memoryview, meta: Sequence[Any]
) -> Iterable[tuple[str, torch.dtype, list[int], memoryview, str]]:
    """Validated (name, dtype, shape, bytes, sha256) per metadata entry, in blob order."""
    view = memoryview(blob).cast("B")
    end = 0
    seen: set[str] = set()
    for m in meta:
        name, offset, nbytes = str(_get(m, "name")), int(_get(m, "offset")), int(_get(m, "nbytes"))
        dtype = _dtype_from_name(str(_get(m, "dtype")))
        shape = [int(d) for d in _get(m, "shape")]
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the metadata")
        seen.add(name)
        numel = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"tensor {name!r}: negative dimension in shape {shape}")
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise ValueError(
                f"tensor {name!r}: {nbytes} bytes, but shape {shape} of {dtype_name(dtype)} "
                f"needs {numel * dtype.itemsize}"
            )
        if offset != end:
            raise ValueError(f"tensor {name!r} at offset {offset}, expected {end}")
        end = offset + nbytes
        if end > len(view):
            raise ValueError(f"tensor {name!r} ends at byte {end}, past the blob ({len(view)})")
        yield name, dtype, shape, view[offset:end], str(_get(m, "sha256"))
    if end != len(view):
        raise ValueError(f"metadata covers {end} of the blob's {len(view)} bytes")


def digest_from_blob(blob: bytes | bytearray | memoryview, meta: Sequence[Any]) -> str:
    """The canonical digest of the weight set a blob + metadata describe (no tensors built).

    Equals `canonical_digest(state_from_blob(blob, meta))`; ValueError for inconsistent
    metadata (gaps, overlaps, sizes that do not match shape x dtype, unknown dtypes)."""
    entries = sorted(_slices(blob, meta), key=lambda e: e[0])
    return _flat_digest(
        (name, dtype_name(dtype), shape, raw) for name, dtype, shape, raw, _ in entries
    )


def blob_digest(blob: bytes | bytearray | memoryview, meta: Sequence[Any]) -> str:
    """The digest a weight announcement carries for a blob: the canonical digest of the tensors
    ``meta`` describes; sha256 of the raw bytes for a blob without tensor metadata (opaque
    payloads, used by tests). Shared by the publisher and every receiver, whatever transport."""
    if meta:
        return digest_from_blob(blob, meta)
    return hashlib.sha256(blob).hexdigest()


def state_from_blob(
    blob: bytes | bytearray | memoryview,
    meta: Sequence[Any],
    *,
    verify: bool = True,
    copy: bool = True,
) -> dict[str, torch.Tensor]:
    """{name: tensor} rebuilt from a blob and its metadata (dicts or TensorMeta objects): the
    one decoder of a weight blob (ValueError naming the tensor for inconsistent metadata).

    copy: the tensors own their memory (independent of `blob`); False: views of a writable
    `blob` (a bytearray), as a receiver hands a verified set to the engine. verify: check each
    tensor's sha256 against its metadata (ValueError naming the tensor on a mismatch).
    """
    state: dict[str, torch.Tensor] = {}
    for name, dtype, shape, raw, sha in _slices(blob, meta):
        if verify and hashlib.sha256(raw).hexdigest() != sha:
            raise ValueError(f"tensor {name!r}: sha256 does not match its metadata")
        if len(raw) == 0:
            state[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(raw) if copy else raw, dtype=torch.uint8)
        state[name] = flat.view(dtype).reshape(shape)
    return state


# -- the tree digest (docs/CONTRACTS.md 6) --------------------------------------------------------

# The kind names are proto.records.DIGEST_FLAT / DIGEST_TREE (the wire's spelling, written here
# again; tests/weights/test_digest.py checks the two agree).
FLAT = "sha256"
"""Digest kind of runs recorded before the tree: one sha256 over headers and bytes
(`canonical_digest`). A record with no kind (or "") means this kind."""
TREE = "sha256-tree"
"""Digest kind of new publications: sha256 over the ordered per-chunk sha256 (`tree_root`)."""
KINDS = (FLAT, TREE)
DEFAULT_CHUNK_BYTES = 16 << 20
"""Chunk size of the tree digest (the default WeightChunk size too, so a chunk is one leaf)."""
_TREE_TAG = b"looprl-weights-tree/1\0"


@dataclass(frozen=True)
class Digest:
    """A weight set's digest and how it was computed: what every record of a version keeps
    (announce, manifest.json, weights/digests.jsonl). ``chunks``: the sha256 hex of each
    ``chunk_bytes`` piece of the canonical bytes, in order (tree kind; () for flat)."""

    hex: str
    kind: str = FLAT
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """{digest, digest_kind, digest_chunk_bytes}: the fields a version's records carry."""
        return {
            "digest": self.hex,
            "digest_kind": self.kind,
            "digest_chunk_bytes": self.chunk_bytes,
        }


def check_kind(kind: str, chunk_bytes: int) -> str:
    """The kind ("" -> FLAT); ValueError naming what is wrong with an unknown kind or a tree
    without a chunk size."""
    kind = kind or FLAT
    if kind not in KINDS:
        raise ValueError(f"digest_kind {kind!r}: expected one of {KINDS} (or absent: {FLAT})")
    if kind == TREE and chunk_bytes < 1:
        raise ValueError(f"digest_chunk_bytes {chunk_bytes}: a {TREE} digest needs >= 1")
    return kind


def num_chunks(total: int, chunk_bytes: int) -> int:
    """How many ``chunk_bytes`` pieces hold ``total`` bytes (the last one shorter)."""
    return -(-total // chunk_bytes)


def _chunk_segments(views: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """The pieces of each ``chunk_bytes`` chunk of the concatenation of ``views`` (no copy)."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = chunk_bytes
    for v in views:
        pos = 0
        while pos < len(v):
            take = min(room, len(v) - pos)
            cur.append(v[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk_bytes
    if cur:
        out.append(cur)
    return out


def _sha(segments: Sequence[memoryview]) -> bytes:
    h = hashlib.sha256()
    for s in segments:
        h.update(s)
    return h.digest()


def chunk_sha256(data: bytes | bytearray | memoryview) -> bytes:
    """sha256 of one chunk (a leaf of the tree)."""
    return hashlib.sha256(data).digest()


def chunk_leaves(views: Sequence[bytes | bytearray | memoryview], chunk_bytes: int) -> list[bytes]:
    """sha256 of every ``chunk_bytes`` chunk of the concatenated ``views``, hashed on the
    thread pool (`models.pool.hash_pool`), in chunk order."""
    mv = [memoryview(v).cast("B") for v in views]
    return list(hash_pool().map(_sha, _chunk_segments(mv, chunk_bytes)))


def meta_leaf(entries: Iterable[tuple[str, str, Sequence[int], int]]) -> bytes:
    """sha256 of the headers (name, dtype, shape, byte length) of every tensor, in the given
    (sorted-name) order: the names, dtypes and shapes are part of the tree digest."""
    h = hashlib.sha256()
    for name, dtype, shape, nbytes in entries:
        h.update(_header(name, dtype, shape, nbytes))
    return h.digest()


def tree_root(head: bytes, leaves: Sequence[bytes], chunk_bytes: int, total: int) -> str:
    """The tree digest: sha256 hex of tag, chunk size and total length (8 bytes LE each), the
    header leaf and the chunk leaves in order (module docstring)."""
    h = hashlib.sha256(_TREE_TAG)
    h.update(chunk_bytes.to_bytes(8, "little") + total.to_bytes(8, "little") + head)
    for leaf in leaves:
        h.update(leaf)
    return h.hexdigest()


def tree_digest(
    state: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Digest:
    """The tree digest of a weight set (its tensors hashed in place, in parallel)."""
    check_kind(TREE, chunk_bytes)
    names = sorted(state)
    raws = [_canonical_view(state[n]) or memoryview(b"") for n in names]
    head = meta_leaf(
        (n, dtype_name(state[n].dtype), state[n].shape, len(r)) for n, r in zip(names, raws)
    )
    return tree_of(head, chunk_leaves(raws, chunk_bytes), chunk_bytes, sum(len(r) for r in raws))


def tree_of(head: bytes, leaves: Sequence[bytes], chunk_bytes: int, total: int) -> Digest:
    """The tree ``Digest`` of a header leaf and the chunk leaves of ``total`` bytes."""
    return Digest(tree_root(head, leaves, chunk_bytes, total), TREE, chunk_bytes,
                  tuple(x.hex() for x in leaves))  # fmt: skip


def blob_head(blob_len: int, meta: Sequence[Any]) -> bytes:
    """The header leaf of a blob's tensors (none, an opaque payload: sha256 of nothing);
    ValueError unless ``meta`` is in sorted-name order (the blob then holds the canonical
    bytes as they are)."""
    names = [str(_get(m, "name")) for m in meta]
    if names != sorted(names):
        raise ValueError("a tree digest needs the tensors in sorted-name order")
    return meta_leaf(
        (
            str(_get(m, "name")),
            str(_get(m, "dtype")),
            list(_get(m, "shape")),
            int(_get(m, "nbytes")),
        )
        for m in meta
    )


def weights_digest(
    blob: bytes | bytearray | memoryview,
    meta: Sequence[Any],
    kind: str = TREE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Digest:
    """The digest of kind ``kind`` of the weight set a blob + metadata describe (checked as in
    `digest_from_blob`). Without metadata (an opaque payload: tests) the flat kind is sha256 of
    the bytes and the tree kind has an empty header leaf."""
    kind = check_kind(kind, chunk_bytes)
    if meta:
        list(_slices(blob, meta))  # validates offsets, sizes and dtypes
    if kind == FLAT:
        return Digest(blob_digest(blob, meta))
    return tree_of(blob_head(len(blob), meta), chunk_leaves([blob], chunk_bytes), chunk_bytes,
                   len(blob))  # fmt: skip


def digest_of_state(state: Mapping[str, torch.Tensor], kind: str = "", chunk_bytes: int = 0) -> str:
    """The hex digest of kind ``kind`` ("" or FLAT: `canonical_digest`) of ``state``: what a
    receiver compares with the recorded digest of a set it reads itself (files, a mapping)."""
    if check_kind(kind, chunk_bytes) == FLAT:
        return canonical_digest(state)
    return tree_digest(state, chunk_bytes).hex
