"""Weight push: credits, late joiners, supersession, corruption, stalls; in memory and over tcp."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
import zlib
from typing import Any

import pytest

from pipeline.net.transport.config import TransportConfig
from pipeline.net.transport.memory import MemoryNetwork
from pipeline.net.transport.zmq import ZmqGeneratorConnection, ZmqLearnerEndpoint
from proto.records import Ack, Nack, TensorMeta, WeightAnnounce, WeightChunk, Welcome
from tests.pipeline import FakeClock, hello
from weights.check import WeightsRefused
from weights.publisher import WeightPublisher
from weights.receiver import WeightReceiver
from weights.verified import VerifiedWeights

CFG = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=5.0)


class Tamper:
    """Wraps a learner endpoint; ``edit(record)`` may alter or drop (None) what is sent."""

    def __init__(self, ep: Any, edit: Any) -> None:
        self.ep, self.edit = ep, edit

    def send(self, peer: str, record: Any, *, channel: Any = "control") -> bool:
        rec = self.edit(record)
        return True if rec is None else bool(self.ep.send(peer, rec, channel=channel))


class Sink:
    """Stands in for a generator connection: records what the receiver sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, record: Any, *, channel: Any = "control") -> bool:
        assert channel == "weights"
        self.sent.append(record)
        return True


def setup(gids: tuple[str, ...] = ("gen-0",), clock: FakeClock | None = None) -> Any:
    net, clock = MemoryNetwork(), clock or FakeClock()
    ep = net.bind("learner", CFG, clock=clock)
    conns = {g: net.connect("learner", hello(g), CFG, clock=clock) for g in gids}
    while ep.recv(0) is not None:
        pass
    for g, c in conns.items():
        ep.send(g, Welcome("run", g, 0, 1.0))
        assert c.recv(0) is not None and c.ready
    return ep, conns, clock


def run(
    ep: Any, pub: WeightPublisher, rxs: dict[str, WeightReceiver], conns: dict[str, Any]
) -> dict[str, list[VerifiedWeights]]:
    """Drive both sides until nothing moves; the receivers 'load' what they verify."""
    ready: dict[str, list[VerifiedWeights]] = {g: [] for g in rxs}
    for _ in range(10_000):
        moved = pub.pump()
        for g, c in conns.items():
            while (inc := c.recv(0)) is not None:
                moved += 1
                if inc.channel != "weights":
                    continue  # heartbeats etc.
                got = rxs[g].handle(inc.record)
                if got is not None:
                    ready[g].append(got)
                    rxs[g].loaded(got.version)
        while (inc := ep.recv(0)) is not None:
            moved += 1
            assert inc.channel != "weights" or pub.handle(inc.peer, inc.record)
        if not moved:
            return ready
    raise AssertionError("weight sync did not settle")


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_push_verify_ack_in_memory() -> None:
    ep, conns, _ = setup(("gen-0", "gen-1"))
    pub = WeightPublisher(ep, chunk_bytes=8192, window=3)
    rxs = {g: WeightReceiver(c) for g, c in conns.items()}
    for g in conns:
        pub.add_generator(g)
    data = blob(100_000)
    ann = pub.publish_blob(1, data)
    assert ann.num_chunks == 13 and ann.digest == hashlib.sha256(data).hexdigest()
    ready = run(ep, pub, rxs, conns)
    for g in conns:
        (w,) = ready[g]
        assert w.version == 1 and bytes(w.blob) == data
        assert pub.serving(g) == 1 and not pub.gave_up(g)
    assert pub.generators() == {"gen-0": 1, "gen-1": 1}


def test_slow_generator_costs_at_most_a_window() -> None:
    ep, conns, _ = setup()
    pub = WeightPublisher(ep, chunk_bytes=1000, window=4)
    pub.add_generator("gen-0")
    pub.publish_blob(1, blob(100_000))
    for _ in range(50):  # the generator never reads: no credit comes back
        pub.pump()
    queued = list(conns["gen-0"].inbox.q)
    assert len(queued) == 1 + 4  # the announce and `window` chunks, nothing more
    rx = WeightReceiver(conns["gen-0"])
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"][0].version == 1


def test_late_joiner_gets_the_current_version_only() -> None:
    ep, conns, _ = setup()
    sent: list[Any] = []

    def record(r: Any) -> Any:
        sent.append(r)
        return r

    pub = WeightPublisher(Tamper(ep, record), chunk_bytes=4096)
    pub.publish_blob(1, blob(10_000, 1))
    pub.publish_blob(2, blob(10_000, 2))
    assert pub.pump() == 0  # nobody to send to
    pub.add_generator("gen-0", serving_version=-1)
    ready = run(ep, pub, {"gen-0": WeightReceiver(conns["gen-0"])}, conns)
    assert [w.version for w in ready["gen-0"]] == [2]
    assert {r.version for r in sent} == {2}
    pub.add_generator("gen-1", serving_version=2)  # already current: nothing to send
    assert pub.pump() == 0
    with pytest.raises(WeightsRefused, match="not newer"):
        pub.publish_blob(2, b"x")


def test_newer_announce_supersedes_an_incomplete_transfer() -> None:
    ep, conns, _ = setup()
    pub = WeightPublisher(ep, chunk_bytes=1000, window=2)
    rx = WeightReceiver(conns["gen-0"])
    pub.add_generator("gen-0")
    pub.publish_blob(1, blob(10_000, 1))
    pub.pump()
    for _ in range(3):  # announce + 2 chunks of v1 arrive; credits go back
        inc = conns["gen-0"].recv(0)
        assert inc is not None and rx.handle(inc.record) is None
    assert rx.receiving == 1
    new = blob(7_000, 2)
    pub.publish_blob(2, new)
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert [(w.version, bytes(w.blob)) for w in ready["gen-0"]] == [(2, new)]
    assert rx.counts["superseded"] == 1 and pub.serving("gen-0") == 2


def chunks_of(data: bytes, version: int, size: int) -> tuple[WeightAnnounce, list[WeightChunk]]:
    n = -(-len(data) // size)
    ann = WeightAnnounce(version, hashlib.sha256(data).hexdigest(), len(data), size, n)
    parts = [data[i * size : (i + 1) * size] for i in range(n)]
    return ann, [WeightChunk(version, i, i * size, p, zlib.crc32(p)) for i, p in enumerate(parts)]


def test_duplicate_and_out_of_order_chunks() -> None:
    data = blob(50_000)
    ann, chunks = chunks_of(data, 3, 4096)
    feed = chunks + chunks[2:7] + chunks[:1]
    random.Random(5).shuffle(feed)
    sink = Sink()
    rx = WeightReceiver(sink)
    assert rx.handle(ann) is None
    out = [w for c in feed if (w := rx.handle(c)) is not None]
    assert len(out) == 1 and bytes(out[0].blob) == data
    credits = [r for r in sink.sent if isinstance(r, Ack) and r.kind == "chunk"]
    assert len(credits) == len(feed)  # one credit per chunk frame, useful or not
    assert rx.handle(chunks[0]) is None  # after completion: ignored (and credited)
    assert rx.handle(ann) is None  # re-announce while loading: ignored
    rx.loaded(3)
    rx.handle(ann)  # re-announce after loading: re-acknowledged
    assert isinstance(sink.sent[-1], Ack) and sink.sent[-1].kind == "weights"


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda c: dataclasses.replace(c, data=b"\xff" + c.data[1:]), "crc32"),
        (lambda c: dataclasses.replace(c, offset=c.offset + 1), "offset"),
        (
            lambda c: dataclasses.replace(c, data=c.data[:-1], crc32=zlib.crc32(c.data[:-1])),
            "bytes",
        ),
        (lambda c: dataclasses.replace(c, index=99), "num_chunks"),
    ],
)
def test_receiver_refuses_a_bad_chunk(bad: Any, reason: str) -> None:
    ann, chunks = chunks_of(blob(20_000), 1, 4096)
    sink = Sink()
    rx = WeightReceiver(sink)
    rx.handle(ann)
    out = [rx.handle(bad(c) if c.index == 2 else c) for c in chunks]
    assert out == [None] * len(chunks) and rx.receiving == -1
    (nack,) = [r for r in sink.sent if isinstance(r, Nack)]
    assert nack.kind == "weights" and nack.version == 1 and reason in nack.reason


def test_receiver_refuses_oversized_or_empty_announce_and_passes_on_disk_ones() -> None:
    sink = Sink()
    rx = WeightReceiver(sink, max_total_bytes=1000)
    ann, _ = chunks_of(blob(2000), 1, 1000)
    assert rx.handle(ann) is None and rx.receiving == -1
    assert isinstance(sink.sent[-1], Nack) and "max_total_bytes" in sink.sent[-1].reason
    nothing = dataclasses.replace(ann, version=2, total_bytes=500, chunk_bytes=0, num_chunks=0)
    assert rx.handle(nothing) is None and "neither" in sink.sent[-1].reason
    on_disk = dataclasses.replace(nothing, version=3, path="/ckpt/v3")
    got = rx.handle(on_disk)
    assert got is not None and got.version == 3 and got.blob == bytearray()
    assert got.directory == "/ckpt/v3"  # read (and checked) by the engine


def corrupt_once(index: int, fix_crc: bool, times: int) -> Any:
    left = [times]

    def edit(rec: Any) -> Any:
        if isinstance(rec, WeightChunk) and rec.index == index and left[0] > 0:
            left[0] -= 1
            data = bytes([rec.data[0] ^ 1]) + rec.data[1:]
            return dataclasses.replace(
                rec, data=data, crc32=zlib.crc32(data) if fix_crc else rec.crc32
            )
        return rec

    return edit


@pytest.mark.parametrize("fix_crc", [False, True])  # caught by the crc32 / only by the sha256
def test_corruption_is_nacked_and_retried(fix_crc: bool) -> None:
    ep, conns, _ = setup()
    pub = WeightPublisher(Tamper(ep, corrupt_once(3, fix_crc, 1)), chunk_bytes=1000, window=3)
    rx = WeightReceiver(conns["gen-0"])
    pub.add_generator("gen-0")
    data = blob(9_500)
    pub.publish_blob(1, data)
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert [bytes(w.blob) for w in ready["gen-0"]] == [data]  # the retry went through
    assert pub.counts["nacked"] == 1 and pub.counts["retries"] == 1 and rx.counts["nacked"] == 1


def tensors_blob(n: int) -> tuple[bytes, list[TensorMeta]]:
    """A blob of three uint8 tensors (sorted names) and their metadata: a real weight set."""
    data = blob(n, 7)
    cut = [0, n // 3, 2 * n // 3, n]
    metas = [TensorMeta(f"t{i}", "uint8", [cut[i + 1] - cut[i]], cut[i], cut[i + 1] - cut[i],
                        hashlib.sha256(data[cut[i] : cut[i + 1]]).hexdigest()) for i in range(3)]  # fmt: skip
    return data, metas


@pytest.mark.parametrize("times", [1, 10**9])  # once: re-fetched; always: never served
def test_a_corrupt_piece_is_named_and_refetched_alone(times: int) -> None:
    """Tree digest (docs/CONTRACTS.md 6): a chunk corrupted past its crc32 fails its piece's
    sha256 as it arrives; only that chunk is sent again (not the set), then the set is served. A piece
    that stays corrupt is refused after max_refetch re-fetches and never served."""
    ep, conns, _ = setup()
    sent: list[int] = []

    def count(rec: Any) -> Any:
        if isinstance(rec, WeightChunk):
            sent.append(rec.index)
        return corrupting(rec)

    corrupting = corrupt_once(4, True, times)
    pub = WeightPublisher(Tamper(ep, count), chunk_bytes=1000, window=3, max_attempts=1)
    rx = WeightReceiver(conns["gen-0"], max_refetch=2)
    pub.add_generator("gen-0")
    data, metas = tensors_blob(9_500)
    ann = pub.publish_blob(1, data, tensors=metas)
    assert ann.digest_kind == "sha256-tree" and ann.digest_chunk_bytes == 1000
    assert len(ann.chunk_digests) == ann.num_chunks == 10
    ready = run(ep, pub, {"gen-0": rx}, conns)
    if times == 1:
        assert [bytes(w.blob) for w in ready["gen-0"]] == [data]
        assert sorted(sent) == sorted([*range(10), 4])  # 11 chunk frames: chunk 4 twice
        assert rx.counts["pieces_refetched"] == 1 and pub.counts["chunks_resent"] == 1
        assert pub.counts["retries"] == 0 and rx.counts["nacked"] == 0 and pub.serving("gen-0") == 1
        (w,) = ready["gen-0"]
        assert isinstance(w, VerifiedWeights) and bytes(w.state()["t1"].numpy()) == data[3166:6333]
    else:
        assert ready["gen-0"] == [] and rx.serving == -1
        assert rx.counts["pieces_refetched"] == 3 and sent.count(4) == 3  # 1 + max_refetch
        assert pub.counts["nacked"] == 1 and pub.counts["gave_up"] == 1


def test_persistent_corruption_is_never_served() -> None:
    ep, conns, _ = setup()
    tamper = Tamper(ep, corrupt_once(0, True, 10**9))
    pub = WeightPublisher(tamper, chunk_bytes=1000, window=3, max_attempts=3)
    rx = WeightReceiver(conns["gen-0"])
    pub.add_generator("gen-0")
    pub.publish_blob(1, blob(5_000))
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert ready["gen-0"] == [] and rx.serving == -1
    assert pub.counts["nacked"] == 3 and pub.counts["gave_up"] == 1 and pub.gave_up("gen-0")


def test_a_refused_version_is_announced_again_after_a_growing_wait() -> None:
    """A generator that cannot take a version now (a Nack: out of memory beside the learner,
    on an H100) gets retry_delay_s, then twice that, before the next transfer starts; it loads
    the version once it can, and only max_attempts refusals give it up."""
    clock = FakeClock()
    ep, conns, _ = setup(clock=clock)
    refusals = [2]

    class Busy(WeightReceiver):
        def handle(self, rec: Any) -> Any:
            got = super().handle(rec)
            if got is not None and refusals[0]:
                refusals[0] -= 1
                self.load_failed(got.version, "CUDA out of memory (the test's)")
                return None
            return got

    pub = WeightPublisher(ep, chunk_bytes=1000, window=3, clock=clock, retry_delay_s=1.0)
    rx = Busy(conns["gen-0"])
    pub.add_generator("gen-0")
    data = blob(3_000)
    pub.publish_blob(1, data)
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"] == []  # refused once, waiting
    assert pub.counts["nacked"] == 1 and pub.counts["retries"] == 1 and not pub.gave_up("gen-0")
    clock.advance(0.9)
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"] == []  # not yet: nothing was sent
    assert pub.counts["nacked"] == 1
    clock.advance(0.2)  # 1.1 s: the second transfer, refused too; now 2 s to wait
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"] == [] and pub.counts["nacked"] == 2
    clock.advance(1.5)
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"] == []
    clock.advance(0.6)
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert [bytes(w.blob) for w in ready["gen-0"]] == [data] and pub.serving("gen-0") == 1
    assert pub.counts["retries"] == 2 and pub.counts["gave_up"] == 0


def test_stalled_transfer_restarts() -> None:
    clock = FakeClock()
    ep, conns, _ = setup(clock=clock)
    dropped = [False]

    def drop_chunk_4(rec: Any) -> Any:
        if isinstance(rec, WeightChunk) and rec.index == 4 and not dropped[0]:
            dropped[0] = True
            return None  # lost on a reconnect: its credit never comes back
        return rec

    pub = WeightPublisher(
        Tamper(ep, drop_chunk_4), chunk_bytes=1000, window=3, stall_timeout_s=30, clock=clock
    )
    rx = WeightReceiver(conns["gen-0"])
    pub.add_generator("gen-0")
    data = blob(8_000)
    pub.publish_blob(1, data)
    assert run(ep, pub, {"gen-0": rx}, conns)["gen-0"] == []  # stuck: a credit is missing
    clock.advance(31)
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert [bytes(w.blob) for w in ready["gen-0"]] == [data]
    assert pub.counts["stalled"] == 1 and rx.counts["resumed"] == 1
    assert rx.counts["duplicate"] == 4  # the restart resent 0..3 (kept), then 4 completed it


def test_over_zmq_tcp_10mb_in_1mb_chunks_then_a_corrupt_version() -> None:
    cfg = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=5.0, linger_ms=0)
    ep = ZmqLearnerEndpoint(cfg, control="tcp://127.0.0.1:*", weights="tcp://127.0.0.1:*")
    conn = ZmqGeneratorConnection(
        cfg, hello(), control=ep.endpoints["control"], weights=ep.endpoints["weights"]
    )
    corrupt = [False]

    def edit(rec: Any) -> Any:
        if corrupt[0] and isinstance(rec, WeightChunk) and rec.index == 7:
            return dataclasses.replace(rec, data=b"\0" * len(rec.data))
        return rec

    pub = WeightPublisher(Tamper(ep, edit), chunk_bytes=1 << 20, window=4, max_attempts=1)
    rx = WeightReceiver(conn)
    try:
        end = time.monotonic() + 5
        while (inc := ep.recv(0.05)) is None:
            assert time.monotonic() < end
        pub.add_generator(inc.peer)

        def settle(timeout_s: float = 20) -> list[VerifiedWeights]:
            got: list[VerifiedWeights] = []
            end = time.monotonic() + timeout_s
            while pub._gens["gen-0"].sending != -1:
                assert time.monotonic() < end, "weights did not arrive in time"
                pub.pump()
                while (inc := conn.recv(0.001)) is not None:
                    if (w := rx.handle(inc.record)) is not None:
                        got.append(w)
                        rx.loaded(w.version)
                while (inc := ep.recv(0)) is not None:
                    pub.handle(inc.peer, inc.record)
            return got

        data = os.urandom(10 << 20)
        assert pub.publish_blob(1, data).num_chunks == 10
        (w,) = settle()
        assert w.version == 1 and bytes(w.blob) == data and pub.serving("gen-0") == 1
        corrupt[0] = True
        pub.publish_blob(2, os.urandom(10 << 20))
        assert settle() == []  # Nack: v2 never handed to the engine
        assert rx.counts["nacked"] == 1 and rx.serving == 1 and pub.gave_up("gen-0")
    finally:
        conn.close(None)
        ep.close()


def test_lost_announce_is_nacked_and_restarted() -> None:
    ep, conns, _ = setup()
    lost = [False]

    def drop_announce(rec: Any) -> Any:
        if isinstance(rec, WeightAnnounce) and not lost[0]:
            lost[0] = True
            return None
        return rec

    pub = WeightPublisher(Tamper(ep, drop_announce), chunk_bytes=1000, window=2)
    rx = WeightReceiver(conns["gen-0"])
    pub.add_generator("gen-0")
    data = blob(6_000)
    pub.publish_blob(1, data)
    ready = run(ep, pub, {"gen-0": rx}, conns)
    assert [bytes(w.blob) for w in ready["gen-0"]] == [data]
    assert rx.counts["nacked"] == 1 and pub.counts["retries"] == 1


def test_heartbeat_version_covers_a_lost_final_ack() -> None:
    ep, conns, _ = setup()
    pub = WeightPublisher(Tamper(ep, lambda r: r), chunk_bytes=1000)
    pub.add_generator("gen-0")
    pub.publish_blob(1, blob(3_000))
    pub.pump()
    assert not pub.gave_up("gen-0") and pub.serving("gen-0") == -1
    pub.observe("gen-0", 1)
    assert pub.serving("gen-0") == 1 and pub.pump() == 0
