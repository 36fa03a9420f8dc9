"""Same-host weight delivery through shared memory (publish.transport=shm): one copy of a
version's blob per host, mapped by every local generator, its digest still checked.

The learner (or one process per host) writes a Publication's canonical blob once into a file of
a memory file system (``/dev/shm``: POSIX shared memory), atomically (``write_shm``: a temporary
name, then rename); each generator process on that host maps it (``open_shm``) copy-on-write
(``MAP_PRIVATE``: writable tensor views that never write back into the shared copy), and
checks the tree digest against the version's announce (``weights.check.check_blob``: pieces
hashed on the thread pool, a bad piece named with its tensors) before the engine gets views of
the mapped pages: no socket, no chunk copies, no second copy in the generator's memory until
the engine copies the tensors to its device.

Order of calls::

    path = write_shm(pub, shm_path(run_id, pub.version))     # learner side, once per host
    announce = pub.announce(chunk_bytes)                       # what generators already receive
    mapping = open_shm(announce, path)                         # each local generator: checked
    ...VerifiedWeights(announce, mapping)...; .close()         # unmaps (the views die with it)
    remove_shm(path)                                           # learner side, when pruned

In a run (``ShmPublisher``, the transport's learner side): the trainer writes its directory
RUN_DIR/weights/vN as with shared_fs (resume and the fallback read it), the publisher then
writes the same canonical blob once into ``shm_file(directory)`` (``prepare`` -> ``publish_shm``,
beside the next step) and announces the directory as shared_fs does; it keeps the newest
``publish.keep`` files like the directories (``prune_shm``: an unlinked file's pages live on
while a generator still maps them, the kernel frees them at the last unmap, so a generator
never loses a version it holds) and removes the run's files when it closes. Generators need no
setting: the generator side is ``weights.verified.VerifiedWeights`` of an announced directory,
which maps this host's file if it has one (``mapped_copy``, on the engine's lane like the read)
and checks the tree digest piece by piece: a match is handed to the engine as views (nothing
read from the directory, no second hash); no file (another host, a shared_fs run) or a refused
one (its bad pieces named in the log) loads the directory, whose digest is checked as it is
read, so nothing is loaded unchecked. The torch engine (generator.torch_engine.weights) takes
``load_staged`` (a GPU: read into a pinned buffer, checked, then copied) or ``load_mapped``
(the CPU: the copy into its parameters runs while the digest is checked, nothing is served
until both are done, and a refused copy is replaced from the directory) instead.
``LOOPRL_CORRUPT_SHM=<version>`` (a test hook) flips one byte of that version's file after it
is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from models.pool import hash_pool
from proto.records import WeightAnnounce
from weights.check import WeightsRefused, check_blob, check_digest
from weights.digest import TREE, Digest, blob_head, check_kind, state_from_blob, tree_of
from weights.publication import Publication
from weights.publisher import RETRY_DELAY_S, LearnerSide, PublishSettings, WeightPublisher

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("LOOPRL_SHM_DIR", "/dev/shm"))
CORRUPT_ENV = "LOOPRL_CORRUPT_SHM"
WRITE_PIECE = 64 << 20
"""Bytes per parallel write of ``write_shm`` (a blob of one piece is written by one call)."""
counts: Counter[str] = Counter()
"""This process's deliveries: shm_loaded, shm_refused, shm_absent (a generator's log says each)."""
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_T = TypeVar("_T")


def shm_path(run_id: str, version: int, root: str | os.PathLike[str] | None = None) -> Path:
    """The file of version ``version`` of run ``run_id`` (``root``: default /dev/shm)."""
    if version < 0:
        raise ValueError(f"version: expected >= 0, got {version}")
    base = Path(root) if root is not None else SHM_DIR
    return base / f"looprl-{_SAFE.sub('_', run_id)}-v{version}.blob"


def write_shm(pub: Publication, path: str | os.PathLike[str], threads: int = 4) -> Path:
    """``pub.blob`` into ``path``, atomically (a reader sees the whole blob or no file): the
    file sized once, then ``WRITE_PIECE`` pieces written at their offsets by ``threads``
    threads (pwrite releases the GIL)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    view = memoryview(pub.blob).cast("B")
    n = len(view)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, n)
        offsets = range(0, n, WRITE_PIECE)

        def put(off: int) -> None:
            piece = view[off : off + WRITE_PIECE]
            done = 0
            while done < len(piece):
                done += os.pwrite(fd, piece[done:], off + done)

        if len(offsets) <= 1 or threads <= 1:
            for off in offsets:
                put(off)
        else:
            with ThreadPoolExecutor(min(threads, len(offsets))) as pool:
                list(pool.map(put, offsets))
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path


def _run_key(weights_root: str | os.PathLike[str]) -> str:
    """A file-name-safe key of a run's weights root (RUN_DIR/weights, resolved)."""
    return hashlib.sha256(str(Path(weights_root).resolve()).encode()).hexdigest()[:16]


def shm_file(directory: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """The shared-memory file of the version published in ``directory`` (RUN_DIR/weights/vN):
    the learner and every generator of its host derive the same name from the announced path."""
    d = Path(directory)
    if not d.name.startswith("v") or not d.name[1:].isdigit():
        raise ValueError(f"weights directory {d}: expected a name v<version>")
    return shm_path(_run_key(d.parent), int(d.name[1:]), root)


def publish_shm(pub: Publication, root: str | os.PathLike[str] | None = None) -> Path:
    """The learner's side: ``pub`` (its directory written) into its shared-memory file."""
    if pub.path is None:
        raise ValueError(f"publication v{pub.version} has no directory")
    path = write_shm(pub, shm_file(pub.path, root))
    if os.environ.get(CORRUPT_ENV, "") == str(pub.version):  # the test hook (module docstring)
        with open(path, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
        log.warning("%s=%d: flipped byte 0 of %s", CORRUPT_ENV, pub.version, path)
    return path


def shm_versions(
    weights_root: str | os.PathLike[str], root: str | os.PathLike[str] | None = None
) -> list[int]:
    """The versions of run ``weights_root`` that have a shared-memory file, ascending."""
    base = Path(root) if root is not None else SHM_DIR
    pat = re.compile(rf"looprl-{_run_key(weights_root)}-v(\d+)\.blob")
    found = (pat.fullmatch(p.name) for p in base.glob(f"looprl-{_run_key(weights_root)}-v*.blob"))
    return sorted(int(m.group(1)) for m in found if m)


def prune_shm(weights_root: str | os.PathLike[str], current: int, keep: int,
              root: str | os.PathLike[str] | None = None) -> list[int]:  # fmt: skip
    """Unlink the files older than the newest ``keep`` versions up to ``current`` (``keep`` 0:
    all of them, the run's end). A generator that maps one keeps its pages until it unmaps."""
    upto = [v for v in shm_versions(weights_root, root) if v <= current]
    gone = upto if keep <= 0 else upto[:-keep]
    key = _run_key(weights_root)
    for v in gone:
        remove_shm(shm_path(key, v, root))
    return gone


@contextlib.contextmanager
def _refusing(announce: WeightAnnounce, path: Path) -> Iterator[None]:
    """An OSError or ValueError (a WeightsRefused too) raised inside as one WeightsRefused
    naming the version and the file."""
    try:
        yield
    except OSError as e:
        raise WeightsRefused(f"weights v{announce.version} in {path}: {e.strerror}") from None
    except ValueError as e:
        raise WeightsRefused(f"weights v{announce.version} in {path}: {e}") from None


def _map(announce: WeightAnnounce, path: Path) -> mmap.mmap:
    """``path`` mapped copy-on-write, its size checked against the announce (not its digest);
    WeightsRefused naming the file and why."""
    with _refusing(announce, path), open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != announce.total_bytes:
            raise ValueError(f"{size} bytes, {announce.total_bytes} announced")
        if not size:
            raise ValueError("empty")
        # private (copy-on-write), not populated: MAP_POPULATE on a writable private mapping
        # faults every page in for writing, i.e. copies the whole file (measured: 0.3 GB/s
        # instead of the hash's rate); read faults share the file's pages, read ahead
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=prot)
        if hasattr(mmap, "MADV_WILLNEED"):
            mapping.madvise(mmap.MADV_WILLNEED)
        return mapping


def open_shm(announce: WeightAnnounce, path: str | os.PathLike[str]) -> mmap.mmap:
    """``path`` mapped copy-on-write once its digest matched the announce (module
    docstring); WeightsRefused naming the file and why (size, the pieces that differ, the
    digest)."""
    path = Path(path)
    mapping = _map(announce, path)
    with _refusing(announce, path):
        try:
            check_blob(announce, mapping)
        except WeightsRefused:
            mapping.close()
            raise
    return mapping


READ_BLOCK = 4 << 20
"""Bytes read (``os.preadv``) and hashed at a time by ``read_checked``: hashed while cache-hot."""


def read_checked(announce: WeightAnnounce, path: str | os.PathLike[str], buf: Any) -> None:
    """``path`` read into ``buf`` (a writable buffer of the announce's size, e.g. a pinned host
    tensor's memory) with its digest checked on the bytes in ``buf``: for a tree digest each
    piece is read and hashed on the hash pool in blocks of ``READ_BLOCK`` (one pass over the
    file's pages, the hash on cache-hot bytes), its leaf compared with the announced one, then
    the root; an older (flat) digest is read, then hashed. WeightsRefused naming the file's
    size, the pieces that differ (with their tensors) or the digest; ValueError for a buffer
    of another size."""
    a = announce
    kind = check_kind(a.digest_kind, a.digest_chunk_bytes)
    view = memoryview(buf).cast("B")
    if len(view) != a.total_bytes:
        raise ValueError(f"a buffer of {len(view)} bytes for {a.total_bytes}")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != a.total_bytes:
            raise WeightsRefused(f"{size} bytes, {a.total_bytes} announced")
        tree = kind == TREE and bool(a.chunk_digests)
        piece = a.digest_chunk_bytes if tree else WRITE_PIECE

        def one(lo: int) -> bytes:
            hi, h = min(lo + piece, size), hashlib.sha256()
            for b in range(lo, hi, READ_BLOCK):
                dst = view[b : min(b + READ_BLOCK, hi)]
                got = 0
                while got < len(dst):
                    n = os.preadv(fd, [dst[got:]], b + got)
                    if n <= 0:
                        raise WeightsRefused(f"short read at byte {b + got} of {size}")
                    got += n
                if tree:
                    h.update(dst)
            return h.digest()

        leaves = list(hash_pool().map(one, range(0, size, piece)))
    finally:
        os.close(fd)
    if not tree:
        check_blob(a, view)
        return
    try:
        head = blob_head(size, a.tensors)
    except ValueError as e:  # tensors out of sorted-name order
        raise WeightsRefused(str(e)) from None
    got: Digest = tree_of(head, leaves, a.digest_chunk_bytes, size)
    check_digest(a, got)


def load_staged(
    announce: WeightAnnounce, load: Callable[[Mapping[str, Any]], object],
    buffer: Callable[[int], Any], root: str | os.PathLike[str] | None = None,
) -> bool:  # fmt: skip
    """This host's shared-memory copy of an announced directory read into ``buffer(nbytes)``
    (a staging buffer the caller keeps between versions: on a GPU host a pinned one, from
    which the engine's copy to the device runs at DMA speed, where a copy out of the mapped
    file runs through the driver's pageable path: measured 0.82-0.89 s for Huginn-0125's
    7.1 GB on the H200) with every piece hashed as it is read (``read_checked``), then, once
    the digest matched, handed to ``load`` as {name: tensor} views of the buffer. False when
    this host has no copy or it was refused (logged with its pieces; nothing loaded: read the
    directory), True once loaded. Whatever ``load`` raises is raised."""

    def opener(a: WeightAnnounce, path: Path) -> Any:
        buf = buffer(a.total_bytes)
        with _refusing(a, path):
            read_checked(a, path, buf)
        return buf

    found = _open_local(announce, root, opener)
    if found is None:
        return False
    path, buf = found
    load(state_from_blob(memoryview(buf).cast("B"), announce.tensors, verify=False, copy=False))
    counts["shm_loaded"] += 1
    log.info("weights v%d read from %s into the staging buffer, digest checked",
             announce.version, path)  # fmt: skip
    return True


class ShmRefused(WeightsRefused):
    """``load_mapped``: the copy's digest did not match after ``load`` had run: what was loaded
    is unchecked and must be replaced from a checked source (the one refusal a caller handles
    apart: weights.verified.VerifiedWeights.load_local_copy's)."""


def load_mapped(
    announce: WeightAnnounce, load: Callable[[Mapping[str, Any]], object],
    root: str | os.PathLike[str] | None = None,
) -> bool:  # fmt: skip
    """This host's shared-memory copy of an announced directory handed to ``load`` (the
    engine's copy into its parameters, e.g. to the GPU) WHILE its digest is checked on other
    threads, instead of checked first and copied after (measured: 7.1 GB checked in 0.41 s,
    then copied to the H200 in 0.79 s). ``load`` gets {name: tensor} views of the mapped
    pages (unchecked); the caller must serve nothing it loaded before this returns (the
    engines hold their lock). Returns False when this host has no copy (nothing loaded: read
    the directory), True once loaded and the digest matched; raises ``ShmRefused`` when it
    did not (pieces named; logged, counted shm_refused): ``load`` has run on unchecked bytes,
    the caller reloads from the directory (checked as read) or stops serving. A copy refused
    before ``load`` (its size) returns False. Whatever ``load`` raises is raised after the
    check has finished."""
    found = _open_local(announce, root, _map)
    if found is None:
        return False
    path, mapping = found
    bad: ValueError | None = None
    try:
        with ThreadPoolExecutor(1) as one:
            check = one.submit(check_blob, announce, mapping)
            try:
                load(state_from_blob(mapping, announce.tensors, verify=False, copy=False))  # type: ignore[arg-type]  # a writable buffer
            finally:
                bad = check.exception()  # type: ignore[assignment]  # waits for the check
    finally:
        try:
            mapping.close()
        except BufferError:  # ``load`` kept a view: unmapped when it dies
            pass
    if bad is not None:
        counts["shm_refused"] += 1
        msg = f"weights v{announce.version} in {path}: {bad}"
        log.error("shared-memory copy refused after it was loaded: %s; the loaded tensors "
                  "are replaced from the directory %s", msg, announce.path)  # fmt: skip
        raise ShmRefused(msg)
    counts["shm_loaded"] += 1
    log.info("weights v%d loaded from %s while its digest was checked: match",
             announce.version, path)  # fmt: skip
    return True


def _open_local(
    announce: WeightAnnounce, root: str | os.PathLike[str] | None,
    opener: Callable[[WeightAnnounce, Path], _T],
) -> tuple[Path, _T] | None:  # fmt: skip
    """(this host's file of ``announce``, ``opener``'s result on it), or None when there is
    no file (counted shm_absent) or ``opener`` refused it (WeightsRefused: counted
    shm_refused, logged; the caller reads the directory, its digest checked as it is read)."""
    try:
        path = shm_file(announce.path, root)
    except ValueError:
        return None
    if not path.exists():
        counts["shm_absent"] += 1
        return None
    try:
        return path, opener(announce, path)
    except WeightsRefused as e:
        counts["shm_refused"] += 1
        log.error("shared-memory copy refused: %s; loading the directory %s instead "
                  "(its digest checked as it is read)", e, announce.path)  # fmt: skip
        return None


def remove_shm(path: str | os.PathLike[str]) -> None:
    """Delete a version's file (mapped copies stay valid until unmapped)."""
    Path(path).unlink(missing_ok=True)


def mapped_copy(
    announce: WeightAnnounce, root: str | os.PathLike[str] | None = None
) -> mmap.mmap | None:
    """This host's shared-memory copy of an announced directory, mapped and checked (module
    docstring); None when there is none (the caller reads the directory) or it was refused
    (logged with the pieces that differ; the caller reads the directory, checked as read)."""
    found = _open_local(announce, root, open_shm)
    if found is None:
        return None
    path, mapping = found
    counts["shm_loaded"] += 1
    log.info("weights v%d mapped from %s, digest checked", announce.version, path)
    return mapping


class ShmPublisher(WeightPublisher):
    """publish.transport=shm, learner side (module docstring): shared_fs's announce of the
    directory, and each version's blob once in this host's /dev/shm."""

    def __init__(self, endpoint: LearnerSide, weights_root: Path, *, keep: int,
                 root: str | os.PathLike[str] | None = None, **kw: Any) -> None:  # fmt: skip
        """``weights_root``: RUN_DIR/weights (the files are named from its directories);
        ``keep``: publish.keep; ``root``: the shared-memory directory (default /dev/shm)."""
        super().__init__(endpoint, chunked=False, **kw)
        self.weights_root, self.keep, self.root = Path(weights_root), keep, root

    def prepare(self, pub: Publication) -> Publication:
        """``pub``'s blob into its /dev/shm file (``publish_shm``; its seconds in
        ``pub.stage_s["shm_write"]``), on the thread that finished it."""
        t0 = time.perf_counter()
        publish_shm(pub, self.root)
        pub.stage_s["shm_write"] = time.perf_counter() - t0
        return super().prepare(pub)

    def publish(self, pub: Publication) -> WeightAnnounce:
        """Announce ``pub``'s directory, then keep the newest ``keep`` files (bounded like the
        directories)."""
        ann = super().publish(pub)
        prune_shm(self.weights_root, pub.version, self.keep, self.root)
        return ann

    def close(self) -> None:
        """Remove every file of this run (a generator still mapping one keeps its pages)."""
        super().close()
        prune_shm(self.weights_root, 1 << 62, 0, self.root)


def shm_publisher(endpoint: LearnerSide, settings: PublishSettings, run_dir: Path) -> ShmPublisher:
    """publish.transport=shm: shared_fs's announce, and each version once in /dev/shm."""
    return ShmPublisher(endpoint, Path(run_dir) / "weights", keep=settings.keep,
                        chunk_bytes=settings.chunk_bytes, window=settings.window,
                        retry_delay_s=RETRY_DELAY_S)  # fmt: skip


__all__ = [
    "SHM_DIR",
    "ShmPublisher",
    "ShmRefused",
    "load_mapped",
    "load_staged",
    "mapped_copy",
    "open_shm",
    "prune_shm",
    "publish_shm",
    "read_checked",
    "remove_shm",
    "shm_file",
    "shm_path",
    "shm_publisher",
    "shm_versions",
    "write_shm",
]
