"""The torch generator engine's weight loading (generator.torch_engine.engine.TorchEngine's base): a
version's checked state copied into the parameters in place, between `generate` calls (the
engine's lock), or with `inflight_updates` between two decode steps of a running one; an announced directory's /dev/shm copy on this host (publish.transport shm)
taken first (`weights.verified.VerifiedWeights.load_local_copy`): on a GPU read into a pinned
buffer kept between versions with every piece hashed as read, then copied to the device
(nothing unchecked reaches the parameters); on the CPU copied out of the mapping while its
digest is checked (a copy refused after it was loaded is replaced from the directory, and the
engine stops serving if that fails too)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch

from generator.engine import WeightLoadError, check_newer, checked_state
from models.checkpoint import load_into
from weights.shm import ShmRefused
from weights.verified import VerifiedWeights


class TorchWeights:
    """Weight loading of a torch engine (module doc); the engine sets the attributes."""

    model: torch.nn.Module
    device: torch.device
    stream: torch.cuda.Stream | None
    weight_version: int
    broken: str
    _lock: threading.Lock | threading.RLock
    _unchecked: bool
    _pinned: torch.Tensor | None
    stage_shm: bool | None
    inflight_updates: bool
    _swap: tuple[Mapping[str, torch.Tensor], int] | None
    _swap_lock: threading.Lock
    on_swapped: Callable[[], None] | None
    """Called on the engine's thread once a version staged during a batch is served (the
    generator loop's waker: it acknowledges the version at once, not at its next poll)."""

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's stream current for the block (``stream``: the one current where it
        was built; nothing on the CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else (
            contextlib.nullcontext())  # fmt: skip

    def load_weights(self, weights: VerifiedWeights) -> None:
        """Load ``weights`` (``_load_now``); with ``inflight_updates`` while a ``generate``
        runs (its lock held by another thread): check the state on this thread, copy it to the
        device beside the parameters, and let the running batch swap it in between two decode
        steps (``_apply_swap``: an in-place copy, so a captured CUDA graph reads the new
        weights); ``weight_version`` changes then, not when this returns. On the engine's
        stream (``on_stream``), whichever thread calls."""
        with self.on_stream():
            self._load_weights(weights)

    def _load_weights(self, weights: VerifiedWeights) -> None:
        if self.broken:
            raise WeightLoadError(self.broken)
        if self.inflight_updates and not self._lock.acquire(blocking=False):
            check_newer(weights.version, self.weight_version)
            state = checked_state(weights, self.weight_version)
            # a checked state already on this device is the receiver's own copy (weights.
            # cuda_ipc): taken as it is; any other (views of a mapping, host bytes) is copied
            staged = {k: t if t.device == self.device and t.is_cuda else t.to(self.device, copy=True)
                      for k, t in state.items()}  # fmt: skip
            with self._swap_lock:
                self._swap = (staged, weights.version)
            return
        if self.inflight_updates:  # acquired above: the engine is idle
            try:
                self._load_now(weights)
            finally:
                self._lock.release()
            return
        self._load_now(weights)

    def _apply_swap(self) -> None:
        """The version ``load_weights`` staged during this ``generate``, into the parameters
        (on the engine's thread, between decode steps)."""
        with self._swap_lock:
            swap, self._swap = self._swap, None
        if swap is None or swap[1] <= self.weight_version:
            return
        self._serve(*swap)
        if self.on_swapped is not None:
            self.on_swapped()

    def _load_now(self, weights: VerifiedWeights) -> None:
        """Copy the checked state of ``weights`` into the parameters in place as its version
        (module doc). An announced directory with this host's /dev/shm copy (publish.transport
        shm) takes that copy first (``_load_local``: staged and checked before the load on a
        GPU, copied while checked on the CPU; the lock held, nothing served before the check
        ends); a refused copy is replaced from the directory, checked as read, and the engine
        stops serving (WeightLoadError) if a copy already loaded cannot be replaced."""
        version = weights.version
        with self._lock:
            if self._load_local(weights):
                return
            try:  # the directory itself when its copy was tried
                state = checked_state(weights, self.weight_version, local_copy=False)
            except Exception as e:
                if self._unchecked:  # the parameters hold a refused copy's bytes
                    self.broken = (f"weights v{version}: the /dev/shm copy was refused after "
                                   f"it was loaded and the directory failed too ({e})")  # fmt: skip
                    raise WeightLoadError(self.broken) from e
                raise
            self._serve(state, version)

    def _serve(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """A checked ``state`` into the parameters in place, served as ``version``; a loader
        that fails part way leaves the engine broken (WeightLoadError)."""
        try:
            load_into(self.model, {k: state[k] for k in state})
            for t in state.values():  # (a copy made on a reader's stream, read on this one:
                if t.is_cuda:  # its memory not reused before this stream's copies end)
                    t.record_stream(torch.cuda.current_stream(t.device))
        except Exception as e:
            self.broken = f"weights v{version}: load failed ({type(e).__name__}: {e})"
            raise WeightLoadError(self.broken) from e
        self._unchecked = False
        self.weight_version = version

    def _load_local(self, weights: VerifiedWeights) -> bool:
        """``load_local_copy`` into the parameters: True when loaded and checked; False when it
        is no announced directory, there is no copy here or it was refused (then
        ``_unchecked`` says whether it had been loaded)."""
        check_newer(weights.version, self.weight_version)

        def load(st: Mapping[str, torch.Tensor]) -> None:
            load_into(self.model, dict(st))

        staged = self.stage_shm if self.stage_shm is not None else self.device.type == "cuda"
        try:  # staged: read into the kept buffer and checked; else copied while checked
            done = weights.load_local_copy(load, self._staging if staged else None)
        except ShmRefused:
            self._unchecked = True
            return False
        except Exception as e:
            self.broken = f"weights v{weights.version}: load failed ({type(e).__name__}: {e})"
            raise WeightLoadError(self.broken) from e
        if done:
            self._unchecked = False
            self.weight_version = weights.version
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
