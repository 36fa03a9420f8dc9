"""Same-host delivery through shared memory (models/weights/shm.py, issue 22 item 3): a
version written once is mapped and digest-checked by two generator-like processes, which get
the very tensors; a corrupt piece is named and refused."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from models.weights.publication import Publication
from models.weights.shm import SHM_DIR, open_shm, remove_shm, shm_path, write_shm

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
    w = open_shm(announce, path)
    out = {"digest": w.digest, "sums": {k: float(v.double().sum()) for k, v in w.items()}}
    w.close()
    return out


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
        w = open_shm(announce, path)  # here too: views of the mapping, bit-equal
        assert all(torch.equal(w[k], v) for k, v in state.items())
        w["b.weight"].add_(1.0)  # copy-on-write: the shared copy is untouched
        w.close()
        assert open_shm(announce, path)["b.weight"].equal(state["b.weight"])
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
            ValueError,
            match=r"weights v4 in .*: pieces 2 \(\['b.weight', 'c.bias'\]\) do not match",
        ):
            open_shm(announce, path)
        with open(path, "r+b") as f:  # a short file
            f.truncate(len(pub.blob) - 1)
        with pytest.raises(
            ValueError, match=f"{len(pub.blob) - 1} bytes, {len(pub.blob)} announced"
        ):
            open_shm(announce, path)
    finally:
        remove_shm(path)
    with pytest.raises(ValueError, match="No such file"):
        open_shm(announce, path)
