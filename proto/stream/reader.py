"""Reading rollout streams, also while their writer appends (see :mod:`proto.stream.writer`)."""

from __future__ import annotations

import bisect
import fcntl
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from proto.stream.format import (
    CRC,
    FRAME_HEAD,
    FRAME_HEADER_SIZE,
    FRAME_MAGIC,
    LOCK_NAME,
    SEGMENT_HEADER_SIZE,
    SegmentScan,
    StreamCorruptError,
    StreamError,
    check_stream_dir,
    list_segments,
    new_entries,
    scan_segment,
    scan_tail,
    segment_name,
)

_MAX_OPEN_SEGMENTS = 16


@dataclass(frozen=True)
class Frame:
    """One frame read back: ``payload`` at ``seq``, found in ``segment`` at byte ``offset``."""

    seq: int
    payload: bytes
    segment: int
    offset: int

    @property
    def frame_bytes(self) -> int:
        """Bytes the frame takes on disk (header + payload)."""
        return FRAME_HEADER_SIZE + len(self.payload)


class StreamReader:
    """Reads a stream, also while its writer appends (from any process); never modifies it.

    It sees every frame the writer has flushed; ``refresh`` (called by ``get`` for an
    unknown seq and by ``iter``) picks up new frames and segments. A torn or in-flight
    frame at the tail is not returned: the reader stops before it (``torn_tail`` says why).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        check_stream_dir(self.path, create=False)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._segs: list[SegmentScan] = []
        self._keys: list[int] = []
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    # -- state ---------------------------------------------------------------------------
    @property
    def first_seq(self) -> int | None:
        return next((s.seqs[0] for s in self._segs if s.seqs), None)

    @property
    def last_seq(self) -> int | None:
        return next((s.seqs[-1] for s in reversed(self._segs) if s.seqs), None)

    @property
    def segments(self) -> list[SegmentScan]:
        """Per-segment state as of the last refresh (do not modify)."""
        return list(self._segs)

    @property
    def torn_tail(self) -> str | None:
        """Why the bytes after the last intact frame are not a frame (None: there are none)."""
        return self._segs[-1].torn if self._segs else None

    def __len__(self) -> int:
        return sum(len(s.seqs) for s in self._segs)

    def writer_active(self) -> bool:
        """True while a StreamWriter holds this stream open."""
        try:
            fd = os.open(self.path / LOCK_NAME, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing also drops a shared lock we got
        return False

    # -- reading -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up frames flushed (and segments created) since the last call."""
        nums = list_segments(self.path)
        if not nums:
            raise StreamError(f"{self.path}: not a looprl stream (no segment-NNNNNNNN.lrs files)")
        known = self._segs[-1].number if self._segs else None
        if known is not None and known not in nums:
            raise StreamError(f"{self.path}: {segment_name(known)} vanished while reading")
        new = [n for n in nums if known is None or n > known]
        if self._segs:
            cur = self._segs[-1]
            if cur.end < SEGMENT_HEADER_SIZE:  # its header was not complete last time
                self._segs.pop()
                new.insert(0, cur.number)
            else:
                prev = self._prev_last(len(self._segs) - 1)
                cur.end, cur.size, cur.torn = scan_tail(
                    self._fd(cur.number),
                    cur.path,
                    cur.end,
                    cur.last_seq if cur.seqs else prev,
                    cur.seqs,
                    cur.offsets,
                    final=bool(new),
                )
        for i, n in enumerate(new):
            prev = self._prev_last(len(self._segs))
            fd = self._fd(n)
            self._segs.append(scan_segment(fd, self.path, n, prev, final=i < len(new) - 1))
        self._rekey()

    def get(self, seq: int) -> bytes:
        """Payload of frame ``seq``; KeyError if the stream (as flushed so far) lacks it."""
        for attempt in range(2):
            si, ei = self._locate(seq)
            if ei < len(self._segs[si].seqs) and self._segs[si].seqs[ei] == seq:
                return self._read(si, ei).payload
            if attempt == 0:
                self.refresh()
        raise KeyError(
            f"seq {seq} is not in stream {self.path} (holds {len(self)} frames, "
            f"seqs {self.first_seq}..{self.last_seq})"
        )

    def iter(
        self,
        start_seq: int = 0,
        *,
        follow: bool = False,
        timeout: float | None = None,
        poll_s: float = 0.05,
    ) -> Iterator[Frame]:
        """Frames with seq >= ``start_seq`` in order.

        ``follow=False``: the frames flushed when iteration starts. ``follow=True``: keep
        tailing; stop after ``timeout`` seconds without a new frame (None: never stop).
        """
        self.refresh()
        si, ei = self._locate(start_seq)
        idle_since = time.monotonic()
        while True:
            while True:
                seg = self._segs[si]
                if ei < len(seg.seqs):
                    yield self._read(si, ei)
                    ei += 1
                    idle_since = time.monotonic()
                elif si + 1 < len(self._segs):
                    si, ei = si + 1, 0
                else:
                    break
            if not follow:
                return
            if timeout is not None and time.monotonic() - idle_since >= timeout:
                return
            time.sleep(poll_s)
            self.refresh()

    def verify(self) -> int:
        """Re-read every frame of every segment, ignoring the indexes; returns the count.

        Raises StreamCorruptError for damage anywhere but a torn tail.
        """
        total, prev = 0, None
        for i, seg in enumerate(self._segs):
            seqs, offs = new_entries(), new_entries()
            if seg.end >= SEGMENT_HEADER_SIZE:
                scan_tail(
                    self._fd(seg.number),
                    seg.path,
                    SEGMENT_HEADER_SIZE,
                    prev,
                    seqs,
                    offs,
                    final=i < len(self._segs) - 1,
                )
            total += len(seqs)
            prev = seqs[-1] if seqs else prev
        return total

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _fd(self, number: int) -> int:
        fd = self._fds.get(number)
        if fd is not None:
            self._fds.move_to_end(number)
            return fd
        fd = os.open(self.path / segment_name(number), os.O_RDONLY)
        self._fds[number] = fd
        if len(self._fds) > _MAX_OPEN_SEGMENTS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _rekey(self) -> None:
        """Bisect keys: last seq of each segment (an empty one repeats its predecessor's)."""
        self._keys = []
        for s in self._segs:
            self._keys.append(s.seqs[-1] if s.seqs else (self._keys[-1] if self._keys else -1))

    def _prev_last(self, i: int) -> int | None:
        """Last seq of the segments before index ``i``."""
        return next((s.seqs[-1] for s in reversed(self._segs[:i]) if s.seqs), None)

    def _locate(self, seq: int) -> tuple[int, int]:
        """(segment index, entry index) of the first known frame with seq >= ``seq``."""
        si = bisect.bisect_left(self._keys, seq)
        if si == len(self._segs):
            return si - 1, len(self._segs[-1].seqs)
        return si, bisect.bisect_left(self._segs[si].seqs, seq)

    def _read(self, si: int, ei: int) -> Frame:
        for attempt in range(2):
            seg = self._segs[si]
            seq, off = seg.seqs[ei], seg.offsets[ei]
            end = seg.offsets[ei + 1] if ei + 1 < len(seg.offsets) else seg.end
            buf = os.pread(self._fd(seg.number), end - off, off)
            if len(buf) == end - off >= FRAME_HEADER_SIZE:
                magic, _, _, _, fseq, length = FRAME_HEAD.unpack_from(buf)
                (crc,) = CRC.unpack_from(buf, FRAME_HEAD.size)
                body = memoryview(buf)[FRAME_HEADER_SIZE:]
                if (
                    magic == FRAME_MAGIC
                    and fseq == seq
                    and length == len(body)
                    and crc == _crc(buf, body)
                ):
                    return Frame(seq, bytes(body), seg.number, off)
            if attempt == 0:  # the index lied or the data changed: rescan from the data
                fresh = scan_segment(
                    self._fd(seg.number),
                    self.path,
                    seg.number,
                    self._prev_last(si),
                    final=si < len(self._segs) - 1,
                    use_index=False,
                )
                self._segs[si] = fresh
                self._rekey()
                ei = bisect.bisect_left(fresh.seqs, seq)
                if ei >= len(fresh.seqs) or fresh.seqs[ei] != seq:
                    break
        raise StreamCorruptError(self._segs[si].path, off, f"frame seq {seq} fails its checks")


def _crc(buf: bytes, body: memoryview) -> int:
    return zlib.crc32(body, zlib.crc32(memoryview(buf)[: FRAME_HEAD.size]))
