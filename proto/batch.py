"""Column-wise wire layout of :class:`RolloutBatch`.

A batch of rollouts travels as one map of columns: per-rollout scalars as lists, and the
arrays of all rollouts concatenated (one wire tensor each) with per-rollout lengths. This
costs one numpy concatenation per column instead of one tensor per rollout, compresses
better (zstd sees long homogeneous runs) and is validated in a few vectorised checks.

The columns are derived from :class:`Rollout`'s fields: each array field is one
concatenated column of its declared dtype (its length per rollout in ``plen`` for the prompt,
``tlen`` for the per-token arrays; an optional one adds a ``has_<col>`` flag list), every
other field is a list decoded by the record schema's own field codec. The record's rules
apply: :meth:`Rollout.check_values` once on the whole columns, :meth:`Rollout.validate`
(without the value rules) per rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from proto.errors import ProtocolError
from proto.records import Rollout, RolloutBatch
from proto.schema import MAX_ELEMENTS, MAX_LIST, _codecs
from proto.tensors import decode_array, encode_array

_FIELDS = dataclasses.fields(Rollout)
_ARRAYS: dict[str, np.dtype[Any]] = {f.name: f.metadata["array"] for f in _FIELDS
                                     if "array" in f.metadata}  # fmt: skip
_OPTIONAL = frozenset(f.name for f in _FIELDS if "array" in f.metadata and f.default is None)
_SCALARS = [(name, enc, dec) for name, enc, dec in _codecs(Rollout) if name not in _ARRAYS]
_LENGTH = {name: "plen" if name == "prompt_tokens" else "tlen" for name in _ARRAYS}
_FLAG = {name: "has_tv" if name == "token_versions" else f"has_{name}" for name in _OPTIONAL}
_KEYS = frozenset({"n", "plen", "tlen", *_FLAG.values(), *_ARRAYS, *(s[0] for s in _SCALARS)})
_ADDED = {"full_depth": 0}
"""Scalar columns added after the column layout (protocol 1.5): absent in older streams, read
as their default."""
_ADDED_OPTIONAL = ("token_mask", "exit_logprobs")
"""Optional array columns added after the column layout (protocol 1.6: token_mask, 1.7:
exit_logprobs): absent in older streams (their column and flag list), read as None."""


def encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    rs = batch.rollouts
    out: dict[str, Any] = {"n": len(rs)}
    for name, enc, _ in _SCALARS:
        out[name] = [enc(getattr(r, name)) for r in rs]
    out["plen"] = encode_array(np.array([r.prompt_tokens.shape[0] for r in rs], np.int64))
    out["tlen"] = encode_array(np.array([r.tokens.shape[0] for r in rs], np.int64))
    for name, dt in _ARRAYS.items():
        given = [getattr(r, name) for r in rs]
        if name in _OPTIONAL:
            out[_FLAG[name]] = [a is not None for a in given]
        parts = [np.asarray(a, dtype=dt) for a in given if a is not None]
        out[name] = encode_array(np.concatenate(parts) if parts else np.zeros(0, dt))
    return out


def _col(obj: dict[str, Any], name: str, n: int) -> list[Any]:
    v = obj[name]
    if type(v) is not list or len(v) != n:
        raise ProtocolError(f"rollouts.{name}: expected a list of {n} entries")
    return v


def _lengths(obj: dict[str, Any], name: str, n: int) -> np.ndarray:
    a = decode_array(obj[name], field=f"rollouts.{name}", max_elements=MAX_LIST)
    if a.ndim != 1 or a.shape[0] != n or a.dtype.kind not in "iu":
        raise ProtocolError(f"rollouts.{name}: expected {n} integer lengths")
    if n and int(a.min()) < 0:
        raise ProtocolError(f"rollouts.{name}: lengths must be >= 0")
    return a.astype(np.int64)


def decode_batch(obj: Any) -> RolloutBatch:
    if type(obj) is not dict:
        raise ProtocolError("rollouts: expected a map of columns")
    n0 = obj.get("n")
    if type(n0) is int and 0 <= n0 <= MAX_LIST and set(_ADDED) - set(obj):  # an older stream
        obj = {**{k: [v] * n0 for k, v in _ADDED.items()}, **obj}
    if type(n0) is int and 0 <= n0 <= MAX_LIST:
        for name in _ADDED_OPTIONAL:
            if name not in obj and _FLAG[name] not in obj:  # an older stream: none present
                obj = {**obj, name: encode_array(np.zeros(0, _ARRAYS[name])),
                       _FLAG[name]: [False] * n0}  # fmt: skip
    if set(obj) != _KEYS:
        missing, extra = _KEYS - set(obj), set(obj) - _KEYS
        raise ProtocolError(
            f"rollouts: column set mismatch (missing {sorted(missing)}, "
            f"unknown {sorted(map(str, extra))[:8]})"
        )
    n = obj["n"]
    if type(n) is not int or not 0 <= n <= MAX_LIST:
        raise ProtocolError(f"rollouts.n: expected an int in 0..{MAX_LIST}, got {n!r}")
    lengths = {"plen": _lengths(obj, "plen", n), "tlen": _lengths(obj, "tlen", n)}
    if n and int(lengths["plen"].min()) < 1:
        raise ProtocolError("rollouts.plen: every rollout needs a non-empty prompt")
    flags: dict[str, list[Any]] = {}
    for name, flag in _FLAG.items():
        flags[name] = _col(obj, flag, n)
        if any(type(h) is not bool for h in flags[name]):
            raise ProtocolError(f"rollouts.{flag}: expected bools")
    per_rollout: dict[str, list[np.ndarray | None]] = {}
    cols: dict[str, np.ndarray] = {}
    for name, dt in _ARRAYS.items():
        a = decode_array(obj[name], field=f"rollouts.{name}", max_elements=MAX_ELEMENTS)
        if a.dtype != dt or a.ndim != 1:
            raise ProtocolError(f"rollouts.{name}: expected a 1-d {dt} array")
        lens = lengths[_LENGTH[name]]
        present = flags.get(name, [True] * n)
        want = int(sum(int(k) for k, h in zip(lens, present) if h))
        if a.shape[0] != want:
            raise ProtocolError(
                f"rollouts.{name}: {a.shape[0]} values for lengths summing to {want}"
            )
        cols[name], out, at = a, [], 0
        for k, h in zip(lens, present):
            out.append(a[at : at + int(k)] if h else None)
            at += int(k) if h else 0
        per_rollout[name] = out
    # The record's per-value rules once over the whole columns (vectorised).
    Rollout.check_values("rollouts", cols["prompt_tokens"], cols["tokens"], cols["logprobs"],
                         cols["exit_depths"])  # fmt: skip
    scalars = {name: (_col(obj, name, n), dec) for name, _, dec in _SCALARS}
    rollouts: list[Rollout] = []
    for i in range(n):
        kw: dict[str, Any] = {name: col[i] for name, col in per_rollout.items()}
        for name, (col, dec) in scalars.items():
            kw[name] = dec(col[i], f"rollouts[{i}].{name}")
        r = Rollout(**kw)
        r.validate(values=False)
        rollouts.append(r)
    return RolloutBatch(rollouts=rollouts)
