"""Checking every frame of a stream, and salvaging the intact ones around damage.

:func:`survey` reads every frame of every segment, ignoring the indexes (read only, so it
also works while a writer appends). Where a frame fails its checks it searches forward for
the next intact frame (magic, header, checksum and an increasing seq) and records the bytes
in between as a :class:`LostRange`; it never stops at the first damage. Damage that held no
frame is a :class:`Repair`, not a loss: a damaged segment header (the frames after it are
checked as usual) or bytes between two frames with consecutive seqs. Bytes after the last
intact frame of the last segment are the torn tail (``Survey.torn``), as for readers.
A segment file missing between two present ones (a gap in the numbering) is one
:class:`LostRange` with ``missing`` set: its frames are the seqs strictly between the
intact frames around it (exact from the segment's orphan index when that survived).

:func:`salvage` (called by :func:`proto.stream.writer.recover` under the writer lock) rewrites
each damaged segment in place so that it holds a new header and exactly its intact frames,
byte for byte and with their seqs, after hard-linking (or copying) the original segment and
index files into a backup directory beside the stream; a missing segment is replaced by an
empty one (header only, so the numbering has no gap and readers and writers open the stream
again; its orphan index moves to the backup). Invariant: every intact frame of the stream is still in
it afterwards, at the same seq; nothing that failed its checks is.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import time
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path

from proto.stream.format import (
    FRAME_HEAD,
    FRAME_HEADER_SIZE,
    FRAME_MAGIC,
    SEGMENT_HEADER_SIZE,
    SegmentHeaderError,
    StreamError,
    StreamFormatError,
    Window,
    check_frame,
    check_segment_header,
    encode_segment_header,
    find_frame,
    index_bytes,
    index_name,
    new_entries,
    segment_name,
)

_SEGMENT_FILE = re.compile(r"^segment-(\d{8})\.lrs$")


@dataclass(frozen=True)
class LostRange:
    """Bytes of one segment that are not intact frames, followed by an intact frame or by
    a later segment. ``after_seq``/``before_seq``: the nearest intact frames around it (None:
    none in the stream), so the frames lost had seqs strictly between them. ``frames``: the
    seqs read from the frame headers that chain exactly over the range (empty when a damaged
    header breaks the chain, and the count is then unknown). ``missing``: the numbers of
    segment files that are gone (the range covers all of them; ``offset``/``bytes`` are 0)."""

    segment: int
    offset: int
    bytes: int
    reason: str
    after_seq: int | None
    before_seq: int | None
    frames: tuple[int, ...]
    missing: tuple[int, ...] = ()

    @property
    def first_seq(self) -> int:
        """The lowest seq that may have been lost (0 when no intact frame precedes it)."""
        if self.frames:
            return self.frames[0]
        return 0 if self.after_seq is None else self.after_seq + 1

    @property
    def last_seq(self) -> int | None:
        """The highest seq that may have been lost (None: unknown, no intact frame follows)."""
        if self.frames:
            return self.frames[-1]
        return None if self.before_seq is None else self.before_seq - 1

    @property
    def frame_count(self) -> int | None:
        """Frames lost: exact when ``frames`` is known; 0 when no seq fits between the
        neighbours (consecutive seqs: the bytes held no frame); for a missing segment, the
        seqs between its neighbours (the writer numbers frames consecutively); None when
        unknown."""
        if self.frames:
            return len(self.frames)
        last = self.last_seq
        if last is not None and last < self.first_seq:
            return 0
        if self.missing and self.after_seq is not None and last is not None:
            return last - self.first_seq + 1
        return None

    @property
    def seqs(self) -> str:
        """The seqs that may have been lost, as ``"a..b"`` (``"?"``: the upper end is unknown)."""
        last = self.last_seq
        return f"{self.first_seq}..{'?' if last is None else last}"

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "segment": segment_name(self.segment),
            "offset": self.offset,
            "bytes": self.bytes,
            "reason": self.reason,
            "after_seq": self.after_seq,
            "before_seq": self.before_seq,
            "frames": len(self.frames) if self.frames else None,
            "seqs": self.seqs,
        }
        if self.missing:
            out["missing_segments"] = [segment_name(n) for n in self.missing]
            out["frames"] = self.frame_count
        return out


@dataclass(frozen=True)
class Repair:
    """Damaged bytes of one segment that held no frame, so nothing is lost by them: its header
    (``header``: rewritten by :func:`salvage`), bytes between two frames whose seqs are
    consecutive (dropped), or a missing segment whose neighbours' seqs are consecutive
    (created empty). ``reason``: what was wrong (for a header, each field and byte that
    differs, found vs expected)."""

    segment: int
    offset: int
    bytes: int
    reason: str
    header: bool = False
    missing: bool = False

    @property
    def action(self) -> str:
        if self.header:
            return "header rewritten"
        return "created empty" if self.missing else "bytes dropped"

    def as_dict(self) -> dict[str, object]:
        return {"segment": segment_name(self.segment), "offset": self.offset,
                "bytes": self.bytes, "reason": self.reason, "action": self.action,
                "frames": 0}  # fmt: skip


@dataclass
class SegmentSurvey:
    """The intact frames of one segment: seq, offset and length of each."""

    number: int
    path: Path
    size: int
    header_ok: bool
    missing: bool = False  # the segment file is gone (a gap in the numbering)
    seqs: array = field(default_factory=new_entries)
    offsets: array = field(default_factory=new_entries)
    lengths: array = field(default_factory=new_entries)
    lost: list[LostRange] = field(default_factory=list)
    repairs: list[Repair] = field(default_factory=list)


@dataclass
class Survey:
    """Every segment of a stream, checked frame by frame."""

    path: Path
    segments: list[SegmentSurvey]
    torn: tuple[int, int, int, str] | None  # (segment, offset, bytes, reason) of a torn tail

    @property
    def frames(self) -> int:
        return sum(len(s.seqs) for s in self.segments)

    @property
    def lost(self) -> list[LostRange]:
        """Ranges that held frames (or may have: their count unknown)."""
        return [r for s in self.segments for r in s.lost]

    @property
    def repairs(self) -> list[Repair]:
        """Damage that held no frame (a segment header, bytes between consecutive seqs)."""
        return [r for s in self.segments for r in s.repairs]

    @property
    def first_seq(self) -> int | None:
        return next((s.seqs[0] for s in self.segments if s.seqs), None)

    @property
    def last_seq(self) -> int | None:
        return next((s.seqs[-1] for s in reversed(self.segments) if s.seqs), None)


def _chained_headers(fd: int, start: int, end: int) -> tuple[int, ...]:
    """Seqs of frame headers that tile ``[start, end)`` exactly (unverified), else ()."""
    seqs, pos = [], start
    while pos + FRAME_HEADER_SIZE <= end:
        magic, _, _, _, seq, length = FRAME_HEAD.unpack_from(os.pread(fd, FRAME_HEAD.size, pos))
        if magic != FRAME_MAGIC or pos + FRAME_HEADER_SIZE + length > end:
            return ()
        seqs.append(seq)
        pos += FRAME_HEADER_SIZE + length
    return tuple(seqs) if pos == end else ()


def _next_intact(fd: int, start: int, size: int, prev: int | None, path: Path) -> int | None:
    """Offset of the first intact frame at or after ``start`` whose seq exceeds ``prev``."""
    while start < size:
        pos = find_frame(fd, start, size, path)
        if pos is None:
            return None
        got = check_frame(Window(fd), pos, size, path)
        if isinstance(got, tuple) and (prev is None or got[0] > prev):
            return pos
        start = pos + 1
    return None


def _survey_segment(fd: int, path: Path, number: int, prev: int | None) -> SegmentSurvey:
    size = os.fstat(fd).st_size
    seg = SegmentSurvey(number, path, size, header_ok=True)
    if size < SEGMENT_HEADER_SIZE:
        seg.header_ok = False
        return seg
    try:
        check_segment_header(os.pread(fd, SEGMENT_HEADER_SIZE, 0), path, number)
    except StreamFormatError:
        raise  # a format this build does not read: not damage
    except StreamError as e:  # damaged, or written whole for another name / by something else
        bare = size == SEGMENT_HEADER_SIZE and isinstance(e, SegmentHeaderError)
        if not bare and _next_intact(fd, SEGMENT_HEADER_SIZE, size, prev, path) is None:
            raise  # nothing intact in it: not a stream segment at all, nothing to salvage
        seg.header_ok = False
        why = str(e).removeprefix(f"{path}: ")
        seg.repairs.append(Repair(number, 0, SEGMENT_HEADER_SIZE, why, header=True))
    pos, win = SEGMENT_HEADER_SIZE, Window(fd)
    while pos < size:
        got = check_frame(win, pos, size, path)
        if isinstance(got, tuple) and (prev is None or got[0] > prev):
            seg.seqs.append(got[0])
            seg.offsets.append(pos)
            seg.lengths.append(got[1])
            prev = got[0]
            pos += FRAME_HEADER_SIZE + got[1]
            continue
        reason = got if isinstance(got, str) else f"seq {got[0]} does not increase ({prev})"
        nxt = _next_intact(fd, pos + 1, size, prev, path)
        end = size if nxt is None else nxt
        frames = _chained_headers(fd, pos, end)
        seg.lost.append(LostRange(number, pos, end - pos, reason, prev, None, frames))
        if nxt is None:
            break
        pos, win = nxt, Window(fd)
    return seg


def present_segments(root: Path) -> list[int]:
    """Numbers of the segment files in ``root``, ascending, gaps allowed."""
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := _SEGMENT_FILE.match(n)))


def missing_segments(root: str | os.PathLike[str]) -> list[int]:
    """Segment numbers missing between the first and the last present one."""
    nums = present_segments(Path(root))
    have = set(nums)
    return [n for n in range(nums[0], nums[-1] + 1) if n not in have] if nums else []


def _orphan_index(root: Path, run: list[int], prev: int | None) -> tuple[int, ...]:
    """Seqs listed by the surviving index files of the missing segments ``run`` (``()``
    unless every one of them is there and lists increasing seqs after ``prev``)."""
    seqs: list[int] = []
    for n in run:
        try:
            data = (root / index_name(n)).read_bytes()
        except FileNotFoundError:
            return ()
        if not data or len(data) % 16:
            return ()
        seqs.extend(int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 16))
    chain = [prev, *seqs] if prev is not None else seqs
    if any(b <= a for a, b in zip(chain, chain[1:])):
        return ()
    return tuple(seqs)


def survey(path: str | os.PathLike[str]) -> Survey:
    """Check every frame of the stream at ``path`` (read only; see the module docstring)."""
    root = Path(path)
    nums = present_segments(root)
    if not nums:
        raise StreamError(f"{root}: not a looprl stream (no segment-NNNNNNNN.lrs files)")
    segs: list[SegmentSurvey] = []
    prev: int | None = None
    for n in nums:
        if segs and n > segs[-1].number + 1:  # a gap: segment files are gone
            run = list(range(segs[-1].number + 1, n))
            frames = _orphan_index(root, run, prev)
            for k in run:
                gone = SegmentSurvey(k, root / segment_name(k), 0, header_ok=False, missing=True)
                segs.append(gone)
            segs[-len(run)].lost.append(
                LostRange(
                    run[0],
                    0,
                    0,
                    f"segment file{'s' if len(run) > 1 else ''} missing",
                    prev,
                    None,
                    frames,
                    tuple(run),
                )  # fmt: skip
            )
        fd = os.open(root / segment_name(n), os.O_RDONLY)
        try:
            seg = _survey_segment(fd, root / segment_name(n), n, prev)
        finally:
            os.close(fd)
        segs.append(seg)
        prev = seg.seqs[-1] if seg.seqs else prev
    torn = None
    last = segs[-1]
    if last.size < SEGMENT_HEADER_SIZE:  # a segment being created: not damage
        torn = (last.number, 0, last.size, "short segment header")
    elif last.lost and last.lost[-1].offset + last.lost[-1].bytes == last.size:
        t = last.lost.pop()  # nothing intact follows it: the torn tail readers stop at
        torn = (t.segment, t.offset, t.bytes, t.reason)
    for seg in segs[:-1]:
        if seg.size < SEGMENT_HEADER_SIZE and not seg.missing:
            seg.lost.append(LostRange(seg.number, 0, seg.size, "segment header truncated",
                                      None, None, ()))  # fmt: skip
    _fill_before(segs)
    for seg in segs:  # ranges between consecutive seqs held no frame: repaired, not lost
        for r in [r for r in seg.lost if r.frame_count == 0]:
            seg.lost.remove(r)
            held = (
                f"seqs {r.after_seq} and {r.before_seq} are consecutive"
                if r.after_seq is not None
                else f"the first intact seq is {r.before_seq}"
            )
            seg.repairs.append(Repair(r.segment, r.offset, r.bytes, f"{r.reason} ({held})",
                                      missing=bool(r.missing)))  # fmt: skip
    return Survey(root, segs, torn)


def _fill_before(segs: list[SegmentSurvey]) -> None:
    """Set each LostRange's ``after_seq`` and ``before_seq`` from the intact frames."""
    flat: list[tuple[int, int, int]] = []  # (segment, offset, seq) of every intact frame
    for s in segs:
        flat.extend((s.number, o, q) for o, q in zip(s.offsets, s.seqs))
    keys = [(a, b) for a, b, _ in flat]
    for s in segs:
        for i, r in enumerate(s.lost):
            j = bisect.bisect_left(keys, (r.segment, r.offset))
            before = flat[j][2] if j < len(flat) else None
            after = flat[j - 1][2] if j > 0 else None
            frames = r.frames
            if frames and not ((after is None or frames[0] > after)
                               and (before is None or frames[-1] < before)):  # fmt: skip
                frames = ()  # headers (or an orphan index) that disagree with the data
            s.lost[i] = replace(r, after_seq=after, before_seq=before, frames=frames)


def _backup(root: Path, backup: Path | None) -> Path:
    if backup is None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        backup = root.with_name(f"{root.name}.damaged-{stamp}")
        k = 1
        while backup.exists():
            backup = root.with_name(f"{root.name}.damaged-{stamp}-{k}")
            k += 1
    backup.mkdir(parents=True, exist_ok=True)
    return backup


def _keep(src: Path, dst_dir: Path) -> None:
    """Hard-link ``src`` into ``dst_dir`` (a copy across file systems)."""
    if not src.exists():
        return
    dst = dst_dir / src.name
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fill_gap(root: Path, seg: SegmentSurvey, sync: bool) -> None:
    """Create missing segment ``seg`` as a header with no frames, with an empty index."""
    for name, data in ((segment_name(seg.number), encode_segment_header(seg.number)),
                       (index_name(seg.number), b"")):  # fmt: skip
        tmp = root / (name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / name)


def _rewrite(root: Path, seg: SegmentSurvey, sync: bool) -> None:
    """Replace ``seg``'s file by its header and intact frames, and its index to match."""
    src = os.open(seg.path, os.O_RDONLY)
    tmp = seg.path.with_name(seg.path.name + ".tmp")
    dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    offs = new_entries()
    try:
        os.write(dst, encode_segment_header(seg.number))
        pos = SEGMENT_HEADER_SIZE
        for off, length in zip(seg.offsets, seg.lengths):
            n = FRAME_HEADER_SIZE + length
            data = os.pread(src, n, off)
            if len(data) != n:
                raise StreamError(f"{seg.path}: changed while being salvaged (offset {off})")
            os.write(dst, data)
            offs.append(pos)
            pos += n
        if sync:
            os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)
    idx = root / index_name(seg.number)
    itmp = idx.with_name(idx.name + ".tmp")
    itmp.write_bytes(index_bytes(seg.seqs, offs))
    if sync:
        fd = os.open(itmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    os.replace(tmp, seg.path)
    os.replace(itmp, idx)


def salvage(
    root: Path, found: Survey, *, backup: Path | None = None, sync: bool = True
) -> Path | None:
    """Rewrite every damaged segment of ``found`` to its intact frames (the caller holds the
    writer lock); returns the backup directory holding the original files (None: no damage,
    or only missing segments with no index left).
    A missing segment is created empty. A torn tail is left to :func:`proto.stream.writer.recover`'s
    truncation."""
    damaged = [s for s in found.segments if (s.lost or s.repairs) and not s.missing]
    gaps = [s for s in found.segments if s.missing]
    if not damaged and not gaps:
        return None
    keep = [p for s in damaged for p in (s.path, root / index_name(s.number))]
    keep += [root / index_name(s.number) for s in gaps]  # orphan indexes: what a gap held
    keep = [p for p in keep if p.exists()]
    where = _backup(root, backup) if keep else None
    if where is not None:
        for p in keep:
            _keep(p, where)
        if sync:
            fd = os.open(where, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    for seg in damaged:
        _rewrite(root, seg, sync)
    for seg in gaps:
        _fill_gap(root, seg, sync)
    if gaps and sync:
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return where
