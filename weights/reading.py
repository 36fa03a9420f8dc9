"""What the generator's engine reads itself (generator.engine.checked_state), and its digest.

``read_weights``: a ``VerifiedWeights`` is trusted as it is (its receiver checked it: not
hashed again); an ``OnDisk`` directory (shared_fs, shm) comes from this host's checked /dev/shm
copy if it has one (weights.shm.mapped_copy, on the engine's lane like the read), else
it is read and hashed with its announce's digest kind; a plain mapping or path with the flat
kind. Its own module so that weights.verified (the checks) and weights.shm (the
mapped copy, built on those checks) do not import each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from models.checkpoint import load_checkpoint
from weights.digest import digest_of_state
from weights.shm import mapped_copy
from weights.verified import OnDisk, VerifiedWeights


def read_weights(source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> tuple[Any, str]:
    """(state, its digest) of what the engine is handed: a VerifiedWeights' announced digest
    (checked by its receiver, not hashed here); for what is read here, the digest of the
    announced kind (OnDisk) or of the flat kind (a plain directory or mapping)."""
    if isinstance(source, VerifiedWeights):
        return source, source.digest
    if isinstance(source, Mapping):
        state = dict(source)
        return state, digest_of_state(state)
    if isinstance(source, OnDisk) and source.local_copy:  # this host's /dev/shm copy first
        mapped = mapped_copy(source.announce)
        if mapped is not None:
            return mapped, mapped.digest
    state = load_checkpoint(source)[1]
    if isinstance(source, OnDisk):
        ann = source.announce
        return state, digest_of_state(state, ann.digest_kind, ann.digest_chunk_bytes)
    return state, digest_of_state(state)


__all__ = ["read_weights"]
