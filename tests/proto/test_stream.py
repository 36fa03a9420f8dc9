"""Rollout stream files: round trips, lookup, index repair, torn tails, damage, bad input."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.stream.format import (
    FRAME_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    StreamCorruptError,
    StreamError,
    StreamLockedError,
    encode_segment_header,
    index_name,
    segment_name,
)
from proto.stream.reader import StreamReader
from proto.stream.writer import StreamWriter, recover

REPO = Path(__file__).resolve().parents[2]


def payload(seq: int, size: int | None = None) -> bytes:
    n = (seq * 7919) % 3000 if size is None else size
    return (seq.to_bytes(8, "little") * (n // 8 + 1))[:n]


def write(path: Path, n: int, **kw: object) -> None:
    with StreamWriter(path, **kw) as w:  # type: ignore[arg-type]
        for s in range(n):
            assert w.append(payload(s)) == s


def sizes(path: Path) -> dict[str, int]:
    return {n: (path / n).stat().st_size for n in sorted(os.listdir(path))}


# -- round trips and lookup -----------------------------------------------------------------
@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_round_trip_over_segments(tmp_path: Path, fsync: str) -> None:
    s = tmp_path / "s"
    write(s, 120, segment_bytes=8192, fsync=fsync)
    assert len([n for n in os.listdir(s) if n.endswith(".lrs")]) > 5
    with StreamReader(s) as r:
        assert (len(r), r.first_seq, r.last_seq) == (120, 0, 119)
        frames = list(r.iter())
        assert [f.seq for f in frames] == list(range(120))
        assert all(f.payload == payload(f.seq) for f in frames)
        assert [f.seq for f in r.iter(start_seq=77)] == list(range(77, 120))
        assert r.get(0) == payload(0) and r.get(119) == payload(119)
        assert all(seg.size <= 8192 for seg in r.segments)
        assert r.verify() == 120 and r.torn_tail is None


def test_lookup_after_reopen_with_gaps(tmp_path: Path) -> None:
    s = tmp_path / "s"
    with StreamWriter(s, segment_bytes=4096, start_seq=10) as w:
        for q in range(10, 40):
            w.append(payload(q))
    with StreamWriter(s, segment_bytes=4096) as w:
        assert w.recovery.last_seq == 39 and w.next_seq == 40
        w.append(payload(40))
        assert w.append(payload(500), seq=500) == 500
        with pytest.raises(StreamError, match="must strictly increase"):
            w.append(b"x", seq=500)
    with pytest.raises(StreamError, match="start_seq=20"):
        StreamWriter(s, start_seq=20)
    with StreamReader(s) as r:
        assert r.get(500) == payload(500) and r.get(25) == payload(25) and r.get(10) == payload(10)
        with pytest.raises(KeyError):
            r.get(200)
        with pytest.raises(KeyError):
            r.get(9)
        assert [f.seq for f in r.iter(start_seq=100)] == [500]
        assert [f.seq for f in r.iter(start_seq=39)] == [39, 40, 500]


def test_reader_sees_flushed_frames_only(tmp_path: Path) -> None:
    s = tmp_path / "s"
    with StreamWriter(s, fsync="batch", buffer_bytes=1 << 20) as w, StreamReader(s) as r:
        w.append(b"a" * 100)
        assert list(r.iter()) == []  # buffered, not flushed
        w.flush()
        assert [f.payload for f in r.iter()] == [b"a" * 100]
        assert r.get(0) == b"a" * 100
        w.append(b"b")
        w.flush()
        assert r.get(1) == b"b"  # get() refreshes for an unknown seq
        assert r.writer_active()
    with StreamReader(s) as r:
        assert not r.writer_active()
        t0 = time.monotonic()
        assert [f.seq for f in r.iter(follow=True, timeout=0.2, poll_s=0.01)] == [0, 1]
        assert 0.2 <= time.monotonic() - t0 < 2.0  # idle timeout ends a follow


def test_failed_write_closes_writer_and_reopen_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = tmp_path / "s"
    w = StreamWriter(s, fsync="never")
    for q in range(5):
        w.append(payload(q))
    w.flush()
    real_writev = os.writev

    def disk_full(fd: int, bufs: list[bytes]) -> int:
        real_writev(fd, [bufs[0][:10]])  # a torn frame header, then ENOSPC
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", disk_full)
    w.append(payload(5))
    with pytest.raises(StreamError, match="No space left.*reopen the stream"):
        w.flush()
    with pytest.raises(StreamError, match="closed"):
        w.append(b"x")
    monkeypatch.setattr(os, "writev", real_writev)
    with StreamWriter(s) as w2:  # lock released; torn tail cut
        assert w2.recovery.truncated_bytes == 10 and w2.next_seq == 5
        w2.append(payload(5))
    with StreamReader(s) as r:
        assert [f.payload for f in r.iter()] == [payload(q) for q in range(6)]


# -- index ------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["delete", "garbage", "truncate_entry", "stale"])
def test_index_rebuilt(tmp_path: Path, damage: str) -> None:
    s = tmp_path / "s"
    write(s, 60, segment_bytes=16384)
    before = {n: (s / n).read_bytes() for n in os.listdir(s) if n.endswith(".idx")}
    for n in before:
        p = s / n
        if damage == "delete":
            p.unlink()
        elif damage == "garbage":
            p.write_bytes(os.urandom(len(before[n])))
        elif damage == "truncate_entry":
            p.write_bytes(before[n][:-5])
        else:  # lags the data by two entries
            p.write_bytes(before[n][:-32])
    snapshot = sizes(s)
    with StreamReader(s) as r:  # copes in memory, changes nothing
        assert [f.seq for f in r.iter()] == list(range(60))
        assert all(r.get(q) == payload(q) for q in range(60))
    assert sizes(s) == snapshot
    rep = recover(s)
    assert rep.last_seq == 59 and rep.truncated_bytes == 0
    assert set(rep.indexes_repaired) == {int(n[8:16]) for n in before}
    after = {n: (s / n).read_bytes() for n in os.listdir(s) if n.endswith(".idx")}
    assert after == before


def test_index_pointing_into_a_frame_is_ignored(tmp_path: Path) -> None:
    s = tmp_path / "s"
    write(s, 10)
    idx = s / index_name(0)
    raw = bytearray(idx.read_bytes())
    struct.pack_into("<Q", raw, 16 * 3 + 8, struct.unpack_from("<Q", raw, 16 * 3 + 8)[0] + 4)
    idx.write_bytes(bytes(raw))  # entry 3 points 4 bytes into frame 3: get() rescans
    with StreamReader(s) as r:
        assert r.get(3) == payload(3) and [f.seq for f in r.iter()] == list(range(10))


# -- torn tails -------------------------------------------------------------------------------
def _last_frame(s: Path) -> tuple[Path, int, int]:
    """(segment file, offset, length) of the last frame."""
    with StreamReader(s) as r:
        seg = r.segments[-1]
        return seg.path, seg.offsets[-1], seg.end - seg.offsets[-1]


def _check_recovered(s: Path, n_frames: int, *, torn: bool, seg: Path, off: int) -> None:
    """The last of ``n_frames`` frames (in ``seg`` at ``off``) is damaged or cut off."""
    snapshot = sizes(s)
    with StreamReader(s) as r:  # a reader copes without modifying anything
        assert [f.seq for f in r.iter()] == list(range(n_frames - 1))
        assert (r.torn_tail is not None) == torn
    assert sizes(s) == snapshot
    with StreamWriter(s, segment_bytes=8192) as w:
        rep = w.recovery
        assert rep.last_seq == n_frames - 2
        if torn:
            assert rep.truncated_segment == int(seg.name[8:16]) and rep.torn_reason
            assert rep.truncated_offset == off
        else:
            assert rep.truncated_bytes == 0
        assert w.append(b"after") == n_frames - 1
    with StreamReader(s) as r:
        got = {f.seq: f.payload for f in r.iter()}
        assert list(got) == list(range(n_frames))
        assert got[n_frames - 1] == b"after"
        assert all(got[q] == payload(q) for q in range(n_frames - 1))
        assert r.verify() == n_frames and r.torn_tail is None
        segs = r.segments
    for g in segs:  # the index matches the data again
        ent = np.frombuffer((s / index_name(g.number)).read_bytes(), "<u8").reshape(-1, 2)
        assert ent[:, 0].tolist() == list(g.seqs) and ent[:, 1].tolist() == list(g.offsets)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    s = tmp_path_factory.mktemp("pristine") / "s"
    with StreamWriter(s, segment_bytes=8192) as w:
        for q in range(19):
            w.append(payload(q))
        w.append(payload(19, 1000))
    return s


@pytest.mark.parametrize("cut", [0, 1, 12, 23, 24, 25, 500, 1023])
def test_torn_tail_truncated(tmp_path: Path, pristine: Path, cut: int) -> None:
    s = tmp_path / "s"
    shutil.copytree(pristine, s)
    seg, off, length = _last_frame(s)
    assert length == FRAME_HEADER_SIZE + 1000
    os.truncate(seg, off + cut)
    _check_recovered(s, 20, torn=cut > 0, seg=seg, off=off)


@pytest.mark.parametrize("where", [0, 9, 16, 20, 24, 600, 1023])  # magic, seq, len, crc, payload
def test_flipped_byte_in_last_frame(tmp_path: Path, pristine: Path, where: int) -> None:
    s = tmp_path / "s"
    shutil.copytree(pristine, s)
    seg, off, _ = _last_frame(s)
    raw = bytearray(seg.read_bytes())
    raw[off + where] ^= 0x40
    seg.write_bytes(bytes(raw))
    _check_recovered(s, 20, torn=True, seg=seg, off=off)


def test_torn_tail_without_index_and_garbage_tail(tmp_path: Path, pristine: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(pristine, s)
    seg, off, length = _last_frame(s)
    (s / (seg.stem + ".idx")).unlink()
    with open(seg, "r+b") as f:  # half-written last frame followed by zeros (power loss)
        f.truncate(off + length // 2)
        f.seek(0, 2)
        f.write(bytes(4096))
    _check_recovered(s, 20, torn=True, seg=seg, off=off)


# -- damage that is not a tail ----------------------------------------------------------------
def test_corrupt_middle_frame_is_an_error(tmp_path: Path, pristine: Path) -> None:
    for victim in (0, -3):  # a frame in the first segment, and one before the last frame
        s = tmp_path / f"s{victim}"
        shutil.copytree(pristine, s)
        with StreamReader(s) as r:
            seg = r.segments[victim]
            off = seg.offsets[1 if victim == 0 else -3]
            seq = seg.seqs[1 if victim == 0 else -3]
        raw = bytearray(seg.path.read_bytes())
        raw[off + FRAME_HEADER_SIZE + 3] ^= 1
        seg.path.write_bytes(bytes(raw))
        want = rf"{seg.path.name}: corrupt stream data at offset {off}"
        with StreamReader(s) as r:
            with pytest.raises(StreamCorruptError, match=want):
                list(r.iter())
            with pytest.raises(StreamCorruptError, match=want):
                r.get(seq)
            with pytest.raises(StreamCorruptError, match=want):
                r.verify()
        for n in os.listdir(s):
            if n.endswith(".idx"):
                os.unlink(s / n)
        with pytest.raises(StreamCorruptError, match=want):
            StreamReader(s)
        with pytest.raises(StreamCorruptError, match=want):
            StreamWriter(s)
        with pytest.raises(StreamCorruptError, match=want):
            recover(s, check_all=False)  # the writer's open-time check; recover() salvages
        assert [r.offset for r in recover(s).lost] == [off]  # tests/proto/test_stream_salvage


def test_torn_tail_in_an_earlier_segment_is_an_error(tmp_path: Path, pristine: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(pristine, s)
    first = s / segment_name(0)
    os.truncate(first, first.stat().st_size - 10)
    with pytest.raises(StreamCorruptError, match=segment_name(0)):
        StreamReader(s)
    with pytest.raises(StreamCorruptError, match=segment_name(0)):
        StreamWriter(s)


# -- locking and bad input --------------------------------------------------------------------
def test_two_writers_refused(tmp_path: Path) -> None:
    s = tmp_path / "s"
    with StreamWriter(s) as w:
        w.append(b"x")
        with pytest.raises(StreamLockedError, match=f"pid {os.getpid()}"):
            StreamWriter(s)
        with pytest.raises(StreamLockedError):
            recover(s)
        code = f"from proto.stream.writer import StreamWriter; StreamWriter({str(s)!r})"
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True)
        assert out.returncode != 0 and b"StreamLockedError" in out.stderr
    with StreamWriter(s) as w:  # released on close
        assert w.next_seq == 1


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="no such stream"):
        StreamReader(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"hello")
    with pytest.raises(StreamError, match="is a file"):
        StreamReader(tmp_path / "file")
    with pytest.raises(StreamError, match="is a file"):
        StreamWriter(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StreamError, match="not a looprl stream"):
        StreamReader(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(StreamError, match="not a looprl stream"):
        StreamWriter(tmp_path / "other")
    s = tmp_path / "s"
    write(s, 3)
    seg = s / segment_name(0)
    good = seg.read_bytes()
    seg.write_bytes(b"NOTASTRM" + good[8:])  # its checksum fails: damage, named byte by byte
    for opener in (StreamReader, StreamWriter):
        with pytest.raises(StreamCorruptError, match=rf"{seg.name}: damaged segment header "
                           r"\(checksum mismatch\): 7 of bytes 0..7 differ \(magic, bytes 0..7: "
                           r"b'NOTASTRM', expected b'LRSTREAM'\)$"):  # fmt: skip
            opener(s)
    head = b"NOTASTRM" + encode_segment_header(0)[8:20]  # written whole by something else
    seg.write_bytes(head + zlib.crc32(head).to_bytes(4, "little") + good[SEGMENT_HEADER_SIZE:])
    for opener in (StreamReader, StreamWriter):
        with pytest.raises(StreamError, match=rf"{seg.name}: not a looprl stream segment"):
            opener(s)
    v2 = bytearray(encode_segment_header(0))
    v2[8] = 2  # the checksum of version 1 kept: a damaged version byte
    seg.write_bytes(bytes(v2) + good[SEGMENT_HEADER_SIZE:])
    with pytest.raises(StreamCorruptError, match=r"byte 8 is 0x02, expected 0x01 \(format "
                       r"version, bytes 8..9: 2, expected 1\)"):  # fmt: skip
        StreamReader(s)
    v2[20:] = zlib.crc32(bytes(v2[:20])).to_bytes(4, "little")  # a newer writer's header
    seg.write_bytes(bytes(v2) + good[SEGMENT_HEADER_SIZE:])
    with pytest.raises(StreamError, match=rf"{seg.name}: stream format version 2 is not supported"):
        StreamReader(s)
    seg.write_bytes(good)
    os.rename(seg, s / segment_name(1))
    with pytest.raises(StreamError, match="header says segment 0"):
        StreamReader(s)
    with pytest.raises(StreamError, match="fsync="):
        StreamWriter(tmp_path / "t", fsync="sometimes")  # type: ignore[arg-type]


# -- property ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    sizes_=st.lists(
        st.one_of(st.integers(0, 64), st.integers(0, 5000), st.integers(60000, 70000)), max_size=30
    ),
    segment_bytes=st.integers(256, 20000),
    reopen_at=st.integers(0, 30),
)
def test_arbitrary_payload_sizes_round_trip(
    sizes_: list[int], segment_bytes: int, reopen_at: int
) -> None:
    data = [os.urandom(n) for n in sizes_]
    with tempfile.TemporaryDirectory() as d:
        s = Path(d) / "s"
        w = StreamWriter(s, segment_bytes=segment_bytes, fsync="never", buffer_bytes=4096)
        for i, p in enumerate(data):
            if i == reopen_at:
                w.close()
                w = StreamWriter(s, segment_bytes=segment_bytes, fsync="never")
            assert w.append(p) == i
        w.close()
        with StreamReader(s) as r:
            assert [f.payload for f in r.iter()] == data
            assert all(r.get(i) == p for i, p in enumerate(data))
            assert all(seg.size <= max(segment_bytes, seg.size) for seg in r.segments)
            for seg in r.segments:  # a segment exceeds segment_bytes only for a single frame
                assert seg.size <= segment_bytes or len(seg.seqs) == 1


# -- inspect CLI ------------------------------------------------------------------------------
def test_inspect_cli(tmp_path: Path) -> None:
    from proto.codec import Codec
    from proto.records import Heartbeat, Rollout, RolloutBatch

    def rollout(i: int, gen: str, version: int) -> Rollout:
        t = 50
        return Rollout(
            rollout_id=f"w{i}/0",
            work_id=f"w{i}",
            prompt_id=f"p{i}",
            sample_index=0,
            generator_id=gen,
            latent_seed=i,
            prompt_tokens=np.arange(1, 20, dtype=np.int32),
            tokens=np.arange(t, dtype=np.int32) % 7,
            logprobs=np.full(t, -0.5, np.float32),
            exit_depths=np.full(t, 4, np.uint8),
            weight_version=version,
        )

    codec = Codec(level=3)
    s = tmp_path / "s"
    with StreamWriter(s, segment_bytes=1024) as w:
        for b in range(6):
            batch = [rollout(4 * b + k, f"gen-{k % 2}", b // 2) for k in range(4)]
            w.append(codec.encode(RolloutBatch(rollouts=batch)))
        w.append(codec.encode(rollout(99, "gen-9", 7)))
        w.append(codec.encode(Heartbeat(sender_id="x", sent_at=1.0, weight_version=3, inflight=0)))
    cmd = [sys.executable, "-m", "pipeline.commands.stream_cli", "inspect", str(s)]
    out = subprocess.run([*cmd, "--json", "--frames"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert (j["frames"], j["first_seq"], j["last_seq"]) == (8, 0, 7)
    assert j["types"] == {"heartbeat": 1, "rollout": 1, "rollouts": 6}
    assert j["generators"] == {"gen-0": 12, "gen-1": 12, "gen-9": 1} and j["rollouts"] == 25
    assert j["weight_versions"] == {
        "min": 0,
        "max": 7,
        "histogram": {"0": 8, "1": 8, "2": 8, "7": 1},
    }
    assert j["message_bytes"] > j["wire_bytes"] > 0 and j["compression_ratio"] > 1
    assert j["disk_bytes"] == sum(sizes(s).values()) and len(j["segments"]) >= 2
    assert [f["seq"] for f in j["frame_list"]] == list(range(8))
    assert j["frame_list"][6]["versions"] == [7] and j["undecodable"] == 0
    text = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert text.returncode == 0 and "gen-9 1" in text.stdout and "seq 0..7" in text.stdout
    with StreamWriter(s) as w:
        w.append(b"not a proto frame")
    bad = subprocess.run([*cmd, "--json"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and json.loads(bad.stdout)["undecodable"] == 1
    missing = subprocess.run([*cmd[:-1], str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "not a looprl stream" in missing.stderr
