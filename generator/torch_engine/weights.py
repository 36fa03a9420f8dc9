"""The torch generator engine's weight loading (generator.torch_engine.engine.TorchEngine's base): a
version verified, then copied into the parameters in place, between `generate` calls (the
engine's lock); this host's /dev/shm copy of an announced directory (publish.transport shm)
taken first: on a GPU read into a pinned buffer kept between versions with every piece hashed
as read, then copied to the device (`weights.shm.load_staged`: nothing unchecked reaches
the parameters); on the CPU copied out of the mapping while its digest is checked
(`load_mapped`: a copy refused after it was loaded is replaced from the directory, and the
engine stops serving if that fails too)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from generator.engine import WeightLoadError, checked_state
from models.checkpoint import load_into
from weights.shm import ShmRefused, load_mapped, load_staged
from weights.verified import OnDisk


class TorchWeights:
    """Weight loading of a torch engine (module doc); the engine sets the attributes."""

    model: torch.nn.Module
    device: torch.device
    weight_version: int
    broken: str
    _lock: threading.Lock | threading.RLock
    _unchecked: bool
    _pinned: torch.Tensor | None
    stage_shm: bool | None

    def load_weights(
        self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], version: int,
        digest: str,
    ) -> None:  # fmt: skip
        """Verify, then copy `source` into the parameters in place as `version` (module doc).
        A directory with this host's /dev/shm copy (publish.transport shm) takes that copy
        first (``_load_mapped``: staged and checked before the load on a GPU, copied while
        checked on the CPU; the lock held, nothing served before the check ends); a refused
        copy is replaced from the directory, checked as read, and the engine stops serving
        (WeightLoadError) if a copy already loaded cannot be replaced."""
        if self.broken:
            raise WeightLoadError(self.broken)
        with self._lock:
            if isinstance(source, OnDisk) and source.local_copy:
                if self._load_mapped(source, version, digest):
                    return
                source = source.directory_only()
            try:
                state = checked_state(source, version, digest, self.weight_version)
            except Exception as e:
                if self._unchecked:  # the parameters hold a refused copy's bytes
                    self.broken = (f"weights v{version}: the /dev/shm copy was refused after "
                                   f"it was loaded and the directory failed too ({e})")  # fmt: skip
                    raise WeightLoadError(self.broken) from e
                raise
            try:
                load_into(self.model, {k: state[k] for k in state})
            except Exception as e:
                self.broken = f"weights v{version}: load failed ({type(e).__name__}: {e})"
                raise WeightLoadError(self.broken) from e
            self._unchecked = False
            self.weight_version = version

    def _load_mapped(self, source: OnDisk, version: int, digest: str) -> bool:
        """`load_mapped` into the parameters: True when loaded and checked; False when there is
        no copy here or it was refused (then ``_unchecked`` says whether it had been loaded)."""
        if version <= self.weight_version:
            raise ValueError(f"version {version} is not newer than {self.weight_version}")
        if source.announce.digest != digest:  # the directory path names the mismatch
            return False

        def load(st: Mapping[str, torch.Tensor]) -> None:
            load_into(self.model, dict(st))

        try:
            if self.stage_shm if self.stage_shm is not None else self.device.type == "cuda":
                done = load_staged(source.announce, load, self._staging)
            else:  # copied out of the mapping while the digest is checked
                done = load_mapped(source.announce, load)
        except ShmRefused:
            self._unchecked = True
            return False
        except Exception as e:
            self.broken = f"weights v{version}: load failed ({type(e).__name__}: {e})"
            raise WeightLoadError(self.broken) from e
        if done:
            self._unchecked = False
            self.weight_version = version
        return done

    def _staging(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer of ``nbytes`` kept between versions (a set's size does not
        change; allocated again when it does): ``load_staged`` reads this host's /dev/shm
        copy into it, checked, and the copy to the GPU then runs at DMA speed."""
        if self._pinned is None or self._pinned.numel() != nbytes:
            self._pinned = None  # (the old one freed first)
            pin = self.device.type == "cuda"
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return cast(np.ndarray, self._pinned.numpy())
