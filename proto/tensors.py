"""Arrays on the wire: ``{dtype, shape, bytes}``, never pickle.

A wire tensor is a msgpack map::

    {"dt": logical dtype ("<i4", "<f4", "|u1", ...),
     "sh": [d0, d1, ...],            # non-negative ints
     "wd": dtype the bytes hold,      # may be narrower than "dt" for integers (lossless)
     "bs": 0 | 1,                     # 1: bytes are byte-shuffled (all byte 0s, then byte 1s...)
     "d":  bytes}                     # prod(sh) * itemsize(wd) bytes, little-endian

Narrowing (int32 ids that fit in uint16) and byte-shuffling (grouping the bytes of equal
significance) are lossless and make zstd's job much easier: log-probs of sampled tokens
share their exponent bytes, token ids mostly fit 16 bits. Decoding validates every field
and never allocates more than the bytes it was given (times the widening factor, at most 8).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proto.errors import ProtocolError

# Little-endian only; the set of dtypes any record may carry.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    s: np.dtype(s)
    for s in ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
}
_UNSIGNED = ("|u1", "<u2", "<u4", "<u8")
_SIGNED = ("|i1", "<i2", "<i4", "<i8")
MAX_NDIM = 8


def dtype_str(dtype: np.dtype | str) -> str:
    """Canonical wire name of a numpy dtype (little-endian ``dtype.str``)."""
    d = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    s = d.str
    if s not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype!s} cannot travel; allowed: {sorted(ALLOWED_DTYPES)}")
    return s


def narrowest_int(arr: np.ndarray) -> str:
    """Narrowest integer dtype that holds every value of ``arr`` exactly."""
    if arr.size == 0:
        return dtype_str(arr.dtype)
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= 0:
        for s in _UNSIGNED:
            if hi <= np.iinfo(ALLOWED_DTYPES[s]).max:
                return s
    for s in _SIGNED:
        info = np.iinfo(ALLOWED_DTYPES[s])
        if info.min <= lo and hi <= info.max:
            return s
    return dtype_str(arr.dtype)


def encode_array(arr: np.ndarray, *, narrow: bool = True, shuffle: bool = True) -> dict[str, Any]:
    """Encode ``arr`` as a wire tensor (one copy at most for shuffled/narrowed data)."""
    dt = dtype_str(arr.dtype)
    wd = dt
    if narrow and arr.dtype.kind in "iu":
        wd = narrowest_int(arr)
    data = arr if wd == dt else arr.astype(ALLOWED_DTYPES[wd])
    data = np.ascontiguousarray(data)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    itemsize = data.dtype.itemsize
    if shuffle and itemsize > 1 and data.size > 1:
        raw: bytes | memoryview = data.view(np.uint8).reshape(-1, itemsize).T.tobytes()
        bs = 1
    else:
        raw = memoryview(data).cast("B") if data.size else b""  # type: ignore[arg-type]
        bs = 0
    return {"dt": dt, "sh": list(arr.shape), "wd": wd, "bs": bs, "d": raw}


def decode_array(obj: Any, *, field: str, max_elements: int) -> np.ndarray:
    """Decode and validate a wire tensor; raises ProtocolError naming ``field``."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{field}: expected a tensor map {{dt, sh, wd, bs, d}}, got {_tn(obj)}")
    keys = set(obj)
    if keys != {"dt", "sh", "wd", "bs", "d"}:
        raise ProtocolError(
            f"{field}: tensor map must have keys dt, sh, wd, bs, d; got {sorted(map(str, keys))}"
        )
    dt, sh, wd, bs, data = obj["dt"], obj["sh"], obj["wd"], obj["bs"], obj["d"]
    if not isinstance(dt, str) or dt not in ALLOWED_DTYPES:
        raise ProtocolError(
            f"{field}: dtype {dt!r} not allowed; expected one of {sorted(ALLOWED_DTYPES)}"
        )
    if not isinstance(wd, str) or wd not in ALLOWED_DTYPES:
        raise ProtocolError(f"{field}: wire dtype {wd!r} not allowed")
    ldt, wdt = ALLOWED_DTYPES[dt], ALLOWED_DTYPES[wd]
    if wd != dt and not (ldt.kind in "iu" and wdt.kind in "iu" and wdt.itemsize <= ldt.itemsize):
        raise ProtocolError(f"{field}: wire dtype {wd} cannot widen losslessly to {dt}")
    if not isinstance(sh, list) or len(sh) > MAX_NDIM:
        raise ProtocolError(f"{field}: shape must be a list of at most {MAX_NDIM} ints, got {sh!r}")
    n = 1
    for d in sh:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"{field}: shape entries must be non-negative ints, got {sh!r}")
        n *= d
        if n > max_elements:
            raise ProtocolError(f"{field}: {n}+ elements exceeds the limit of {max_elements}")
    if bs not in (0, 1) or type(bs) is not int:
        raise ProtocolError(f"{field}: 'bs' must be 0 or 1, got {bs!r}")
    if not isinstance(data, bytes):
        raise ProtocolError(f"{field}: tensor data must be bytes, got {_tn(data)}")
    if len(data) != n * wdt.itemsize:
        raise ProtocolError(
            f"{field}: {len(data)} data bytes do not match shape {sh} of {wd} "
            f"({n * wdt.itemsize} expected)"
        )
    if bs and wdt.itemsize > 1 and n > 1:
        flat = np.frombuffer(data, np.uint8).reshape(wdt.itemsize, n).T.copy().view(wdt).reshape(-1)
    else:
        flat = np.frombuffer(data, wdt)
    out = flat if wd == dt else flat.astype(ldt)
    return out.reshape(sh)


def _tn(obj: Any) -> str:
    return type(obj).__name__
