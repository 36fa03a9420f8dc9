"""``VerifiedWeights``: the one type a receiver hands the generator's engine.

A weight version a receiver accepted: its ``version``, ``digest`` and ``announce``, and its
state as {name: tensor}, which ``state()`` returns checked against the announced digest
(docs/CONTRACTS.md 6). Where the bytes are decides when the check runs:

- in memory (``VerifiedWeights(announce, blob)``, ``of_blob``): the bytes of a chunk stream,
  a collective broadcast or a mapped /dev/shm copy, checked by the receiver as they came in
  (weights.check); ``state()`` is views of them (decoded by ``weights.digest.state_from_blob``,
  no copy), never hashed again;
- a directory (``of_directory``: an announce without chunks, publish.transport shared_fs or
  shm): nothing is read by the receiver; ``state()`` reads it on the caller's thread (the
  engine's, so the multi-GB read and hash never run on the generator loop's), this host's
  /dev/shm copy of it first (weights.shm: mapped and checked piece by piece; no copy, or a
  refused one, its bad pieces named in the log: the directory, its tensors hashed with the
  announced kind);
- a mapping or directory with no announce (``of``: tests, benchmarks, a set built by hand):
  hashed with the flat kind (or the kind given) when ``state()`` reads it.

A set whose digest does not match raises ``weights.check.WeightsRefused`` from ``state()``.
``close()`` lets go of the bytes (a mapped copy is unmapped once no view of it is left).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from models.checkpoint import load_checkpoint
from proto.records import WeightAnnounce
from weights.check import WeightsRefused, check_blob
from weights.digest import digest_of_state, state_from_blob
from weights.shm import load_mapped, load_staged, mapped_copy

State = Mapping[str, torch.Tensor]


def _views(announce: WeightAnnounce, blob: Any) -> dict[str, torch.Tensor]:
    """{name: tensor} views of ``blob`` as the announce lays it out (an opaque blob, with no
    tensor metadata, maps no names); WeightsRefused for metadata that does not fit it."""
    if not announce.tensors:
        return {}
    try:
        return state_from_blob(blob, announce.tensors, verify=False, copy=False)
    except ValueError as e:
        raise WeightsRefused(str(e)) from None


class VerifiedWeights:
    """A weight version a receiver accepted (module docstring): ``version``, ``digest``,
    ``announce``; ``state()`` the checked {name: tensor}."""

    def __init__(self, announce: WeightAnnounce, blob: Any = None) -> None:
        """``blob``: the announce's bytes, whose digest the caller checked (a receiver that
        hashed every piece as it came); None: the announced directory, read by ``state()``."""
        self.announce = announce
        self._blob = blob
        self._views = None if blob is None else _views(announce, blob)
        self._state: State | None = None  # ``of``: a mapping checked when read
        self._local_copy = blob is None  # an announced directory: this host's copy first

    @classmethod
    def of_blob(cls, announce: WeightAnnounce, blob: Any) -> VerifiedWeights:
        """``blob`` once its digest matches the announce (``weights.check.check_blob``: the
        pieces hashed in parallel); WeightsRefused naming what differs."""
        check_blob(announce, blob)
        return cls(announce, blob)

    @classmethod
    def of_checked(cls, announce: WeightAnnounce, state: State) -> VerifiedWeights:
        """``state`` (e.g. views of a device buffer: weights.cuda_ipc) whose digest the caller
        checked against the announce; ``state()`` returns it, not hashed again."""
        w = cls(announce)
        w._views, w._local_copy = dict(state), False
        return w

    @classmethod
    def of_directory(cls, announce: WeightAnnounce) -> VerifiedWeights:
        """The directory ``announce.path`` (no chunks travel), checked when ``state()`` reads it."""
        return cls(announce)

    @classmethod
    def of(
        cls, source: str | os.PathLike[str] | State, version: int, digest: str, *,
        kind: str = "", chunk_bytes: int = 0,
    ) -> VerifiedWeights:  # fmt: skip
        """A directory or {name: tensor} mapping with no announce, as version ``version`` of
        digest ``digest`` (of kind ``kind``: the flat one by default), hashed when ``state()``
        reads it."""
        path = "" if isinstance(source, Mapping) else os.fspath(source)
        ann = WeightAnnounce(version, digest, 0, 0, 0, path=path, digest_kind=kind,
                             digest_chunk_bytes=chunk_bytes)  # fmt: skip
        w = cls(ann)
        w._local_copy = False
        if isinstance(source, Mapping):
            w._state = source
        return w

    @property
    def version(self) -> int:
        return self.announce.version

    @property
    def digest(self) -> str:
        return self.announce.digest

    @property
    def blob(self) -> Any:
        """The checked bytes held in memory (b"" when ``state()`` reads them)."""
        return b"" if self._blob is None else self._blob

    @property
    def directory(self) -> str:
        """The directory ``state()`` reads ("" for a set in memory)."""
        return "" if self._views is not None or self._state is not None else self.announce.path

    def state(self, *, local_copy: bool = True) -> State:
        """The checked {name: tensor} (module docstring); ``local_copy`` False: an announced
        directory is read from the directory itself, not this host's /dev/shm copy.
        WeightsRefused when what is read does not hash to the announced digest."""
        if self._views is not None:
            return self._views
        a = self.announce
        if self._state is not None:
            state = dict(self._state)
        else:
            mapped = mapped_copy(a) if local_copy and self._local_copy else None
            if mapped is not None:  # checked piece by piece (weights.shm)
                return _views(a, mapped)
            state = load_checkpoint(a.path)[1]
        try:
            got = digest_of_state(state, a.digest_kind, a.digest_chunk_bytes)
        except ValueError as e:  # an unknown kind
            raise WeightsRefused(f"weights v{a.version}: {e}") from None
        if got != a.digest:
            raise WeightsRefused(
                f"weights v{a.version}: digest {got} does not match the announced {a.digest}"
            )
        return state

    def load_local_copy(
        self, load: Callable[[State], object], staging: Callable[[int], Any] | None = None
    ) -> bool:
        """An announced directory's /dev/shm copy on this host (publish.transport shm) handed
        to ``load`` (an engine's copy into its parameters): with ``staging``, read into
        ``staging(nbytes)`` with every piece hashed as read, then, checked, loaded
        (``weights.shm.load_staged``: nothing unchecked reaches ``load``); without, loaded
        WHILE its digest is checked (``load_mapped``: ``weights.shm.ShmRefused`` after
        ``load`` ran on a copy that did not match; the caller replaces what it loaded and
        serves nothing before this returns). False: not an announced directory, no copy here,
        or one refused before ``load`` ran (then read ``state(local_copy=False)``)."""
        if not self._local_copy:
            return False
        if staging is not None:
            return load_staged(self.announce, load, staging)
        return load_mapped(self.announce, load)

    def close(self) -> None:
        """Let go of the bytes: the views, and a mapped blob (a /dev/shm copy), unmapped
        once no view of it is left."""
        blob, self._blob, self._views = self._blob, None, {}
        if isinstance(blob, mmap.mmap):
            try:
                blob.close()
            except BufferError:  # a view of it is still alive elsewhere: unmapped when it dies
                pass


__all__ = ["VerifiedWeights"]
