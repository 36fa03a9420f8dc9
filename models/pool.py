"""The process's thread pool for byte work that releases the GIL (hashlib on large buffers,
os.pwrite): one thread per CPU, made on first use and forgotten in a forked child. Hashing a
weight blob (weights.digest, weights.shm) and writing a checkpoint's shards from a blob
(models.checkpoint) share it."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["hash_pool"]

_pool_lock = threading.Lock()
_pool_obj: ThreadPoolExecutor | None = None


def _forget_pool() -> None:  # a forked child has the pool object but none of its threads
    global _pool_obj, _pool_lock
    _pool_obj, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def hash_pool() -> ThreadPoolExecutor:
    """The process's hashing threads (hashlib releases the GIL on large buffers): one per CPU."""
    global _pool_obj
    with _pool_lock:
        if _pool_obj is None:
            n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            _pool_obj = ThreadPoolExecutor(max(1, n or 1), thread_name_prefix="digest")
        return _pool_obj
