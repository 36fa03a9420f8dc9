"""Writing a rollout stream (package doc: proto.stream): ``StreamWriter``, the one writer of
a stream, and ``recover``, which repairs one without appending (cuts a torn tail, rebuilds
indexes, salvages the intact frames around damage with :mod:`proto.stream.salvage`); both
report a ``RecoveryReport``."""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Literal

from proto.fileio import fsync_path
from proto.stream.format import (
    FRAME_HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    LOCK_NAME,
    MAX_PAYLOAD,
    MAX_SEQ,
    SEGMENT_HEADER_SIZE,
    SegmentScan,
    StreamError,
    StreamLockedError,
    check_stream_dir,
    encode_segment_header,
    frame_header,
    index_bytes,
    index_name,
    list_segments,
    new_entries,
    scan_segment,
    segment_name,
)
from proto.stream.salvage import LostRange, Repair, salvage, survey

FsyncMode = Literal["always", "batch", "never"]
FSYNC_MODES: tuple[str, ...] = ("always", "batch", "never")
MIN_SEGMENT_BYTES = 256
_LOCK_TRIES = 10  # x 20 ms: rides out a reader's brief shared-lock probe (writer_active)
_IOV_MAX = 512


@dataclass(frozen=True)
class RecoveryReport:
    """What opening a stream for writing (or :func:`recover`) found and repaired."""

    path: Path
    segments: int  # segment files after recovery
    last_seq: int | None  # last intact frame (None: no frames)
    truncated_segment: int | None  # segment whose torn tail was cut off
    truncated_offset: int | None  # new size of that segment (start of the torn frame)
    truncated_bytes: int  # bytes removed
    torn_reason: str | None  # what was wrong with the tail
    indexes_repaired: tuple[int, ...]  # segments whose index was rebuilt or completed
    frames: int = 0  # intact frames in the stream after recovery
    lost: tuple[LostRange, ...] = ()  # damaged ranges that held frames, dropped (not the tail)
    backup: Path | None = None  # where recover kept the original files of damaged segments
    checked_all: bool = False  # every frame's checksum was verified (recover), not only the tail
    repaired: tuple[Repair, ...] = ()  # damage that held no frame: headers rewritten, ...

    @property
    def lost_frames(self) -> int | None:
        """Frames lost in ``lost`` (0: nothing lost; None: a range's count is unknown)."""
        counts = [r.frame_count for r in self.lost]
        return None if None in counts else sum(c for c in counts if c is not None)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (paths as strings, lost ranges and repairs as dicts); ``lost``
        is empty exactly when nothing was lost (the text report's "nothing lost")."""
        out: dict[str, object] = {}
        for k, v in vars(self).items():
            out[k] = str(v) if isinstance(v, Path) else v
        out["lost"] = [r.as_dict() for r in self.lost]
        out["lost_bytes"] = sum(r.bytes for r in self.lost)
        out["lost_frames"] = self.lost_frames
        out["repaired"] = [r.as_dict() for r in self.repaired]
        return out


def _write_all(fd: int, bufs: list[bytes]) -> None:
    """writev every buffer, resuming after partial writes."""
    i = 0
    while i < len(bufs):
        group = bufs[i : i + _IOV_MAX]
        n = os.writev(fd, group)
        for b in group:
            if n >= len(b):
                n -= len(b)
                i += 1
            else:
                bufs[i] = b[n:]
                break


def _lock(root: Path) -> int:
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == _LOCK_TRIES - 1:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise StreamLockedError(
                    f"{root}: stream is already open for writing (lock held, pid {holder}); "
                    "a stream has exactly one writer"
                ) from None
            time.sleep(0.02)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _write_index(root: Path, scan: SegmentScan, sync: bool) -> bool:
    """Make the index of ``scan``'s segment match its data; True if it changed."""
    idx = root / index_name(scan.number)
    kept = scan.index_kept
    if scan.index_state in ("missing", "invalid"):
        tmp = idx.with_name(idx.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, [index_bytes(scan.seqs, scan.offsets)])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, idx)
        return True
    if scan.index_state == "partial" or len(scan.seqs) > kept:
        fd = os.open(idx, os.O_WRONLY)
        try:
            os.ftruncate(fd, kept * INDEX_ENTRY_SIZE)
            os.pwrite(fd, index_bytes(scan.seqs, scan.offsets, kept), kept * INDEX_ENTRY_SIZE)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True
    return False


def _recover_locked(root: Path, *, sync: bool) -> tuple[RecoveryReport, SegmentScan | None]:
    """Cut a torn tail off the last segment and repair indexes; the caller holds the lock."""
    for name in os.listdir(root):
        if name.startswith("segment-") and name.endswith(".tmp"):
            os.unlink(root / name)  # a segment or index creation that never completed
    nums = list_segments(root)
    prev: int | None = None
    repaired: list[int] = []
    cut: tuple[int, int, int, str] | None = None
    scan: SegmentScan | None = None
    frames = 0
    for i, n in enumerate(nums):
        fd = os.open(root / segment_name(n), os.O_RDWR)
        try:
            scan = scan_segment(fd, root, n, prev, final=i < len(nums) - 1)
            if scan.end < SEGMENT_HEADER_SIZE:  # header never completed: write it again
                cut = (n, 0, scan.size, scan.torn or "")
                os.ftruncate(fd, 0)
                os.pwrite(fd, encode_segment_header(n), 0)
                scan.end = scan.size = SEGMENT_HEADER_SIZE
            elif scan.torn is not None:
                cut = (n, scan.end, scan.size - scan.end, scan.torn)
                os.ftruncate(fd, scan.end)
                scan.size = scan.end
            if cut is not None and sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if _write_index(root, scan, sync):
            repaired.append(n)
        frames += len(scan.seqs)
        prev = scan.last_seq if scan.seqs else prev
    report = RecoveryReport(
        path=root,
        segments=len(nums),
        last_seq=prev,
        truncated_segment=cut[0] if cut else None,
        truncated_offset=cut[1] if cut else None,
        truncated_bytes=cut[2] if cut else 0,
        torn_reason=cut[3] if cut else None,
        indexes_repaired=tuple(repaired),
        frames=frames,
    )
    return report, scan


def recover(
    path: str | os.PathLike[str],
    *,
    fsync: bool = True,
    check_all: bool = True,
    backup: str | os.PathLike[str] | None = None,
) -> RecoveryReport:
    """Repair a stream without appending to it (takes the writer lock).

    ``check_all`` (the default): verify every frame's checksum, ignoring the indexes, and
    rewrite each segment that holds damage to its intact frames (same bytes, same seqs);
    the original files of those segments are kept in ``backup`` (default: a new directory
    ``PATH.damaged-<time>`` beside the stream) and ``lost`` names every range dropped. A
    segment file missing between two others becomes an empty segment, so the intact
    segments around it open again; ``lost`` names it (``LostRange.missing``) with the seqs
    it held.
    Then, as without it, cut a torn tail and rebuild the indexes. ``check_all=False`` only
    scans what the indexes do not cover (what ``StreamWriter`` does on open) and raises
    StreamCorruptError for damage it meets.
    """
    root = Path(path)
    check_stream_dir(root, create=False)
    lock = _lock(root)
    try:
        if not check_all:
            return _recover_locked(root, sync=fsync)[0]
        found = survey(root)
        kept = salvage(root, found, backup=Path(backup) if backup else None, sync=fsync)
        report = _recover_locked(root, sync=fsync)[0]
        report = replace(report, lost=tuple(found.lost), repaired=tuple(found.repairs),
                         backup=kept, checked_all=True)  # fmt: skip
        rewritten = {r.segment for r in found.lost} | {r.segment for r in found.repairs}
        if found.torn is not None and found.torn[0] in rewritten:  # dropped by the rewrite
            seg, off, n, why = found.torn
            report = replace(report, truncated_segment=seg, truncated_offset=off,
                             truncated_bytes=n, torn_reason=why)  # fmt: skip
        return report
    finally:
        os.close(lock)


class StreamWriter:
    """The single writer of a stream: appends frames, rolls segments, keeps the index.

    Loop: ``append`` buffers a frame (header + payload) and returns its seq; ``flush``
    writes the buffer to the segment file, fsyncs it (``fsync="batch"``), then appends the
    frames' index entries, so an index entry never points at data that is not durable.
    ``fsync="always"`` flushes inside every ``append``; ``"never"`` leaves durability to
    the OS (a process crash loses nothing that was flushed; a power cut may). The buffer
    is also written out whenever it exceeds ``buffer_bytes``. A segment is closed (flushed
    and fsync'd) before the next one is created, when a frame would take it past
    ``segment_bytes``. Invariant: seqs strictly increase across the whole stream.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        segment_bytes: int = 64 << 20,
        fsync: FsyncMode = "batch",
        start_seq: int | None = None,
        buffer_bytes: int = 1 << 20,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise StreamError(f"fsync={fsync!r} is not one of {FSYNC_MODES}")
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise StreamError(f"segment_bytes={segment_bytes} must be >= {MIN_SEGMENT_BYTES}")
        if start_seq is not None and not 0 <= start_seq <= MAX_SEQ:
            raise StreamError(f"start_seq={start_seq} must be in [0, 2**64)")
        self.path = Path(path)
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._sync = fsync != "never"
        self._buffer_bytes = buffer_bytes
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._idx_seqs = new_entries()
        self._idx_offs = new_entries()
        self._closed = True
        check_stream_dir(self.path, create=True)
        self._lock_fd = _lock(self.path)
        try:
            self.recovery, last = _recover_locked(self.path, sync=self._sync)
            self._last_seq = self.recovery.last_seq
            if start_seq is not None and self._last_seq is not None and start_seq <= self._last_seq:
                raise StreamError(
                    f"{self.path}: start_seq={start_seq} but the stream already holds seq "
                    f"{self._last_seq}; sequence numbers must increase"
                )
            if start_seq is not None:
                self._next_seq = start_seq
            else:
                self._next_seq = 0 if self._last_seq is None else self._last_seq + 1
            if last is None:
                self._segment = 0
                self._create_segment(0)
                self._written = SEGMENT_HEADER_SIZE
            else:
                self._segment = last.number
                self._written = last.end
            self._open_segment()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._closed = False

    @property
    def next_seq(self) -> int:
        """The seq the next ``append(payload)`` without ``seq`` gets."""
        return self._next_seq

    @property
    def last_seq(self) -> int | None:
        """The last appended seq (flushed or not), None for an empty stream."""
        return self._last_seq

    @property
    def segment(self) -> int:
        """Number of the segment being written."""
        return self._segment

    def append(self, payload: bytes | bytearray | memoryview, *, seq: int | None = None) -> int:
        """Buffer one frame; returns its seq (``next_seq`` unless ``seq`` is given)."""
        if self._closed:
            raise StreamError(f"{self.path}: append on a closed StreamWriter")
        data = payload if isinstance(payload, bytes) else bytes(payload)
        if len(data) > MAX_PAYLOAD:
            raise StreamError(f"payload of {len(data)} bytes exceeds the frame limit {MAX_PAYLOAD}")
        if seq is None:
            seq = self._next_seq
        elif not self._next_seq <= seq:
            raise StreamError(
                f"{self.path}: seq {seq} must be >= {self._next_seq} (last seq {self._last_seq});"
                " sequence numbers must strictly increase"
            )
        if seq > MAX_SEQ:
            raise StreamError(f"seq {seq} does not fit in 64 bits")
        size = FRAME_HEADER_SIZE + len(data)
        offset = self._written + self._pending_bytes
        if offset > SEGMENT_HEADER_SIZE and offset + size > self._segment_bytes:
            self._roll()
            offset = SEGMENT_HEADER_SIZE
        self._pending.append(frame_header(seq, data))
        self._pending.append(data)
        self._pending_bytes += size
        self._idx_seqs.append(seq)
        self._idx_offs.append(offset)
        self._last_seq = seq
        self._next_seq = seq + 1
        if self._fsync == "always":
            self.flush()
        elif self._pending_bytes >= self._buffer_bytes:
            self._write_pending()
        return seq

    def flush(self) -> None:
        """Make every appended frame visible to readers (and durable unless fsync="never")."""
        if self._closed:
            return
        self._write_pending()
        if not self._idx_seqs:
            return
        if self._sync:
            os.fdatasync(self._fd)
        _write_all(self._idx_fd, [index_bytes(self._idx_seqs, self._idx_offs)])
        self._idx_seqs = new_entries()
        self._idx_offs = new_entries()

    def close(self) -> None:
        """Flush, sync and release the lock; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            if self._sync:
                os.fsync(self._idx_fd)
        finally:
            self._closed = True
            os.close(self._fd)
            os.close(self._idx_fd)
            os.close(self._lock_fd)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _write_pending(self) -> None:
        if self._pending:
            try:
                _write_all(self._fd, self._pending)
            except OSError as e:  # e.g. disk full: the tail may be torn now; stop writing
                self._closed = True
                for fd in (self._fd, self._idx_fd, self._lock_fd):
                    os.close(fd)
                raise StreamError(
                    f"{self.path}: writing {segment_name(self._segment)} failed ({e}); the "
                    "writer is closed, frames after the last flush may be lost; reopen the "
                    "stream to cut the torn tail and continue"
                ) from e
            self._written += self._pending_bytes
            self._pending = []
            self._pending_bytes = 0

    def _roll(self) -> None:
        self.flush()
        if self._sync:
            os.fsync(self._idx_fd)
        os.close(self._fd)
        os.close(self._idx_fd)
        self._segment += 1
        self._create_segment(self._segment)
        self._written = SEGMENT_HEADER_SIZE
        self._open_segment()

    def _create_segment(self, number: int) -> None:
        final = self.path / segment_name(number)
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, encode_segment_header(number))
            if self._sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.close(os.open(self.path / index_name(number), os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        os.replace(tmp, final)
        if self._sync:
            fsync_path(self.path)

    def _open_segment(self) -> None:
        self._fd = os.open(self.path / segment_name(self._segment), os.O_WRONLY | os.O_APPEND)
        self._idx_fd = os.open(
            self.path / index_name(self._segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
