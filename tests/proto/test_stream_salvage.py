"""`recover` checks every frame and salvages the intact ones around mid-stream damage;
`looprl stream inspect` counts the intact frames of a damaged stream."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proto.stream.format import FRAME_HEADER_SIZE, StreamCorruptError, segment_name
from proto.stream.reader import StreamReader
from proto.stream.salvage import survey
from proto.stream.writer import StreamWriter, recover

REPO = Path(__file__).resolve().parents[2]
N = 120


def payload(seq: int) -> bytes:
    n = 200 + (seq * 7919) % 1800
    return (seq.to_bytes(8, "little") * (n // 8 + 1))[:n]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = tmp_path_factory.mktemp("salvage") / "s"
    with StreamWriter(s, segment_bytes=16384) as w:
        for q in range(N):
            assert w.append(payload(q)) == q
    return s


def _copy(pristine: Path, tmp_path: Path) -> Path:
    s = tmp_path / "s"
    shutil.copytree(pristine, s)
    return s


def _frame(s: Path, seq: int) -> tuple[Path, int, int]:
    """(segment file, offset, frame bytes) of frame ``seq``."""
    with StreamReader(s) as r:
        for f in r.iter(seq):
            return s / segment_name(f.segment), f.offset, f.frame_bytes
    raise AssertionError(seq)


def _flip(seg: Path, offset: int) -> None:
    raw = bytearray(seg.read_bytes())
    raw[offset] ^= 0x10
    seg.write_bytes(bytes(raw))


def test_flipped_payload_byte_mid_stream_is_salvaged(pristine: Path, tmp_path: Path) -> None:
    s = _copy(pristine, tmp_path)
    with StreamReader(s) as r:
        assert len(r.segments) >= 8  # a real multi-segment stream
        middle = r.segments[len(r.segments) // 2]
        victim = middle.seqs[1]  # neither the first nor the last frame of its segment
    seg, off, size = _frame(s, victim)
    _flip(seg, off + FRAME_HEADER_SIZE + 100)
    before = {n: (s / n).read_bytes() for n in os.listdir(s) if n.endswith(".lrs")}
    with pytest.raises(
        StreamCorruptError, match=rf"{seg.name}: corrupt stream data at offset {off}"
    ):
        with StreamReader(s) as r:
            list(r.iter())

    rep = recover(s)

    assert rep.checked_all and rep.frames == N - 1 and rep.last_seq == N - 1
    assert len(rep.lost) == 1
    lost = rep.lost[0]
    assert (lost.segment, lost.offset, lost.bytes) == (int(seg.name[8:16]), off, size)
    assert (lost.after_seq, lost.before_seq, lost.frames) == (victim - 1, victim + 1, (victim,))
    assert lost.seqs == f"{victim}..{victim}" and lost.reason == "frame checksum mismatch"
    assert rep.truncated_bytes == 0
    # the original files of the damaged segment (only that one) are kept, unchanged
    assert rep.backup is not None and rep.backup.parent == s.parent
    assert sorted(os.listdir(rep.backup)) == [seg.stem + ".idx", seg.name]
    assert (rep.backup / seg.name).read_bytes() == before[seg.name]
    assert seg.stat().st_size == len(before[seg.name]) - size
    with StreamReader(s) as r:  # every intact frame reads back, at its seq, byte for byte
        got = {f.seq: f.payload for f in r.iter()}
        assert r.verify() == N - 1 and r.torn_tail is None
    assert sorted(got) == [q for q in range(N) if q != victim]
    assert all(got[q] == payload(q) for q in got)
    with StreamWriter(s) as w:  # a writer continues after the last seq
        assert w.recovery.truncated_bytes == 0 and w.append(b"more") == N
    again = recover(s)
    assert again.lost == () and again.backup is None and again.frames == N


def test_damaged_headers_in_two_segments(pristine: Path, tmp_path: Path) -> None:
    """A flipped length byte breaks the header chain (count unknown, seq range still exact);
    damage in two segments is two ranges; the torn tail is cut as before."""
    s = _copy(pristine, tmp_path)
    with StreamReader(s) as r:
        a_seg, b_seg = r.segments[1], r.segments[-3]
        a, b = a_seg.seqs[0], b_seg.seqs[-1]  # first frame of one segment, last of another
    seg_a, off_a, size_a = _frame(s, a)
    seg_b, off_b, size_b = _frame(s, b)
    last_seg, last_off, last_size = _frame(s, N - 1)
    _flip(seg_a, off_a + 17)  # the payload length field
    _flip(seg_b, off_b + 2)  # the frame magic
    os.truncate(last_seg, last_off + last_size - 5)  # and a torn tail

    found = survey(s)  # read only: the same numbers, nothing changed
    assert found.frames == N - 3 and found.torn is not None

    rep = recover(s)
    assert [(r.segment, r.offset, r.bytes) for r in rep.lost] == [
        (int(seg_a.name[8:16]), off_a, size_a),
        (int(seg_b.name[8:16]), off_b, size_b),
    ]
    ra, rb = rep.lost
    assert (ra.after_seq, ra.before_seq, ra.frames, ra.seqs) == (a - 1, a + 1, (), f"{a}..{a}")
    assert (rb.after_seq, rb.before_seq, rb.seqs) == (b - 1, b + 1, f"{b}..{b}")
    assert rep.truncated_segment == int(last_seg.name[8:16]) and rep.truncated_offset == last_off
    assert rep.frames == N - 3 and rep.last_seq == N - 2
    with StreamReader(s) as r:
        got = {f.seq: f.payload for f in r.iter()}
    assert sorted(got) == [q for q in range(N - 1) if q not in (a, b)]
    assert all(got[q] == payload(q) for q in got)


def test_cli_recover_and_inspect_of_a_damaged_stream(pristine: Path, tmp_path: Path) -> None:
    s = _copy(pristine, tmp_path)
    with StreamReader(s) as r:
        victim = r.segments[3].seqs[1]
    seg, off, size = _frame(s, victim)
    _flip(seg, off + FRAME_HEADER_SIZE + 5)
    cli = [sys.executable, "-m", "pipeline.cli", "stream"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sh(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], cwd=REPO, env=env, capture_output=True, text=True)

    out = sh("inspect", str(s), "--json")
    assert out.returncode == 2
    j = json.loads(out.stdout)
    assert j["intact_frames"] == N - 1 and j["error"].startswith(str(seg))
    assert j["damaged"] == [
        {"segment": seg.name, "offset": off, "bytes": size, "reason": "frame checksum mismatch",
         "after_seq": victim - 1, "before_seq": victim + 1, "frames": 1,
         "seqs": f"{victim}..{victim}"}
    ]  # fmt: skip
    text = sh("inspect", str(s))
    assert text.returncode == 2
    assert f"{N - 1} frames intact" in text.stderr and "looprl stream recover" in text.stderr

    fixed = sh("recover", str(s))
    assert fixed.returncode == 0, fixed.stderr
    assert f"lost seq {victim}..{victim} (1 frame)" in fixed.stdout
    assert f"{seg.name} offset {off}, {size} bytes" in fixed.stdout
    assert f"{N - 1} intact frames" in fixed.stdout and ".damaged-" in fixed.stdout
    ok = sh("inspect", str(s), "--json")
    assert ok.returncode == 1  # test payloads are not proto frames; the stream reads through
    assert json.loads(ok.stdout)["frames"] == N - 1


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pipeline.cli", "stream", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("segment", "byte", "field"),
    [(0, 3, "byte 3 is 0x44, expected 0x54 (magic, bytes 0..7: b'LRSDREAM', expected "
             "b'LRSTREAM')"),
     (2, 12, "byte 12 is 0x12, expected 0x02 (segment number, bytes 12..15: 18, expected 2)")],
)  # fmt: skip
def test_flipped_segment_header_byte_is_named_and_loses_nothing(
    tmp_path: Path, segment: int, byte: int, field: str
) -> None:
    """One flipped byte in a segment header of a 105-frame stream: `inspect` names the
    segment, the field and the byte (found vs expected) and points to `recover`; `recover`
    (text and --json alike) rewrites the header, keeps 105 of 105 frames and lists no lost
    range."""
    s = tmp_path / "s"
    with StreamWriter(s, segment_bytes=16384) as w:
        for q in range(105):
            w.append(payload(q))
    seg = s / segment_name(segment)
    _flip(seg, byte)
    copy = tmp_path / "copy"
    shutil.copytree(s, copy)

    look = _cli("inspect", str(s))
    assert look.returncode == 2 and "Traceback" not in look.stderr, look.stderr
    err, summary, detail = look.stderr.splitlines()
    assert (
        err == f"looprl stream: error: {seg}: damaged segment header (checksum mismatch): {field}"
    )
    assert summary == (f"looprl stream: 105 frames intact (seq 0..104), none lost; damaged "
                       f"without a lost frame: {seg.name} header; `looprl stream recover {s}` "
                       "rewrites what is damaged and keeps every frame")  # fmt: skip
    assert detail.startswith(f"  damaged, no frame lost: {seg.name} offset 0, 24 bytes: ")
    j = json.loads(_cli("inspect", str(s), "--json").stdout)
    assert (j["intact_frames"], j["first_seq"], j["last_seq"], j["damaged"]) == (105, 0, 104, [])
    assert [(r["segment"], r["offset"], r["bytes"], r["action"], r["frames"])
            for r in j["repairable"]] == [(seg.name, 0, 24, "header rewritten", 0)]  # fmt: skip

    text = _cli("recover", str(s))
    assert text.returncode == 0, text.stderr
    assert "105 intact frames (last seq 104)" in text.stdout and "lost seq" not in text.stdout
    assert f"  header rewritten (no frame lost): {seg.name} offset 0, 24 bytes: " in text.stdout
    assert text.stdout.rstrip().endswith("nothing lost"), text.stdout
    got = _cli("recover", str(copy), "--json")
    assert got.returncode == 0, got.stderr
    rep = json.loads(got.stdout)
    assert (rep["frames"], rep["last_seq"], rep["lost"], rep["lost_frames"], rep["lost_bytes"]) == (
        105, 104, [], 0, 0)  # fmt: skip
    assert [(r["segment"], r["action"]) for r in rep["repaired"]] == [
        (seg.name, "header rewritten")
    ]
    assert "?" not in json.dumps(rep["lost"]) and rep["backup"]
    for fixed in (s, copy):  # every frame reads back, byte for byte, and the stream is clean
        with StreamReader(fixed) as r:
            assert {f.seq: f.payload for f in r.iter()} == {q: payload(q) for q in range(105)}
            assert r.verify() == 105
        again = recover(fixed)
        assert again.repaired == () and again.lost == () and again.backup is None


def test_lost_ranges_carry_real_seq_numbers(pristine: Path, tmp_path: Path) -> None:
    """The first frame's header damaged (no intact frame before it) is lost seq 0..0, not
    "?..": the JSON report and the text agree; stray bytes between two frames with consecutive
    seqs held no frame: repaired, not lost."""
    s = _copy(pristine, tmp_path)
    seg0, off0, _ = _frame(s, 0)
    _flip(seg0, off0 + 2)  # frame 0's magic
    seg, off, _ = _frame(s, 40)
    raw = seg.read_bytes()
    seg.write_bytes(raw[:off] + b"\xab" * 50 + raw[off:])  # garbage between frames 39 and 40
    copy = tmp_path / "copy"
    shutil.copytree(s, copy)

    rep = json.loads(_cli("recover", str(s), "--json").stdout)
    assert [(r["segment"], r["offset"], r["seqs"], r["after_seq"], r["before_seq"])
            for r in rep["lost"]] == [(seg0.name, off0, "0..0", None, 1)]  # fmt: skip
    assert rep["frames"] == N - 1 and rep["lost_frames"] is None  # frame 0's count is unknown
    assert [(r["segment"], r["offset"], r["bytes"], r["action"]) for r in rep["repaired"]] == [
        (seg.name, off, 50, "bytes dropped")]  # fmt: skip
    assert "seqs 39 and 40 are consecutive" in rep["repaired"][0]["reason"]
    text = _cli("recover", str(copy)).stdout
    assert f"  lost seq 0..0 (frame count unknown: a frame header is damaged): {seg0.name}" in text
    assert f"  bytes dropped (no frame lost): {seg.name} offset {off}, 50 bytes: " in text
    assert text.count("lost seq") == 1 and "?" not in text, text
    with StreamReader(s) as r:
        assert sorted(f.seq for f in r.iter()) == list(range(1, N))
