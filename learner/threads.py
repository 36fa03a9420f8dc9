"""The learner's torch intra-op threads (``learner.threads``): resolved once, then applied.

``auto`` resolves at the start of a run (``resolve_threads``) and the run records the number,
so ``looprl replay`` and a resumed run use the same count: on a CPU learner the thread count
can change the bits of a fast-numerics matmul (MKL / oneDNN split the work by threads), and
replay must reach the live run's digests. Order of calls: ``resolve_threads`` (once, before the
run's config is written), then ``apply_threads`` before the trainer is built (every backend:
pipeline.backends.trainer_api.build_trainer).
"""

from __future__ import annotations

import logging
import os

import torch

from models.settings import AUTO

log = logging.getLogger(__name__)


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API (not Linux)
        return max(1, os.cpu_count() or 1)


def _env_cap() -> int | None:
    """OMP_NUM_THREADS when it is a positive integer (torchrun sets 1 for several ranks)."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def resolve_threads(value: int | str, *, local_generator_threads: int = 0,
                    cuda: bool | None = None) -> int:  # fmt: skip
    """``learner.threads`` as a number: an integer stays; ``auto`` is, on a CUDA learner,
    torch's own count now (recorded, not changed), and on a CPU learner the host's cores minus
    ``local_generator_threads`` (the threads of the generators `looprl run` starts beside it),
    at most OMP_NUM_THREADS when that is set, at least 1."""
    if value != AUTO:
        return int(value)
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return torch.get_num_threads()
    n = host_cores() - max(0, local_generator_threads)
    cap = _env_cap()
    return max(1, min(n, cap) if cap is not None else n)


def apply_threads(value: int | str) -> int:
    """Set torch's intra-op threads to ``value``; ``auto`` (not resolved: a run recorded
    before the key, or a direct caller) leaves torch's own count, as such a run had it.
    Returns the count in effect."""
    if value == AUTO:
        return torch.get_num_threads()
    n = int(value)
    if torch.get_num_threads() != n:
        log.info("learner: torch intra-op threads %d -> %d", torch.get_num_threads(), n)
        set_threads(n)
    return n


def set_threads(n: int) -> None:
    """torch's own ``set_num_threads``: a process that hosted a vLLM CPU worker (an in-process
    engine: tests, benchmarks) has ``torch.set_num_threads`` replaced by a no-op that only logs
    a warning (vllm.v1.worker.cpu_worker, after its thread binding), which would leave a
    learner built later in that process on another count than its run recorded."""
    torch._C.set_num_threads(n)
