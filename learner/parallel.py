"""torch.distributed + megatron-core parallel state for the learner.

Order of calls in a learner process:

1. `init_distributed(tp)`: process group (env:// under torchrun, else a single local
   process), CPU compat patches on a CPU host, `initialize_model_parallel`, RNG seeds.
2. build models / DDP / optimizers, train.
3. `destroy_distributed()`.

Backend: nccl when CUDA is available, gloo otherwise (or as given). Tensor parallel only:
pipeline, context and expert parallel sizes are 1.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.megatron.cpu import apply_cpu_compat

__all__ = ["DistributedInfo", "destroy_distributed", "free_port", "init_distributed"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits after `init_distributed`."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    tp_rank: int
    """Rank inside the tensor-parallel group."""
    tp_size: int
    """Tensor-parallel size."""
    dp_rank: int
    """Rank inside the data-parallel group."""
    dp_size: int
    """Data-parallel size (world_size // tp_size)."""
    backend: str
    """torch.distributed backend: "gloo" or "nccl"."""
    device: torch.device
    """Device that holds this rank's parameters."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _torchrun_env() -> bool:
    """True under torchrun (all rendezvous variables set), False with none; else ValueError."""
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if present and len(present) != len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise ValueError(
            f"partial torchrun environment: {present} set but {missing} missing; "
            "set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT or none"
        )
    return bool(present)


def _init_process_group(backend: str, timeout: timedelta, torchrun: bool) -> None:
    if torchrun:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:  # one local process; a private TCP store, os.environ untouched
        init_method = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(
            backend, init_method=init_method, rank=0, world_size=1, timeout=timeout
        )


def init_distributed(
    tp: int,
    backend: str | None = None,
    *,
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> DistributedInfo:
    """Set up the process group, megatron's parallel state and its RNG seeds.

    tp: tensor-parallel size; must divide the world size (data-parallel size = world // tp).
    backend: "gloo" or "nccl"; None picks nccl with CUDA, gloo without.
    seed: passed to `model_parallel_cuda_manual_seed` (the CPU generator is seeded with it too).
    timeout_s: collective timeout.

    Reuses an existing process group (so a test can re-initialise with another tp after
    `destroy_distributed(keep_process_group=True)`); raises ValueError for a bad tp or backend
    and when megatron's model-parallel state is already initialised.
    """
    backend = backend or _default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on a CPU host")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    torchrun = _torchrun_env()

    apply_cpu_compat()  # before megatron builds anything; a no-op with CUDA
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise ValueError("megatron model parallel is already initialised; destroy_distributed()")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        _init_process_group(backend, timedelta(seconds=timeout_s), torchrun)
    elif dist.get_backend() != backend:
        raise ValueError(f"process group uses {dist.get_backend()!r}, asked for {backend!r}")

    world_size = dist.get_world_size()
    if world_size % tp != 0:
        raise ValueError(f"tp={tp} does not divide world size {world_size}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        backend=backend,
        device=device,
    )


def destroy_distributed(*, keep_process_group: bool = False) -> None:
    """Tear down megatron's parallel state and (unless kept) the process group. Idempotent."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if not keep_process_group and dist.is_initialized():
        dist.destroy_process_group()
