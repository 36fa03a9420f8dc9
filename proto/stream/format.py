"""On-disk layout of rollout stream files: headers, frame checks, scanning and the index.

A stream is a directory::

    LOCK                    single-writer lock (fcntl.flock), holds the writer's pid
    segment-00000000.lrs    segment header, then frames, append-only
    segment-00000000.idx    sidecar index: fixed-size (seq, offset) entries, rebuildable
    segment-00000001.lrs    ...

Segment header (24 bytes, little-endian)::

    magic b"LRSTREAM" | version u16 | flags u16 | segment number u32 | reserved u32 | crc32 u32

Frame (24-byte header + payload)::

    magic b"LRSF" | version u8 | flags u8 | reserved u16 | seq u64 | length u32 | crc32 u32
    payload (length bytes, opaque: an encoded + compressed proto message)

The crc32 (zlib) covers the first 20 header bytes and the payload. Index entries are
``(seq u64, offset u64)`` of each frame; the segment data is the source of truth and an
index that disagrees with it is ignored (readers) or rebuilt (writer, ``recover``).

Everything here only reads; repairs live in :mod:`proto.stream.writer`.
"""

from __future__ import annotations

import os
import re
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEGMENT_MAGIC = b"LRSTREAM"
FRAME_MAGIC = b"LRSF"
FORMAT_VERSION = 1
FRAME_VERSION = 1

SEGMENT_HEAD = struct.Struct("<8sHHII")  # magic, version, flags, segment number, reserved
FRAME_HEAD = struct.Struct("<4sBBHQI")  # magic, version, flags, reserved, seq, length
CRC = struct.Struct("<I")
SEGMENT_HEADER_SIZE = SEGMENT_HEAD.size + CRC.size  # 24
FRAME_HEADER_SIZE = FRAME_HEAD.size + CRC.size  # 24
INDEX_ENTRY_SIZE = 16  # (seq u64, offset u64), little-endian
MAX_PAYLOAD = (1 << 32) - 1
MAX_SEQ = (1 << 64) - 1

LOCK_NAME = "LOCK"
_SEGMENT_RE = re.compile(r"^segment-(\d{8})\.lrs$")
_SCAN_CHUNK = 1 << 20


class StreamError(ValueError):
    """A path is not a usable stream: wrong layout, magic, version, or a usage error."""


class StreamCorruptError(StreamError):
    """A frame that is not the tail of the stream is damaged; names the segment and offset."""

    def __init__(self, path: Path, offset: int, what: str) -> None:
        super().__init__(
            f"{path}: corrupt stream data at offset {offset}: {what} (only the tail of the "
            "last segment may be torn; this frame is followed by valid data or a later "
            "segment, so it is not skipped)"
        )
        self.path = path
        self.offset = offset
        self.what = what


class SegmentHeaderError(StreamCorruptError):
    """A segment header fails its checksum: damage, not another format. ``what`` names each
    header field and byte that differs from the header the segment's name implies."""

    def __init__(self, path: Path, offset: int, what: str) -> None:
        StreamError.__init__(self, f"{path}: damaged segment header (checksum mismatch): {what}")
        self.path = path
        self.offset = offset
        self.what = what


class StreamFormatError(StreamError):
    """A segment written whole (its header checksum holds) in a format this build does not
    read: another format version, or flags it does not know."""


class StreamLockedError(StreamError):
    """Another writer holds the stream's lock file."""


def segment_name(number: int) -> str:
    return f"segment-{number:08d}.lrs"


def index_name(number: int) -> str:
    return f"segment-{number:08d}.idx"


def list_segments(root: Path) -> list[int]:
    """Segment numbers in ``root``, ascending; raises StreamError if one is missing."""
    nums = sorted(int(m.group(1)) for n in os.listdir(root) if (m := _SEGMENT_RE.match(n)))
    for a, b in zip(nums, nums[1:]):
        if b != a + 1:
            raise StreamError(
                f"{root}: segment {segment_name(a + 1)} is missing (found {segment_name(a)} "
                f"and {segment_name(b)}; segments must be numbered without gaps)"
            )
    return nums


def check_stream_dir(root: Path, *, create: bool) -> None:
    """Raise StreamError unless ``root`` is (or, with ``create``, may become) a stream."""
    if root.exists() and not root.is_dir():
        raise StreamError(f"{root}: is a file; a stream is a directory of segment-*.lrs files")
    if not root.exists():
        if not create:
            raise StreamError(f"{root}: no such stream directory")
        root.mkdir(parents=True)
    names = os.listdir(root)
    if not any(n.startswith("segment-") and n.endswith(".lrs") for n in names):
        foreign = [n for n in names if n != LOCK_NAME and not n.startswith("segment-")]
        if not create or foreign:
            raise StreamError(
                f"{root}: not a looprl stream (no segment-NNNNNNNN.lrs files"
                + (f"; holds {sorted(foreign)[:5]}" if foreign else "")
                + ")"
            )


def encode_segment_header(number: int) -> bytes:
    head = SEGMENT_HEAD.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, number, 0)
    return head + CRC.pack(zlib.crc32(head))


HEADER_FIELDS = (
    ("magic", 0, 8),
    ("format version", 8, 10),
    ("flags", 10, 12),
    ("segment number", 12, 16),
    ("reserved", 16, 20),
    ("checksum", 20, 24),
)
"""(name, first byte, end) of each segment header field."""


def _field_value(name: str, raw: bytes) -> str:
    if name == "magic":
        return repr(raw)
    value = int.from_bytes(raw, "little")
    return f"{value:#010x}" if name == "checksum" else str(value)


def header_damage(buf: bytes, number: int) -> tuple[int, str]:
    """Where the 24 header bytes ``buf`` of segment ``number`` differ from the header it
    should have (every field is known: the magic, version 1, flags 0, the number from the file
    name, reserved 0, their checksum): (first differing byte, one line naming each field and
    byte that differs, found vs expected)."""
    want = encode_segment_header(number)
    diffs = [i for i in range(SEGMENT_HEADER_SIZE) if buf[i] != want[i]]
    parts = []
    for name, a, b in HEADER_FIELDS:
        d = [i for i in diffs if a <= i < b]
        if not d:
            continue
        if len(d) == 1:
            where = f"byte {d[0]} is {buf[d[0]]:#04x}, expected {want[d[0]]:#04x}"
        else:
            where = f"{len(d)} of bytes {a}..{b - 1} differ"
        found, expected = _field_value(name, buf[a:b]), _field_value(name, want[a:b])
        parts.append(f"{where} ({name}, bytes {a}..{b - 1}: {found}, expected {expected})")
    return (diffs[0] if diffs else 0), "; ".join(parts)


def check_segment_header(buf: bytes, path: Path, number: int) -> None:
    """Raise StreamError unless ``buf`` is a valid header of segment ``number``: a
    SegmentHeaderError (a StreamCorruptError) when its checksum fails (damage, naming the bytes
    that differ), StreamFormatError for another version or flags, StreamError for a file that
    is not a stream segment or whose header names another segment."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise StreamError(
            f"{path}: {len(buf)} bytes is too short for a stream segment header "
            f"({SEGMENT_HEADER_SIZE} bytes expected)"
        )
    magic, version, flags, seg_no, _ = SEGMENT_HEAD.unpack_from(buf)
    (crc,) = CRC.unpack_from(buf, SEGMENT_HEAD.size)
    if crc != zlib.crc32(buf[: SEGMENT_HEAD.size]):
        offset, what = header_damage(bytes(buf[:SEGMENT_HEADER_SIZE]), number)
        raise SegmentHeaderError(path, offset, what)
    if magic != SEGMENT_MAGIC:  # written whole, but not by a looprl stream writer
        raise StreamError(
            f"{path}: not a looprl stream segment (magic {magic!r}, expected {SEGMENT_MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise StreamFormatError(
            f"{path}: stream format version {version} is not supported "
            f"(this build reads version {FORMAT_VERSION})"
        )
    if flags != 0:
        raise StreamFormatError(f"{path}: unsupported segment flags {flags:#x} (expected 0)")
    if seg_no != number:
        raise StreamError(
            f"{path}: header says segment {seg_no} but the file name says segment {number}"
        )


def frame_header(seq: int, payload: bytes | memoryview) -> bytes:
    """The 24-byte header of a frame holding ``payload`` at sequence number ``seq``."""
    head = FRAME_HEAD.pack(FRAME_MAGIC, FRAME_VERSION, 0, 0, seq, len(payload))
    return head + CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


class Window:
    """Reads of one file through a large buffer, so scanning small frames costs few syscalls."""

    def __init__(self, fd: int, chunk: int = _SCAN_CHUNK) -> None:
        self.fd = fd
        self.chunk = chunk
        self.base = 0
        self.buf = memoryview(b"")

    def read(self, offset: int, n: int) -> memoryview:
        """Up to ``n`` bytes at ``offset`` (short only at the end of the file)."""
        s = offset - self.base
        if 0 <= s and s + n <= len(self.buf):
            return self.buf[s : s + n]
        if n >= self.chunk:
            return memoryview(os.pread(self.fd, n, offset))
        self.buf = memoryview(os.pread(self.fd, self.chunk, offset))
        self.base = offset
        return self.buf[:n]


def check_frame(win: Window, offset: int, size: int, path: Path) -> tuple[int, int] | str:
    """``(seq, length)`` of the intact frame at ``offset``, or why it is not one.

    A frame whose checksum holds but whose version or flags this build does not know
    raises StreamError (that is a newer format, not damage).
    """
    have = size - offset
    if have < FRAME_HEADER_SIZE:
        return f"short frame header ({have} of {FRAME_HEADER_SIZE} bytes)"
    head = win.read(offset, FRAME_HEADER_SIZE)
    if len(head) < FRAME_HEADER_SIZE:
        return f"short frame header ({len(head)} of {FRAME_HEADER_SIZE} bytes)"
    magic, version, flags, _, seq, length = FRAME_HEAD.unpack_from(head)
    if magic != FRAME_MAGIC:
        return f"bad frame magic {bytes(magic)!r} (expected {FRAME_MAGIC!r})"
    if length > have - FRAME_HEADER_SIZE:
        return f"short payload ({have - FRAME_HEADER_SIZE} of {length} bytes)"
    payload = win.read(offset + FRAME_HEADER_SIZE, length)
    if len(payload) < length:
        return f"short payload ({len(payload)} of {length} bytes)"
    (crc,) = CRC.unpack_from(head, FRAME_HEAD.size)
    if crc != zlib.crc32(payload, zlib.crc32(head[: FRAME_HEAD.size])):
        return "frame checksum mismatch"
    if version != FRAME_VERSION or flags != 0:
        raise StreamError(
            f"{path}: frame at offset {offset} has version {version}, flags {flags:#x}; "
            f"this build reads frame version {FRAME_VERSION} with flags 0"
        )
    return seq, length


def find_frame(fd: int, start: int, size: int, path: Path) -> int | None:
    """Offset of the first intact frame at or after ``start``, if any (a resync search)."""
    win = Window(fd)
    pos = start
    while pos < size:
        block = os.pread(fd, min(_SCAN_CHUNK, size - pos), pos)
        if not block:
            return None
        i = block.find(FRAME_MAGIC)
        while i >= 0:
            if isinstance(check_frame(win, pos + i, size, path), tuple):
                return pos + i
            i = block.find(FRAME_MAGIC, i + 1)
        pos += max(1, len(block) - len(FRAME_MAGIC) + 1)
    return None


def new_entries() -> array:
    return array("Q")


@dataclass
class SegmentScan:
    """What one segment holds, as far as it is intact.

    ``seqs``/``offsets`` list every complete frame; ``end`` is the offset just after the
    last one; ``torn`` says why the bytes in ``[end, size)`` are not a frame (tail only).
    ``index_kept`` entries of the index file agree with the data (a prefix of ``seqs``);
    ``index_state`` is ``ok`` (prefix valid), ``partial`` (a torn last entry), ``missing``
    or ``invalid`` (disagrees with the data; ignored).
    """

    number: int
    path: Path
    size: int
    seqs: array
    offsets: array
    end: int
    torn: str | None
    index_kept: int
    index_state: str

    @property
    def last_seq(self) -> int | None:
        return self.seqs[-1] if self.seqs else None


def _read_index(
    fd: int, idx_path: Path, size: int, prev_seq: int | None, path: Path
) -> tuple[array, array, str, int]:
    """Entries of an index file that agree with the data, its state and the data end."""
    seqs, offs = new_entries(), new_entries()
    try:
        data = idx_path.read_bytes()
    except FileNotFoundError:
        return seqs, offs, "missing", SEGMENT_HEADER_SIZE
    n = len(data) // INDEX_ENTRY_SIZE
    state = "partial" if len(data) % INDEX_ENTRY_SIZE else "ok"
    if n == 0:
        return seqs, offs, state, SEGMENT_HEADER_SIZE
    table = np.frombuffer(data, "<u8", count=2 * n).reshape(n, 2)
    s_col, o_col = table[:, 0], table[:, 1]
    ok = (
        int(o_col[0]) == SEGMENT_HEADER_SIZE
        and bool(np.all(s_col[1:] > s_col[:-1]))
        and bool(np.all(o_col[1:] > o_col[:-1]))
        and bool(np.all(o_col[1:] - o_col[:-1] >= FRAME_HEADER_SIZE))
        and int(o_col[-1]) + FRAME_HEADER_SIZE <= size
        and (prev_seq is None or int(s_col[0]) > prev_seq)
    )
    end = SEGMENT_HEADER_SIZE
    if ok:
        got = check_frame(Window(fd), int(o_col[-1]), size, path)
        ok = isinstance(got, tuple) and got[0] == int(s_col[-1])
        if isinstance(got, tuple):
            end = int(o_col[-1]) + FRAME_HEADER_SIZE + got[1]
    if not ok:
        return seqs, offs, "invalid", SEGMENT_HEADER_SIZE
    native = "<u8" if sys.byteorder == "little" else ">u8"
    seqs.frombytes(np.ascontiguousarray(s_col, dtype=native).tobytes())
    offs.frombytes(np.ascontiguousarray(o_col, dtype=native).tobytes())
    return seqs, offs, state, end


def scan_tail(
    fd: int,
    path: Path,
    start: int,
    prev_seq: int | None,
    seqs: array,
    offs: array,
    *,
    final: bool,
) -> tuple[int, int, str | None]:
    """Append the intact frames from ``start`` on to ``seqs``/``offs``.

    Returns ``(end, size, torn)``. Damage that is not the tail (a later intact frame
    exists, or ``final``: a later segment exists) raises StreamCorruptError. Safe against
    a writer appending concurrently: it only ever sees a growing prefix.
    """
    pos = start
    while True:
        size = os.fstat(fd).st_size
        if size < pos:
            raise StreamError(
                f"{path}: shrank to {size} bytes, below the {pos} bytes already read "
                "(was the stream rewritten while being read?)"
            )
        win = Window(fd)
        while True:
            got = check_frame(win, pos, size, path)
            if isinstance(got, str):
                reason = got
                break
            seq, length = got
            if prev_seq is not None and seq <= prev_seq:
                raise StreamCorruptError(
                    path, pos, f"sequence number {seq} does not increase (previous {prev_seq})"
                )
            seqs.append(seq)
            offs.append(pos)
            prev_seq = seq
            pos += FRAME_HEADER_SIZE + length
        if pos == size:
            return pos, size, None
        later = find_frame(fd, pos + 1, size, path)
        if later is None and not final:
            return pos, size, reason
        # A later frame was complete when we read it, so a live writer finished this one
        # before: look again (it may have been in flight during the first read).
        if isinstance(check_frame(Window(fd), pos, os.fstat(fd).st_size, path), tuple):
            continue
        where = f"next intact frame at offset {later}" if later is not None else "later segment"
        raise StreamCorruptError(path, pos, f"{reason}; {where}")


def scan_segment(
    fd: int, root: Path, number: int, prev_seq: int | None, *, final: bool, use_index: bool = True
) -> SegmentScan:
    """Read the header, the index and the unindexed tail of segment ``number`` (read only).

    ``final``: a later segment exists, so a torn tail is damage. ``use_index=False``
    ignores the index file and scans every frame.
    """
    path = root / segment_name(number)
    size = os.fstat(fd).st_size
    if size < SEGMENT_HEADER_SIZE:
        if final:
            raise StreamCorruptError(path, 0, f"segment header truncated to {size} bytes")
        return SegmentScan(
            number, path, size, new_entries(), new_entries(), 0, "short segment header", 0, "ok"
        )
    check_segment_header(os.pread(fd, SEGMENT_HEADER_SIZE, 0), path, number)
    if use_index:
        seqs, offs, state, end = _read_index(fd, root / index_name(number), size, prev_seq, path)
    else:
        seqs, offs, state, end = new_entries(), new_entries(), "invalid", SEGMENT_HEADER_SIZE
    kept = len(seqs)
    last = seqs[-1] if seqs else prev_seq
    end, size, torn = scan_tail(fd, path, end, last, seqs, offs, final=final)
    return SegmentScan(number, path, size, seqs, offs, end, torn, kept, state)


def index_bytes(seqs: array, offs: array, start: int = 0) -> bytes:
    """Index file bytes for entries ``start:`` of ``seqs``/``offs``."""
    table = np.empty((len(seqs) - start, 2), "<u8")
    table[:, 0] = np.frombuffer(seqs, np.uint64)[start:]
    table[:, 1] = np.frombuffer(offs, np.uint64)[start:]
    return table.tobytes()
