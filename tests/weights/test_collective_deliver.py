"""weights.collective.deliver: the collective transport's pipelined delivery on real gloo groups
(ranks on threads of this process, a real TCPStore), bit for bit, and its knob's checks."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from models.errors import ConfigError
from pipeline.config.run import load_config
from proto.errors import ProtocolError
from proto.records import WeightAnnounce
from weights.collective import group as coll


def _run_group(world: int, nbytes: int, chunk: int, name: str) -> list[torch.Tensor]:
    """Rank 0 delivers ``nbytes`` random bytes to ranks 1..world-1; returns every rank's tensor."""
    store = coll.host_store("127.0.0.1", 0, 30.0)
    src = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            s = store if rank == 0 else coll.join_store(f"127.0.0.1:{store.port}", 30.0)
            group = coll.open_group(s, name, rank, world, backend="gloo", timeout_s=30.0,
                                    hostname="127.0.0.1")  # fmt: skip
            t = coll.blob_tensor(src.numpy().tobytes(), "gloo") if rank == 0 \
                else coll.buffer_tensor(nbytes, "gloo")[1]  # fmt: skip
            coll.deliver(group, t, rank, world, chunk_bytes=chunk, timeout_s=30.0)
            out[rank] = t.clone()
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, errors
    assert all(x is not None for x in out)
    assert torch.equal(out[0], src)
    return out


@pytest.mark.parametrize(
    ("world", "nbytes", "chunk"),
    [
        (4, 1_000_003, 65_536),  # a chain of 3 hops, 16 pieces, the last one shorter
        (3, 100, 65_536),  # less than one piece
        (3, 262_144, 65_536),  # an exact multiple
        (2, 1, 65_536),  # one byte, one hop
        (3, 300_001, 0),  # 0: one whole broadcast (gloo's tree)
        (3, 0, 65_536),  # nothing to send: no transfer at all
    ],
)
def test_deliver_gives_every_rank_the_same_bits(world: int, nbytes: int, chunk: int) -> None:
    out = _run_group(world, nbytes, chunk, f"t{world}-{nbytes}-{chunk}")
    for t in out[1:]:
        assert t.numel() == nbytes and torch.equal(t, out[0])


def test_pieces_cover_the_blob_once() -> None:
    assert coll.pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert coll.pieces(3, 4) == [(0, 3)]
    assert coll.pieces(8, 4) == [(0, 4), (4, 8)]
    assert coll.pieces(5, 0) == [(0, 5)]
    assert coll.pieces(0, 4) == []


@pytest.mark.parametrize("bad", [-1, 1.5, "8M", True, None])
def test_chunk_bytes_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="collective chunk_bytes"):
        coll.check_pipe_bytes(bad)


@pytest.mark.parametrize("bad", [-1, 1000, 65_535, True])
def test_config_refuses_a_bad_collective_chunk_bytes(bad: Any) -> None:
    with pytest.raises(ConfigError, match="publish.collective_chunk_bytes"):
        load_config(None, [f"publish.collective_chunk_bytes={bad}"])


def test_config_accepts_zero_and_a_piece_size() -> None:
    assert load_config(None, []).publish.collective_chunk_bytes == coll.DEFAULT_PIPE_BYTES
    for ok in (0, 65_536, 16 << 20):
        cfg = load_config(None, [f"publish.collective_chunk_bytes={ok}"])
        assert cfg.publish.collective_chunk_bytes == ok


def test_announce_validates_chunk_bytes() -> None:
    info: dict[str, Any] = {"store": "h:1", "round": "v1/r1", "backend": "gloo", "timeout_s": 5.0}
    WeightAnnounce(1, "a" * 64, 12, 0, 0, collective=info).validate()  # absent: 0
    WeightAnnounce(1, "a" * 64, 12, 0, 0, collective={**info, "chunk_bytes": 65536}).validate()
    for bad in (-1, "8", True, 1.5):
        ann = WeightAnnounce(1, "a" * 64, 12, 0, 0, collective={**info, "chunk_bytes": bad})
        with pytest.raises(ProtocolError, match="collective.chunk_bytes"):
            ann.validate()


def test_a_rank_that_never_takes_part_fails_the_chain_within_the_timeout() -> None:
    """Rank 1 forms the group, then does nothing: rank 0's sends and rank 2's receives end in
    a CollectiveError within the timeout, nobody hangs."""
    store = coll.host_store("127.0.0.1", 0, 30.0)
    nbytes, timeout_s = 1 << 20, 2.0
    errors: dict[int, BaseException] = {}
    idle = threading.Event()

    def rank_main(rank: int) -> None:
        s = store if rank == 0 else coll.join_store(f"127.0.0.1:{store.port}", 30.0)
        group = coll.open_group(s, "hung", rank, 3, backend="gloo", timeout_s=30.0,
                                hostname="127.0.0.1")  # fmt: skip
        if rank == 1:
            idle.wait(3 * timeout_s)  # alive, in the group, never receiving
            return
        t = coll.buffer_tensor(nbytes, "gloo")[1]
        try:
            coll.deliver(group, t, rank, 3, chunk_bytes=1 << 16, timeout_s=timeout_s)
        except coll.CollectiveError as e:
            errors[rank] = e

    ts = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(3)]
    for t in ts:
        t.start()
    ts[0].join(timeout=4 * timeout_s)
    ts[2].join(timeout=4 * timeout_s)
    idle.set()
    ts[1].join(timeout=10)
    assert not any(t.is_alive() for t in ts)
    assert sorted(errors) == [0, 2], errors
