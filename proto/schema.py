"""Typed records <-> msgpack-ready dicts, driven by dataclass annotations.

A record is a dataclass registered with :func:`record`. Its fields are of these kinds:

- ``int``, ``float``, ``str``, ``bool``, ``bytes`` and their ``| None`` forms;
- ``list[int]``, ``list[str]``, ``list[float]``, ``list[R]`` for a registered record ``R``;
- ``dict[str, Scalar]`` (``Scalar`` = None | bool | int | float | str), e.g. task metadata;
- arrays, declared with :func:`array_field` (dtype, ndim, optional), sent as wire tensors.

Decoding checks the exact key set, every type and every bound, then calls the record's
``validate()`` for cross-field rules; any failure is a :class:`ProtocolError` that names
the record and the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from proto.errors import ProtocolError
from proto.tensors import decode_array, encode_array

Scalar = None | bool | int | float | str
MAX_STR = 1 << 20  # characters in one string field
MAX_LIST = 1 << 20  # entries in one list / map field
MAX_ELEMENTS = 1 << 28  # elements in one array field
U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

T = TypeVar("T")
REGISTRY: dict[str, type] = {}
_CODECS: dict[type, list[tuple[str, Callable[[Any], Any], Callable[[Any, str], Any]]]] = {}


def array_field(dtype: str, *, ndim: int = 1, optional: bool = False) -> Any:
    """Declare an array field: numpy ``dtype`` (e.g. ``"int32"``) with ``ndim`` dims."""
    meta = {"array": np.dtype(dtype), "ndim": ndim}
    if optional:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(metadata=meta)


def record(wire_type: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a dataclass as wire record ``wire_type``."""

    def wrap(cls: type[T]) -> type[T]:
        if wire_type in REGISTRY:
            raise RuntimeError(f"wire type {wire_type!r} registered twice")
        cls.WIRE_TYPE = wire_type  # type: ignore[attr-defined]
        REGISTRY[wire_type] = cls
        return cls

    return wrap


def _scalar_ok(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def _check_int(v: Any, where: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{where}: expected an int, got {type(v).__name__}")
    if not I64_MIN <= v <= U64_MAX:
        raise ProtocolError(f"{where}: int {v} outside the 64-bit range")
    return v


def _check_float(v: Any, where: str) -> float:
    if type(v) is int:
        return float(v)
    if type(v) is not float:
        raise ProtocolError(f"{where}: expected a float, got {type(v).__name__}")
    return v


def _check_str(v: Any, where: str) -> str:
    if type(v) is not str:
        raise ProtocolError(f"{where}: expected a str, got {type(v).__name__}")
    if len(v) > MAX_STR:
        raise ProtocolError(f"{where}: string of {len(v)} chars exceeds {MAX_STR}")
    return v


def _check_list(v: Any, where: str) -> list[Any]:
    if type(v) is not list:
        raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
    if len(v) > MAX_LIST:
        raise ProtocolError(f"{where}: list of {len(v)} entries exceeds {MAX_LIST}")
    return v


def _field_codec(tp: Any, meta: Any) -> tuple[Callable[[Any], Any], Callable[[Any, str], Any]]:
    """(encode, decode) functions for one annotated field type."""
    if "array" in meta:
        want: np.dtype = meta["array"]
        ndim: int = meta["ndim"]

        def enc_arr(v: Any) -> Any:
            if v is None:
                return None
            a = np.asarray(v)
            if a.dtype != want:
                a = a.astype(want)
            return encode_array(a)

        def dec_arr(v: Any, where: str) -> Any:
            if v is None:
                if dataclasses.MISSING is meta.get("_required", None):
                    raise ProtocolError(f"{where}: array required")
                return None
            a = decode_array(v, field=where, max_elements=MAX_ELEMENTS)
            if a.dtype != want:
                raise ProtocolError(f"{where}: dtype {a.dtype.str} where {want.str} is expected")
            if a.ndim != ndim:
                raise ProtocolError(f"{where}: {a.ndim}-d array where {ndim}-d is expected")
            return a

        return enc_arr, dec_arr

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {tp}")
        ienc, idec = _field_codec(inner[0], {})
        return (lambda v: None if v is None else ienc(v)), (
            lambda v, w: None if v is None else idec(v, w)
        )
    if tp is int:
        return (lambda v: int(v)), _check_int
    if tp is float:
        return (lambda v: float(v)), _check_float
    if tp is str:
        return (lambda v: v), _check_str
    if tp is bool:

        def dec_bool(v: Any, where: str) -> bool:
            if type(v) is not bool:
                raise ProtocolError(f"{where}: expected a bool, got {type(v).__name__}")
            return v

        return (lambda v: bool(v)), dec_bool
    if tp is bytes:

        def dec_bytes(v: Any, where: str) -> bytes:
            if type(v) is not bytes:
                raise ProtocolError(f"{where}: expected bytes, got {type(v).__name__}")
            return v

        return (lambda v: v), dec_bytes
    if origin is list:
        (et,) = args
        eenc, edec = _field_codec(et, {})

        def dec_list(v: Any, where: str) -> list[Any]:
            return [edec(x, f"{where}[{i}]") for i, x in enumerate(_check_list(v, where))]

        return (lambda v: [eenc(x) for x in v]), dec_list
    if origin is dict:

        def dec_map(v: Any, where: str) -> dict[str, Any]:
            if type(v) is not dict:
                raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
            if len(v) > MAX_LIST:
                raise ProtocolError(f"{where}: map of {len(v)} entries exceeds {MAX_LIST}")
            for k, x in v.items():
                _check_str(k, f"{where} key")
                if not _scalar_ok(x):
                    raise ProtocolError(
                        f"{where}[{k!r}]: values must be None/bool/int/float/str, "
                        f"got {type(x).__name__}"
                    )
                if type(x) is str:
                    _check_str(x, f"{where}[{k!r}]")
            return dict(v)

        return (lambda v: dict(v)), dec_map
    if isinstance(tp, type) and hasattr(tp, "WIRE_TYPE"):
        return (lambda v: to_wire(v)), (lambda v, w: from_wire(tp, v, where=w))
    raise TypeError(f"unsupported field type {tp!r}")


def _codecs(cls: type) -> list[tuple[str, Callable[[Any], Any], Callable[[Any, str], Any]]]:
    got = _CODECS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = []
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            if "array" in meta and f.default is dataclasses.MISSING:
                meta["_required"] = dataclasses.MISSING
            enc, dec = _field_codec(hints[f.name], meta)
            got.append((f.name, enc, dec))
        _CODECS[cls] = got
    return got


def to_wire(rec: Any) -> dict[str, Any]:
    """Record -> dict of msgpack-ready values."""
    return {name: enc(getattr(rec, name)) for name, enc, _ in _codecs(type(rec))}


def from_wire(cls: type[T], obj: Any, *, where: str = "", allow_unknown: bool = False) -> T:
    """Dict -> validated record of type ``cls``; raises ProtocolError naming the field."""
    name = getattr(cls, "WIRE_TYPE", cls.__name__)
    where = where or name
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected a map of fields, got {type(obj).__name__}")
    codecs = _codecs(cls)
    known = {n for n, _, _ in codecs}
    unknown = [k for k in obj if k not in known]
    if unknown and not allow_unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(map(str, unknown))[:8]}")
    kwargs: dict[str, Any] = {}
    defaults = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for fname, _, dec in codecs:
        if fname not in obj:
            f = defaults[fname]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where}: missing field {fname!r}")
            continue
        kwargs[fname] = dec(obj[fname], f"{where}.{fname}")
    rec = cls(**kwargs)
    validate = getattr(rec, "validate", None)
    if validate is not None:
        validate()
    return rec
