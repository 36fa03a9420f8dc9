"""The one canonical weight digest (DESIGN contract 6) and the weight blob layout.

Everyone who names a weight set by its digest uses this module: the learner's publisher
(`learner/publish.py`), the generator's engine (verifying before it serves) and the
pipeline's weight receiver. Nothing here looks at a model; a weight set is a mapping
{name: tensor} of HF-named tensors.

Canonical bytes of one tensor (`tensor_bytes`): the elements in row-major (C) order, each in
its dtype's little-endian machine representation, with no padding. bfloat16 (and float16)
elements are their raw 2-byte patterns (no conversion to fp32); bool is one byte (0 or 1).
A 0-d tensor has one element; an empty tensor has no bytes.

Canonical digest of a weight set (`canonical_digest`): sha256 over, for every tensor in
ascending order of its name (Python `sorted`, i.e. by Unicode code point):

    name (UTF-8)                                         b"\\0"
    dtype name: str(dtype) without "torch." ("float32", "bfloat16", "int64", ...)   b"\\0"
    shape: decimal dims joined by "," ("" for a 0-d tensor; "0" for an empty [0])   b"\\0"
    byte length of the canonical bytes, 8 bytes unsigned little-endian
    the canonical bytes

The name, dtype and shape are part of the digest: the same bytes under another name, dtype or
shape give another digest. Returned as 64 lowercase hex characters.

Weight blob (`blob_and_meta`): the canonical bytes of every tensor, concatenated in the same
sorted-name order with no gaps, and one metadata dict per tensor with the fields of
`proto.records.TensorMeta` (name, dtype, shape, offset, nbytes, sha256 = sha256 hex of that
tensor's canonical bytes). `digest_from_blob(blob, meta)` recomputes the canonical digest from
the blob and its metadata without building tensors; `state_from_blob` rebuilds the tensors.
Note: the canonical digest is NOT sha256(blob) (the blob carries no names, dtypes or shapes).
A receiver that checked `digest_from_blob` hands the tensors on as a `DigestedState` (views of
the blob with that digest), so the engine's check (`state_digest`) does not hash them again.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "blob_and_meta",
    "blob_digest",
    "canonical_digest",
    "digest_from_blob",
    "dtype_name",
    "state_from_blob",
    "tensor_bytes",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("models.digest assumes a little-endian host")


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
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.is_complex():
        raise ValueError("canonical bytes are defined for dense real tensors only")
    flat = t.detach().cpu().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return None
    return memoryview(flat.view(torch.uint8).numpy().data).toreadonly()


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
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        raw = _canonical_view(t)  # hashed in place: a generator verifying GBs copies nothing
        h.update(_header(name, dtype_name(t.dtype), t.shape, 0 if raw is None else raw.nbytes))
        if raw is not None:
            h.update(raw)
    return h.hexdigest()


class DigestedState(dict):  # type: ignore[type-arg]
    """{name: tensor} views of a blob whose canonical digest a receiver computed from the
    blob itself (``digest_from_blob``, which equals ``canonical_digest`` of these tensors by
    construction) and matched against the announcement: ``state_digest`` returns it instead
    of hashing the same bytes a second time (0.5-0.8 s per GiB on one core)."""

    def __init__(self, state: Mapping[str, torch.Tensor], digest: str) -> None:
        super().__init__(state)
        self.digest = digest


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The canonical digest of ``state``: the receiver's, for a ``DigestedState``."""
    return state.digest if isinstance(state, DigestedState) else canonical_digest(state)


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


def blob_and_meta(state: Mapping[str, torch.Tensor]) -> tuple[bytes, list[dict[str, Any]]]:
    """(blob, metadata): canonical bytes concatenated in sorted-name order, and per tensor
    {name, dtype, shape, offset, nbytes, sha256} (the fields of proto's TensorMeta)."""
    parts: list[memoryview] = []
    meta: list[dict[str, Any]] = []
    offset = 0
    for name in sorted(state):
        t = state[name]
        raw = _canonical_view(t) or memoryview(b"")  # one copy in all: the join below
        meta.append(
            {
                "name": name,
                "dtype": dtype_name(t.dtype),
                "shape": [int(d) for d in t.shape],
                "offset": offset,
                "nbytes": len(raw),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        )
        parts.append(raw)
        offset += len(raw)
    return b"".join(parts), meta


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
    entries = list(_slices(blob, meta))
    h = hashlib.sha256()
    for name, dtype, shape, raw, _ in sorted(entries, key=lambda e: e[0]):
        h.update(_header(name, dtype_name(dtype), shape, len(raw)))
        h.update(raw)
    return h.hexdigest()


def blob_digest(blob: bytes | bytearray | memoryview, meta: Sequence[Any]) -> str:
    """The digest a weight announcement carries for a blob: the canonical digest of the tensors
    ``meta`` describes; sha256 of the raw bytes for a blob without tensor metadata (opaque
    payloads, used by tests). Shared by the publisher and every receiver, whatever transport."""
    if meta:
        return digest_from_blob(blob, meta)
    return hashlib.sha256(blob).hexdigest()


def state_from_blob(
    blob: bytes | bytearray | memoryview, meta: Sequence[Any], *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """{name: tensor} rebuilt from a blob and its metadata (dicts or TensorMeta objects).

    The tensors own their memory (copies, independent of `blob`). verify: check each
    tensor's sha256 against its metadata (ValueError naming the tensor on a mismatch).
    """
    state: dict[str, torch.Tensor] = {}
    for name, dtype, shape, raw, sha in _slices(blob, meta):
        if verify and hashlib.sha256(raw).hexdigest() != sha:
            raise ValueError(f"tensor {name!r}: sha256 does not match its metadata")
        if len(raw) == 0:
            state[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        state[name] = flat.view(dtype).reshape(shape)
    return state
