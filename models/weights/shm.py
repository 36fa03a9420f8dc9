"""Same-host weight delivery through shared memory (issue 22 item 3): one copy of a version's
blob per host, mapped by every local generator, its digest still checked.

The learner (or one process per host) writes a Publication's canonical blob once into a file of
a memory file system (``/dev/shm``: POSIX shared memory), atomically (``write_shm``: a temporary
name, then rename); each generator process on that host maps it (``open_shm``) copy-on-write
(``MAP_PRIVATE``, populated: writable tensor views that never write back into the shared copy), and
checks the tree digest against the version's announce (``models.weights.verified.verify_blob``:
pieces hashed on the thread pool, a bad piece named with its tensors) before handing the engine
``VerifiedWeights`` views of the mapped pages: no socket, no chunk copies, no second copy in the
generator's memory until the engine copies the tensors to its device.

Order of calls::

    path = write_shm(pub, shm_path(run_id, pub.version))     # learner side, once per host
    announce = pub.announce(chunk_bytes)                       # what generators already receive
    weights = open_shm(announce, path)                         # each local generator
    ...engine.load_weights(weights)...; weights.close()        # unmaps (the views die with it)
    remove_shm(path)                                           # learner side, when pruned

Not yet wired to ``publish.transport`` (the announce does not name the file): the mechanism, its
test with real processes (tests/models/test_weights_shm.py) and its timing
(benchmarks/shm_delivery.py) come first.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Any

from models.weights.publication import Publication
from models.weights.verified import VerifiedWeights, verify_blob
from proto import WeightAnnounce

SHM_DIR = Path("/dev/shm")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def shm_path(run_id: str, version: int, root: str | os.PathLike[str] | None = None) -> Path:
    """The file of version ``version`` of run ``run_id`` (``root``: default /dev/shm)."""
    if version < 0:
        raise ValueError(f"version: expected >= 0, got {version}")
    base = Path(root) if root is not None else SHM_DIR
    return base / f"looprl-{_SAFE.sub('_', run_id)}-v{version}.blob"


def write_shm(pub: Publication, path: str | os.PathLike[str]) -> Path:
    """``pub.blob`` into ``path``, atomically (a reader sees the whole blob or no file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(pub.blob))
    os.replace(tmp, path)
    return path


class ShmWeights(VerifiedWeights):
    """VerifiedWeights whose blob is a copy-on-write mapping of a shared file; ``close()``
    unmaps it (the tensor views must be dropped first)."""

    def __init__(self, announce: WeightAnnounce, blob: Any, mapping: mmap.mmap) -> None:
        super().__init__(announce, blob)
        self.mapping = mapping

    def close(self) -> None:
        self.clear()
        self.blob = bytearray()
        try:
            self.mapping.close()
        except BufferError:  # a view of it is still alive elsewhere: unmapped when it dies
            pass


def open_shm(announce: WeightAnnounce, path: str | os.PathLike[str]) -> ShmWeights:
    """The weights of ``path`` as checked ``VerifiedWeights`` views (module docstring);
    ValueError naming the file and why (size, the pieces that differ, the digest)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != announce.total_bytes:
                raise ValueError(f"{size} bytes, {announce.total_bytes} announced")
            # private (copy-on-write) and populated: the pages are mapped up front, not faulted
            # in one by one while the digest reads them
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mapping = mmap.mmap(f.fileno(), size, flags=flags, prot=prot) if size else None
    except OSError as e:
        raise ValueError(f"weights v{announce.version} in {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"weights v{announce.version} in {path}: {e}") from None
    if mapping is None:
        raise ValueError(f"weights v{announce.version} in {path}: empty")
    try:
        verify_blob(announce, mapping)  # type: ignore[arg-type]  # a writable buffer
        return ShmWeights(announce, mapping, mapping)
    except ValueError as e:
        mapping.close()
        raise ValueError(f"weights v{announce.version} in {path}: {e}") from None


def remove_shm(path: str | os.PathLike[str]) -> None:
    """Delete a version's file (mapped copies stay valid until unmapped)."""
    Path(path).unlink(missing_ok=True)


__all__ = ["SHM_DIR", "ShmWeights", "open_shm", "remove_shm", "shm_path", "write_shm"]
