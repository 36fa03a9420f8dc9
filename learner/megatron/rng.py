"""megatron's RNG tracker on the CPU generator (used by `learner.megatron.cpu` on CPU hosts).

On a GPU, megatron keeps three named CUDA generator states (data-parallel, model-parallel =
seed + 2718 + tp_rank, expert-parallel) and swaps one into the default CUDA generator inside
`get_cuda_rng_tracker().fork(name)`: TP-sharded weights are initialised and attention dropout
is drawn from the per-TP-rank state, everything else (hidden dropout, replicated regions) from
the default generator, which `model_parallel_cuda_manual_seed` seeds identically on all TP
ranks. Activation recompute snapshots and restores both the CPU and the CUDA states.

On CPU the CPU default generator takes the CUDA generator's role, with the same contract:
`add(name, seed)` records a state, `fork(name)` swaps it in for the block and saves the advanced
state on exit, restoring the default stream exactly. Consequence to keep in mind: on CPU the
"default" stream *is* torch's global generator, so a rank that draws from it on its own (e.g.
data shuffling on rank 0 only) desynchronises dropout across TP ranks; use a private
`torch.Generator` for such draws.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mrandom

from learner.megatron.errors import CpuCompatError

__all__ = ["CpuRNGStatesTracker", "cpu_get_rng_state", "cpu_set_rng_state", "install"]

_DEFAULT = "default-rng"  # megatron's name for "no named state swapped in"


def cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Stand-in for megatron's `_get_cuda_rng_state`: a copy of the CPU generator state."""
    if graph_safe:
        raise CpuCompatError("CUDA-graph-safe RNG states need CUDA")
    return torch.get_rng_state()


def cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stand-in for megatron's `_set_cuda_rng_state`."""
    if graph_safe:
        raise CpuCompatError("CUDA-graph-safe RNG states need CUDA")
    torch.set_rng_state(new_state)


class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """`CudaRNGStatesTracker` with its states held for, and swapped into, the CPU generator."""

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        if use_cudagraphable_rng:
            raise CpuCompatError("use_cudagraphable_rng needs CUDA graphs")
        super().__init__(False, is_inference_rng_tracker)

    def add(self, name: str, seed: int) -> None:
        """Track a new named state seeded with `seed`; the default generator is not touched."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")  # megatron's exception type
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the CPU generator set to the named state (nesting allowed)."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name: str = self._current_state_name  # type: ignore[has-type]
        if orig_name != _DEFAULT:
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(
                    f"current state name {self._current_state_name} is not the same as the "
                    f"desired state name {name}."
                )
            self.states_[name] = torch.get_rng_state()
            if orig_name != _DEFAULT:
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def install() -> list[tuple[str, str]]:
    """Swap the CPU pieces into megatron.core.tensor_parallel.random; (target, reason) pairs.

    `initialize_rng_tracker` looks `CudaRNGStatesTracker` up in its module at call time, so the
    tracker it builds is a `CpuRNGStatesTracker` (still an instance of the original class for
    megatron's isinstance checks). A tracker built before the patch is dropped and rebuilt.
    """
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mrandom._get_cuda_rng_state = cpu_get_rng_state
    mrandom._set_cuda_rng_state = cpu_set_rng_state
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mod = mrandom.__name__
    return [
        (f"{mod}.CudaRNGStatesTracker", "tracker built by initialize_rng_tracker: CPU generator"),
        (f"{mod}._get_cuda_rng_state", "read the CUDA generator (fork, activation recompute)"),
        (f"{mod}._set_cuda_rng_state", "wrote the CUDA generator (fork, activation recompute)"),
    ]
