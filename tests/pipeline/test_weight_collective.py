"""publish.transport=collective end to end: the product's Coordinator on a real ZMQ endpoint
and TCPStore, generators running the product's GeneratorLoop with the collective sink (real
sockets, gloo), in threads, and in spawned processes for the ones that die."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config.run import load_config
from pipeline.core.coordinator import Coordinator
from pipeline.net.transport.zmq import ZmqLearnerEndpoint
from tests.pipeline.collective_utils import (
    TCFG,
    Receiver,
    StateTrainer,
    child,
    same_bits,
    state_for,
)
from tests.pipeline.fakes import FAKE_LIMITS, prompts
from weights.collective.learner import CollectivePublisher
from weights.transports import open_publisher

TIMEOUT_S = 3.0  # publish.collective_timeout_s in these tests
# A round run inside the coordinator's loop would make one turn last >= TIMEOUT_S when a
# member is missing (the join wait, the group wait); beside the loop, turns stay short (their
# length here is the busy 2-core host's scheduling, up to ~1.3 s seen at load average 35).


def make_coord(tmp_path: Path, *overrides: str) -> Coordinator:
    cfg = load_config(None, [f"run_dir={tmp_path}", "rollout.n=4", "publish.keep=0",
                             "publish.transport=collective", f"publish.collective_timeout_s={TIMEOUT_S}",
                             "publish.chunk_bytes=262144",
                             "publish.collective_chunk_bytes=262144", *overrides])  # fmt: skip
    ep = ZmqLearnerEndpoint(TCFG, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    c = Coordinator(cfg, endpoint=ep, trainer=StateTrainer(), prompts=prompts(), run_dir=tmp_path,
                    limits=FAKE_LIMITS)  # fmt: skip
    c.dispatcher.cap = 0  # weights only: no work is dispatched
    assert isinstance(c.publisher, CollectivePublisher)
    return c


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = make_coord(tmp_path)
    yield c
    c.close()
    c.endpoint.close()


class Turns:
    """Drives the coordinator's loop; records the longest turn (the publisher must not block)."""

    def __init__(self, c: Coordinator) -> None:
        self.c, self.longest = c, 0.0

    def until(self, cond: Callable[[], bool], timeout_s: float) -> float:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(
                    f"not within {timeout_s}s; publisher {self.c.publisher.counts}"
                )
            t = time.monotonic()
            self.c.turn(0.005)
            self.longest = max(self.longest, time.monotonic() - t)
        return time.monotonic() - t0


def serving(c: Coordinator, gids: list[str], v: int) -> Callable[[], bool]:
    gens = c.publisher.generators
    return lambda: all(gens().get(g, -1) >= v for g in gids)


def joined(c: Coordinator, n: int) -> Callable[[], bool]:
    return lambda: len(c.publisher.generators()) >= n


def spawn(c: Coordinator, gid: str, die_in_round: bool, device: int = -1) -> Any:
    ep = c.endpoint.endpoints  # type: ignore[attr-defined]
    p = mp.get_context("spawn").Process(target=child, args=(gid, ep["control"], ep["weights"],
                                                            die_in_round, device), daemon=True)  # fmt: skip
    p.start()
    return p


def reap(p: Any) -> None:
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=30)


def receivers(c: Coordinator, *gids: str) -> list[Receiver]:
    ep = c.endpoint.endpoints  # type: ignore[attr-defined]
    return [Receiver(g, ep["control"], ep["weights"]).start() for g in gids]


def test_two_generators_get_bit_equal_weights_by_one_broadcast_and_a_late_joiner_too(
    coord: Coordinator,
) -> None:
    c, turns = coord, Turns(coord)
    gens = receivers(c, "g1", "g2")
    try:
        turns.until(joined(c, 2), 30)
        c.publish()  # v1
        turns.until(serving(c, ["g1", "g2"], 1), 30)
        c.publish()  # v2
        turns.until(serving(c, ["g1", "g2"], 2), 30)
        for r in gens:
            for v in (1, 2):
                assert same_bits(r.engine.loaded[v], state_for(v)), (r.gid, v)
            assert r.sink.counts["verified"] == 2 and r.sink.counts["nacked"] == 0
            assert r.chunks.counts["verified"] == 0  # nothing came as ZMQ chunks
        pub = c.publisher
        assert isinstance(pub, CollectivePublisher)
        assert [(e["members"], e["joined"], e["error"]) for e in pub.round_log] == [(2, 2, "")] * 2
        assert pub.counts["frames"] == 0 and pub.counts["collective_fallbacks"] == 0
        late = receivers(c, "g3")[0]  # joins mid-run: the current version, the same path
        gens.append(late)
        turns.until(serving(c, ["g3"], 2), 30)
        assert same_bits(late.engine.loaded[2], state_for(2)) and 1 not in late.engine.loaded
        assert late.sink.counts["verified"] == 1 and late.chunks.counts["verified"] == 0
        assert [(e["members"], e["joined"]) for e in pub.round_log][-1] == (1, 1)
        assert pub.counts["frames"] == 0
        assert turns.longest < TIMEOUT_S  # the rounds ran beside the loop, not in it
    finally:
        for r in gens:
            r.stop()


class CorruptingPublisher(CollectivePublisher):
    """Broadcasts the blob with one bit flipped (the announced digest is the true one)."""

    def _run(self, name: str, members: list[str], blob: bytes) -> Any:
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0x01
        return super()._run(name, members, bytes(bad))


def test_a_corrupted_broadcast_is_refused_and_the_true_weights_come_by_zmq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.core import coordinator

    # the coordinator's weight transfers, handed to its components, are the corrupting ones
    monkeypatch.setattr(coordinator, "open_publisher", lambda _kind, ep, _cfg, _run_dir:
                        CorruptingPublisher(ep, timeout_s=TIMEOUT_S, chunk_bytes=262144))  # fmt: skip
    c = make_coord(tmp_path)
    assert isinstance(c.publisher, CorruptingPublisher)
    turns = Turns(c)
    gens = receivers(c, "g1", "g2")
    try:
        turns.until(joined(c, 2), 30)
        c.publish()
        turns.until(serving(c, ["g1", "g2"], 1), 30)
        for r in gens:
            assert r.sink.counts["digest_mismatch"] == 1  # checked, refused, never loaded
            assert r.chunks.counts["verified"] == 1  # then the fallback: ZMQ chunks
            assert list(r.engine.loaded) == [1] and same_bits(r.engine.loaded[1], state_for(1))
            assert r.loop.stats.counts["weights_failed"] == 0  # nothing bad reached the engine
        assert c.publisher.counts["collective_fallbacks"] == 2
        assert c.publisher.counts["collective_nacked"] == 2
    finally:
        for r in gens:
            r.stop()
        c.close()
        c.endpoint.close()


def test_a_killed_or_hung_generator_costs_at_most_one_timeout_and_the_others_get_the_broadcast(
    coord: Coordinator,
) -> None:
    c, turns = coord, Turns(coord)
    dead, hung = spawn(c, "dead", die_in_round=False), spawn(c, "hung", die_in_round=False)
    gens = receivers(c, "g1", "g2")
    try:
        turns.until(joined(c, 4), 60)
        c.publish()
        turns.until(serving(c, ["g1", "g2", "dead", "hung"], 1), 60)
        os.kill(dead.pid, signal.SIGKILL)  # gone without a Goodbye
        os.kill(hung.pid, signal.SIGSTOP)  # alive to TCP (a hung host), never answers
        dead.join(timeout=30)
        assert {"dead", "hung"} <= set(c.publisher.generators())  # no heartbeat expired yet
        c.publish()
        took = turns.until(serving(c, ["g1", "g2"], 2), 30)
        pub = c.publisher
        assert isinstance(pub, CollectivePublisher)
        assert took < TIMEOUT_S + 3.0, took  # waited for the missing joins <= timeout_s
        turns.until(lambda: pub._round is None, 10)
        last = pub.round_log[-1]
        # "dead" is in the round unless ZMQ already knew it gone (then its announce was not sent)
        assert last["members"] in (3, 4) and (last["joined"], last["error"]) == (2, ""), last
        for r in gens:
            assert same_bits(r.engine.loaded[2], state_for(2))
            assert r.chunks.counts["verified"] == 0  # the broadcast itself, not the fallback
        assert "hung" not in pub.external  # it fell back to ZMQ chunks (until it reconnects)
        assert pub.counts["collective_fallbacks"] == last["members"] - 2
        assert turns.longest < TIMEOUT_S
    finally:
        reap(dead)
        reap(hung)
        for r in gens:
            r.stop()


def test_a_generator_dying_inside_a_round_fails_it_within_the_timeout_and_zmq_delivers(
    coord: Coordinator,
) -> None:
    c, turns = coord, Turns(coord)
    p = spawn(c, "dies", die_in_round=True)
    gens = receivers(c, "g1", "g2")
    try:
        turns.until(joined(c, 3), 60)
        c.publish()
        took = turns.until(serving(c, ["g1", "g2"], 1), 30)
        assert p.exitcode == 3  # it joined the rendezvous, then died before the group formed
        pub = c.publisher
        assert isinstance(pub, CollectivePublisher)
        # the joins (all 3 in time), then the group waits <= timeout_s for the dead rank and
        # fails; the live ones time out too, Nack, and get v1 by ZMQ chunks
        assert took < 2 * TIMEOUT_S + 5.0, took
        turns.until(lambda: pub._round is None, 10)
        assert pub.round_log[0]["error"], pub.round_log
        assert pub.counts["collective_failed"] == 1 and pub.counts["collective_fallbacks"] == 3
        for r in gens:
            assert same_bits(r.engine.loaded[1], state_for(1)) and r.chunks.counts["verified"] == 1
        assert turns.longest < TIMEOUT_S
    finally:
        reap(p)
        for r in gens:
            r.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_round_delivers_to_a_generator_on_another_gpu(tmp_path: Path) -> None:
    """publish.collective_backend=nccl: the learner (this process, GPU 0) and a generator
    process on GPU 1; two versions, each one NCCL round in 256 KiB pieces, the bytes checked
    against the announced digest on the generator (a mismatch would Nack and fall back)."""
    torch.cuda.set_device(0)
    c = make_coord(tmp_path, "publish.collective_backend=nccl", "publish.collective_timeout_s=60")
    turns = Turns(c)
    p = spawn(c, "g1", die_in_round=False, device=1)
    try:
        turns.until(joined(c, 1), 120)
        for v in (1, 2):
            c.publish()
            turns.until(serving(c, ["g1"], v), 120)
        pub = c.publisher
        assert isinstance(pub, CollectivePublisher)
        turns.until(lambda: pub._round is None, 30)
        assert [(e["members"], e["joined"], e["error"]) for e in pub.round_log] == [(1, 1, "")] * 2
        assert pub.counts["frames"] == 0 and pub.counts["collective_fallbacks"] == 0
        assert pub.counts["collective_nacked"] == 0
    finally:
        reap(p)
        c.close()
        c.endpoint.close()


def test_open_publisher_picks_the_transport(tmp_path: Path) -> None:
    for name, kind, chunked in (
        ("zmq", "WeightPublisher", True), ("shared_fs", "WeightPublisher", False),
        ("chunks", "WeightPublisher", True), ("shm", "ShmPublisher", False),
        ("collective", "CollectivePublisher", True),
    ):  # fmt: skip
        cfg = load_config(None, [f"run_dir={tmp_path}", f"publish.transport={name}"])
        pub = open_publisher(cfg.publish.transport, None, cfg.publish, tmp_path)  # type: ignore[arg-type]
        assert type(pub).__name__ == kind and pub.chunked is chunked
        pub.close()
    cfg = load_config(None, [f"run_dir={tmp_path}", "publish.transport=disk"])
    assert cfg.publish.transport == "shared_fs"  # the old names stay accepted
    with pytest.raises(ValueError, match=r"publish.transport='nfs'.*shared_fs"):
        load_config(None, [f"run_dir={tmp_path}", "publish.transport=nfs"])
    with pytest.raises(ValueError, match=r"publish.collective_backend='mpi'"):
        load_config(None, [f"run_dir={tmp_path}", "publish.collective_backend=mpi"])
