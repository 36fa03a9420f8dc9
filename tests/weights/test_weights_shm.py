"""Same-host delivery through shared memory (weights/shm.py): a
version written once is mapped and digest-checked by two generator-like processes, which get
the very tensors; a corrupt piece is named and refused."""

from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from weights.check import WeightsRefused
from weights.publication import Publication
from weights.shm import SHM_DIR, open_shm, remove_shm, shm_path, write_shm
from weights.verified import VerifiedWeights

PIECE = 1 << 16  # small digest pieces: the test's blob spans several


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(96, 512, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(300, 70, generator=g),
        "c.bias": torch.zeros(7),
    }


def _read(args: tuple[Any, str]) -> dict[str, Any]:
    """In a generator-like process: map, check, and report each tensor's sum (fp64)."""
    announce, path = args
    w = VerifiedWeights(announce, open_shm(announce, path))
    out = {"digest": w.digest, "sums": {k: float(v.double().sum()) for k, v in w.state().items()}}
    w.close()
    return out


def _run_version(tmp_path: Path, version: int) -> tuple[Path, Publication, Any]:
    """(a fresh shm root, version ``version``'s Publication of a run directory, its announce
    naming that directory, as the learner announces it)."""
    root = tmp_path / "shm"
    root.mkdir()
    vdir = tmp_path / "run" / "weights" / f"v{version}"
    pub = Publication.of_state(_state(), version, vdir, chunk_bytes=PIECE)
    announce = pub.announce(0)
    announce.path = str(vdir.resolve())
    return root, pub, announce


def _root(tmp_path: Path) -> Path:
    return SHM_DIR if SHM_DIR.is_dir() else tmp_path


def test_two_processes_map_one_copy_and_check_its_digest(tmp_path: Path) -> None:
    state = _state()
    pub = Publication.of_state(state, 3, None, chunk_bytes=PIECE)
    announce = pub.announce(1 << 20)
    path = write_shm(pub, shm_path(f"test-{tmp_path.name}", 3, _root(tmp_path)))
    try:
        assert path.stat().st_size == len(pub.blob) > 2 * PIECE
        with mp.get_context("spawn").Pool(2) as pool:
            got = pool.map(_read, [(announce, str(path))] * 2)
        want = {k: float(v.double().sum()) for k, v in state.items()}
        for g in got:
            assert g["digest"] == pub.digest and g["sums"] == want
        w = VerifiedWeights(announce, open_shm(announce, path))  # here too: views, bit-equal
        assert all(torch.equal(w.state()[k], v) for k, v in state.items())
        w.state()["b.weight"].add_(1.0)  # copy-on-write: the shared copy is untouched
        w.close()
        again = VerifiedWeights(announce, open_shm(announce, path))
        assert again.state()["b.weight"].equal(state["b.weight"])
    finally:
        remove_shm(path)
    assert not path.exists()


def test_a_corrupt_piece_is_named_and_refused(tmp_path: Path) -> None:
    pub = Publication.of_state(_state(), 4, None, chunk_bytes=PIECE)
    announce = pub.announce(1 << 20)
    path = write_shm(pub, shm_path(f"test-{tmp_path.name}", 4, _root(tmp_path)))
    try:
        with open(path, "r+b") as f:  # one byte of piece 2 flipped
            f.seek(2 * PIECE + 5)
            b = f.read(1)
            f.seek(2 * PIECE + 5)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(
            WeightsRefused,
            match=r"weights v4 in .*: pieces 2 \(\['b.weight', 'c.bias'\]\) do not match",
        ):
            open_shm(announce, path)
        with open(path, "r+b") as f:  # a short file
            f.truncate(len(pub.blob) - 1)
        with pytest.raises(
            WeightsRefused, match=f"{len(pub.blob) - 1} bytes, {len(pub.blob)} announced"
        ):
            open_shm(announce, path)
    finally:
        remove_shm(path)
    with pytest.raises(WeightsRefused, match="No such file"):
        open_shm(announce, path)


def test_the_run_file_holds_the_canonical_blob_and_is_found_from_the_directory(
    tmp_path: Path,
) -> None:
    """publish_shm writes the blob byte for byte (parallel pieces: WRITE_PIECE shrunk so the
    blob spans 5); mapped_copy maps and checks it from the announced directory alone."""
    import weights.shm as shm

    root = tmp_path / "shm"
    root.mkdir()
    vdir = tmp_path / "run" / "weights" / "v7"
    pub = Publication.of_state(_state(), 7, vdir, chunk_bytes=PIECE)
    old, shm.WRITE_PIECE = shm.WRITE_PIECE, -(-len(pub.blob) // 5)
    try:
        path = shm.publish_shm(pub, root)
    finally:
        shm.WRITE_PIECE = old
    assert path == shm.shm_file(vdir, root) and path.parent == root
    assert path.read_bytes() == bytes(pub.blob)
    announce = pub.announce(0)
    announce.path = str(vdir.resolve())
    got = shm.mapped_copy(announce, root)
    assert got is not None
    w = VerifiedWeights(announce, got)
    assert w.digest == pub.digest and w.directory == ""
    assert all(torch.equal(w.state()[k], v) for k, v in _state().items())
    w.close()
    with pytest.raises(ValueError, match="expected a name v<version>"):
        shm.shm_file(tmp_path / "weights" / "latest", root)


def test_a_corrupt_or_missing_copy_falls_back_to_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import weights.shm as shm

    root, pub, announce = _run_version(tmp_path, 2)
    assert shm.mapped_copy(announce, root) is None  # another host: no file
    monkeypatch.setenv(shm.CORRUPT_ENV, "2")  # the test hook flips byte 0 (piece 0)
    shm.publish_shm(pub, root)
    before = shm.counts["shm_refused"]
    assert shm.mapped_copy(announce, root) is None
    assert shm.counts["shm_refused"] == before + 1
    assert re.search(r"weights v2 in .*-v2\.blob: pieces 0 \(\['a.weight'\]\) do not match",
                     caplog.text), caplog.text  # fmt: skip
    assert f"loading the directory {announce.path} instead" in caplog.text


def test_pruning_keeps_the_newest_files_of_this_run_only(tmp_path: Path) -> None:
    import weights.shm as shm

    root = tmp_path / "shm"
    root.mkdir()
    runs = [tmp_path / "a" / "weights", tmp_path / "b" / "weights"]
    for run in runs:
        for v in range(1, 6):
            pub = Publication.of_state(_state(), v, run / f"v{v}", chunk_bytes=PIECE)
            shm.publish_shm(pub, root)
    assert shm.shm_versions(runs[0], root) == [1, 2, 3, 4, 5]
    ann = Publication.of_state(_state(), 2, None, chunk_bytes=PIECE).announce(1 << 20)
    mapped = VerifiedWeights(ann, shm.open_shm(ann, shm.shm_file(runs[0] / "v2", root)))
    assert shm.prune_shm(runs[0], 4, 2, root) == [1, 2]  # v5: above current, being written
    assert shm.shm_versions(runs[0], root) == [3, 4, 5]
    assert shm.shm_versions(runs[1], root) == [1, 2, 3, 4, 5]  # another run's: untouched
    assert torch.equal(mapped.state()["a.weight"], _state()["a.weight"])  # unlinked, mapped
    mapped.close()
    assert shm.prune_shm(runs[0], 1 << 62, 0, root) == [3, 4, 5]  # the run's end: all
    assert len(list(root.iterdir())) == 5 and not list(root.glob(".*"))


def test_load_mapped_copies_while_the_digest_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """load_mapped hands the engine's load the mapped views while the check runs on another
    thread (each side waits for the other to have started: run one after the other, one of
    them would time out), returns True on a match; a corrupt copy raises ShmRefused after the
    load ran (pieces named, counted); no copy or a short one: False, nothing loaded; what the
    load raises comes out after the check has finished."""
    import threading

    import weights.shm as shm

    root, pub, announce = _run_version(tmp_path, 5)
    calls: list[dict[str, torch.Tensor]] = []

    def load(st: Any) -> None:
        calls.append({k: v.clone() for k, v in st.items()})

    assert shm.load_mapped(announce, load, root) is False and not calls  # no copy here
    path = shm.publish_shm(pub, root)

    checking, loading = threading.Event(), threading.Event()
    real_check = shm.check_blob

    def check(a: Any, blob: Any) -> None:
        checking.set()
        assert loading.wait(10), "the load did not start while the digest was being checked"
        real_check(a, blob)

    def load_overlapped(st: Any) -> None:
        loading.set()
        assert checking.wait(10), "the check did not start while the load ran"
        load(st)

    monkeypatch.setattr(shm, "check_blob", check)
    before = dict(shm.counts)
    assert shm.load_mapped(announce, load_overlapped, root) is True
    assert all(torch.equal(calls[-1][k], v) for k, v in _state().items())
    assert shm.counts["shm_loaded"] == before.get("shm_loaded", 0) + 1
    monkeypatch.setattr(shm, "check_blob", real_check)

    with open(path, "r+b") as f:  # one byte of piece 1 flipped
        f.seek(PIECE + 3)
        b = f.read(1)
        f.seek(PIECE + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    n = len(calls)
    with pytest.raises(
        shm.ShmRefused, match=r"weights v5 in .*: pieces 1 \(\['a.weight', 'b.weight'\]\)"
    ):
        shm.load_mapped(announce, load, root)
    assert len(calls) == n + 1  # it had been loaded: the caller must replace it
    assert shm.counts["shm_refused"] == before.get("shm_refused", 0) + 1
    assert "refused after it was loaded" in caplog.text

    def boom(st: Any) -> None:
        raise RuntimeError("device out of memory")

    with pytest.raises(RuntimeError, match="device out of memory"):
        shm.load_mapped(announce, boom, root)

    with open(path, "r+b") as f:  # a short file: refused before any load
        f.truncate(100)
    assert shm.load_mapped(announce, load, root) is False and len(calls) == n + 1


def test_load_staged_reads_and_checks_into_the_callers_buffer_before_the_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load_staged (the torch engine's path on a GPU: a pinned buffer it keeps) reads this
    host's copy into the caller's buffer with every piece hashed as read, and hands the load
    views OF THAT BUFFER (the bytes that were checked) only after the digest matched; a corrupt
    piece is named and nothing is loaded (False: the caller reads the directory); a short copy,
    no copy: False; an older flat digest is checked too; a buffer of the wrong size is
    refused."""
    import numpy as np

    import weights.shm as shm

    root, pub, announce = _run_version(tmp_path, 6)
    buf = np.zeros(announce.total_bytes, dtype=np.uint8)
    sizes: list[int] = []

    def staging(n: int) -> Any:
        sizes.append(n)
        return buf

    calls: list[dict[str, torch.Tensor]] = []
    assert shm.load_staged(announce, calls.append, staging, root) is False  # no copy here
    assert not calls and not sizes
    path = shm.publish_shm(pub, root)
    before = dict(shm.counts)
    assert shm.load_staged(announce, lambda st: calls.append(dict(st)), staging, root) is True
    assert sizes == [announce.total_bytes] and bytes(buf) == bytes(pub.blob)
    got = calls[-1]
    assert all(torch.equal(got[k], v) for k, v in _state().items())
    base = buf.__array_interface__["data"][0]  # the views are of the checked buffer itself
    assert all(base <= t.data_ptr() < base + len(buf) for t in got.values() if t.numel())
    assert shm.counts["shm_loaded"] == before.get("shm_loaded", 0) + 1

    with open(path, "r+b") as f:  # one byte of piece 2 flipped: named, nothing loaded
        f.seek(2 * PIECE + 5)
        b = f.read(1)
        f.seek(2 * PIECE + 5)
        f.write(bytes([b[0] ^ 0x01]))
    n = len(calls)
    assert shm.load_staged(announce, calls.append, staging, root) is False and len(calls) == n
    assert re.search(
        r"refused: weights v6 in .*: pieces 2 \(\['b.weight', 'c.bias'\]\)", caplog.text
    )
    assert shm.counts["shm_refused"] == before.get("shm_refused", 0) + 1

    with pytest.raises(ValueError, match=r"a buffer of 10 bytes for \d+"):
        shm.read_checked(announce, path, bytearray(10))
    from weights.digest import FLAT, weights_digest

    flat = Publication.of_state(_state(), 7, tmp_path / "v7")
    fa = flat.announce(0)  # as a recorded run's older (flat) digest announces it
    fa.digest_kind, fa.chunk_digests = FLAT, []
    fa.digest = weights_digest(flat.blob, fa.tensors, FLAT).hex
    (tmp_path / "flat.bin").write_bytes(bytes(flat.blob))
    shm.read_checked(fa, tmp_path / "flat.bin", bytearray(fa.total_bytes))
    bad = bytearray(flat.blob)
    bad[11] ^= 0xFF
    (tmp_path / "flat.bin").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="digest"):
        shm.read_checked(fa, tmp_path / "flat.bin", bytearray(fa.total_bytes))

    with open(path, "r+b") as f:  # a short file
        f.truncate(100)
    assert shm.load_staged(announce, calls.append, staging, root) is False and len(calls) == n
    assert re.search(r"v6 in .*: 100 bytes, \d+ announced", caplog.text)
