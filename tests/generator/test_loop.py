"""GeneratorLoop with a fake engine: ordering, bounded in-flight, reward failures, shutdown,
reconnect (scripted connection and pipeline's in-memory transport)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from generator.loop import FatalError, GeneratorLoop
from generator.reward_runner import RewardRunner
from proto.records import Ack, Goodbye, Hello, Nack, RolloutBatch, TensorMeta, Welcome, WorkReturn
from tests.generator.loop_fakes import (
    DIGEST,
    GID,
    FakeClock,
    FakeEngine,
    generated,
    item,
    kinds,
    length_reward,
    make,
    on_disk,
    spin,
    to_rollouts,
    welcome,
)
from weights.transports import open_receiver


# -- ordering -------------------------------------------------------------------------------
def test_welcome_then_weights_before_any_work() -> None:
    loop, engine, conn, log = make(version=0)
    conn.push(item("early"))  # work before the Welcome is held, not generated
    spin(loop)
    assert not any(e[0] == "generate" for e in log) and loop.held == 1
    conn.push(welcome(version=2), item("w1"))
    spin(loop)
    assert not any(e[0] == "generate" for e in log), "generated below the Welcome's version"
    assert not loop.serving
    conn.push(on_disk(2), channel="weights")
    spin(loop)
    ev = kinds(log)
    load, first_gen = ev.index("load"), ev.index("generate")
    assert ev.index("recv:Welcome") < load < first_gen < ev.index("send:RolloutBatch")
    assert log[load][1:3] == (2, DIGEST) and log[load][3].directory == "/ckpt/v2"
    assert ev.index("send:Ack") < first_gen  # weights acknowledged before serving
    (ack,) = conn.of(Ack)
    assert (ack.kind, ack.ref, ack.version) == ("weights", "2", 2)
    assert all(e[2] == 2 for e in log if e[0] == "generate")
    done = {r.rollout_id for b in conn.of(RolloutBatch) for r in b.rollouts}
    assert done == {"early/0", "early/1", "w1/0", "w1/1"}
    assert conn.statuses[-1] == (2, 0)


def test_item_waits_for_its_min_weight_version() -> None:
    loop, engine, conn, log = make(version=0)
    conn.push(welcome(0), item("later", min_version=1), item("now"))
    spin(loop)
    assert [e[1] for e in log if e[0] == "generate"] == [["now"]]
    conn.push(on_disk(1), channel="weights")
    spin(loop)
    assert [e[1:] for e in log if e[0] == "generate"] == [(["now"], 0), (["later"], 1)]


def test_an_announcement_repeated_while_its_version_loads_is_loaded_once() -> None:
    """A generator back from a pause hears a version twice (the announcement queued before the
    pause, and the one its re-Hello brings): the second, arriving while the first loads, is not
    loaded again (before: the engine refused 'version 2 is not newer than 2', the generator
    Nacked the weights and left the run)."""
    loop, engine, conn, log = make(version=1, threaded=True)
    engine.load_gate = threading.Event()
    conn.push(welcome(1))
    conn.push(on_disk(2), channel="weights")
    deadline = time.monotonic() + 10
    while "load" not in kinds(log) and time.monotonic() < deadline:
        loop.step(0.01)
    assert "load" in kinds(log), "the first announcement was not loaded"
    conn.push(on_disk(2), channel="weights")  # again, while v2 loads
    for _ in range(5):
        loop.step(0.01)
    engine.load_gate.set()
    deadline = time.monotonic() + 10
    while loop.version < 2 and time.monotonic() < deadline:
        loop.step(0.01)
    for _ in range(5):
        loop.step(0.01)
    loop.stop()
    assert loop.version == 2 and engine.weight_version == 2
    assert [e[1] for e in log if e[0] == "load"] == [2]  # loaded once
    assert not conn.of(Nack), conn.of(Nack)
    assert {a.version for a in conn.of(Ack) if a.kind == "weights"} == {2}


def test_an_inflight_engine_gets_a_version_during_its_batch_and_it_is_acknowledged() -> None:
    """inflight_updates: a version announced while a batch runs is loaded beside it (its own
    lane), staged, swapped in by the batch, and acknowledged as soon as the engine serves it,
    before the batch ends (before: the load waited for the batch, a version's delivery
    included the rest of the batch)."""
    from tests.generator.loop_fakes import InflightEngine

    loop, engine, conn, log = make(threaded=True, engine_cls=InflightEngine)
    assert isinstance(engine, InflightEngine)
    engine.gate = threading.Event()
    conn.push(welcome(0), item("long"))
    deadline = time.monotonic() + 10
    while not engine.running.is_set() and time.monotonic() < deadline:
        loop.step(0.01)
    assert engine.running.is_set(), "the batch did not start"
    conn.push(on_disk(1), channel="weights")
    while not conn.of(Ack) and time.monotonic() < deadline:
        loop.step(0.01)
    acks = [a for a in conn.of(Ack) if a.kind == "weights"]
    assert [a.version for a in acks] == [1] and loop.version == 1
    assert engine.running.is_set(), "acknowledged only after the batch ended"
    assert not conn.of(RolloutBatch)
    ev = kinds(log)
    assert ev.index("stage") < ev.index("swap") < ev.index("send:Ack")
    engine.gate.set()
    while not conn.of(RolloutBatch) and time.monotonic() < deadline:
        loop.step(0.01)
    loop.stop()
    assert conn.of(RolloutBatch), "the batch never finished"
    assert not conn.of(Nack) and "load" not in ev  # staged and swapped, never loaded apart


def test_a_version_swapped_in_mid_batch_wakes_the_loop_that_acknowledges_it() -> None:
    """An engine that says when it swapped a staged version in (notify_swaps: the torch
    engine's on_swapped) wakes the loop's receive: the Ack goes out at once, not at the next
    poll (here a receive of 5 s; before, the swap waited for it)."""
    from generator.loop import GeneratorLoop
    from generator.reward_runner import RewardRunner
    from tests.generator.loop_fakes import (
        FakeConnection,
        InflightEngine,
        length_reward,
        to_rollouts,
    )

    class Notifying(InflightEngine):
        def __init__(self, log: list[Any], version: int = 0) -> None:
            super().__init__(log, version)
            self.on_swapped: Any = None

        def notify_swaps(self, callback: Any) -> None:
            self.on_swapped = callback

        def _apply(self) -> None:
            staged = self.staged is not None
            super()._apply()
            if staged and self.on_swapped is not None:
                self.on_swapped()

    class Waking(FakeConnection):
        woken = threading.Event()

        def waker(self) -> Any:
            return self.woken.set

        def recv(self, timeout_s: float = 0.0) -> Any:
            end = time.monotonic() + timeout_s  # a wake ends the wait with nothing received
            while self.inbox.empty() and not self.woken.is_set() and time.monotonic() < end:
                time.sleep(0.001)
            self.woken.clear()
            return super().recv(0.0)

    log: list[Any] = []
    engine, conn = Notifying(log), Waking(log)
    loop = GeneratorLoop(engine, conn, RewardRunner(length_reward, mode="inline"),
                         to_rollouts=to_rollouts, generator_id=GID, max_inflight=4,
                         batch_wait_s=0.0, threaded=True,
                         weights=open_receiver(conn, GID, serving_version=0))  # fmt: skip
    assert engine.on_swapped is not None, "the loop did not ask to be woken"
    engine.gate = threading.Event()
    conn.push(welcome(0), item("long"))
    deadline = time.monotonic() + 10
    while not engine.running.is_set() and time.monotonic() < deadline:
        loop.step(0.01)
    conn.push(on_disk(1), channel="weights")
    t0 = time.monotonic()
    while not [a for a in conn.of(Ack) if a.kind == "weights"] and time.monotonic() < deadline:
        loop.step(5.0)
    took = time.monotonic() - t0
    assert [a.version for a in conn.of(Ack) if a.kind == "weights"] == [1]
    assert took < 2.0, f"acknowledged {took:.2f} s after the announce: the swap did not wake it"
    engine.gate.set()
    loop.stop()


def test_an_engine_batch_is_sent_in_one_rollout_batch_with_rewards() -> None:
    """The items of one engine batch go out together (the learner records and flushes once per
    message), acknowledged per item; a batch over MESSAGE_ROLLOUTS is split between items."""
    loop, engine, conn, _ = make(max_batch_items=3)
    conn.push(welcome(), item("a", n=3), item("b", n=1))
    spin(loop)
    batches = conn.of(RolloutBatch)
    assert [[r.rollout_id for r in b.rollouts] for b in batches] == [["a/0", "a/1", "a/2", "b/0"]]
    r = batches[0].rollouts[0]
    assert r.reward == 4.0 and r.generator_id == GID
    assert {"gen_time_s", "queue_time_s", "reward_time_s"} <= set(r.metrics)
    assert loop.outbox.unacked == ["a", "b"] and loop.stats.counts["rollouts_sent"] == 4
    conn.push(Ack("rollout", "a"), Ack("rollout", "b/0"))  # a group's Ack, a rollout's
    spin(loop)
    assert loop.outbox.unacked == []


def test_a_large_engine_batch_is_split_between_items(monkeypatch: Any) -> None:
    import generator.outbox

    monkeypatch.setattr(generator.outbox, "MESSAGE_ROLLOUTS", 4)
    loop, _, conn, _ = make(max_batch_items=4)
    conn.push(welcome(), item("a", n=3), item("b", n=2), item("c", n=1), item("d", n=5))
    spin(loop)
    sent = [[r.rollout_id for r in b.rollouts] for b in conn.of(RolloutBatch)]
    assert sent == [["a/0", "a/1", "a/2"], ["b/0", "b/1", "c/0"],
                    ["d/0", "d/1", "d/2", "d/3", "d/4"]]  # fmt: skip


# -- bounded in-flight ----------------------------------------------------------------------
def test_never_holds_more_than_max_inflight() -> None:
    loop, engine, conn, _ = make(max_inflight=3, max_batch_items=2, threaded=True, ack_wait_s=0)
    engine.gate = threading.Event()
    conn.push(welcome(), *[item(f"w{i}") for i in range(10)])
    worker = threading.Thread(target=loop.run)
    worker.start()
    deadline = time.monotonic() + 10
    while len(conn.of(WorkReturn)) < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    returned = [w for r in conn.of(WorkReturn) for w in r.work_ids]
    assert returned == [f"w{i}" for i in range(3, 10)]
    assert all("max_inflight=3" in r.reason for r in conn.of(WorkReturn))
    engine.gate.set()
    # keep the learner's side saturated: more work as soon as items finish
    for i in range(10, 30):
        conn.push(item(f"w{i}"))
        time.sleep(0.005)
    deadline = time.monotonic() + 10
    while loop.held and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    worker.join(10)
    assert not worker.is_alive()
    assert max(inflight for _, inflight in conn.statuses) <= 3
    assert loop.stats.max_held <= 3 and engine.max_batch <= 2
    done = [r.work_id for b in conn.of(RolloutBatch) for r in b.rollouts if r.sample_index == 0]
    returned = [w for r in conn.of(WorkReturn) for w in r.work_ids]
    assert len(done) == len(set(done))  # nothing generated twice
    assert sorted(done + returned) == sorted(f"w{i}" for i in range(30))  # nothing lost


# -- rewards --------------------------------------------------------------------------------
def test_reward_failures_are_recorded_not_fatal() -> None:
    def detok(tokens: list[int]) -> str:
        if tokens and tokens[0] == 3 + (11 % 7):  # the first sample of every item
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")
        return "x" * len(tokens)

    loop, _, conn, _ = make(detokenize=detok)
    conn.push(welcome(), item("bad", task={"fail": True}), item("good"))
    spin(loop)
    (batch,) = conn.of(RolloutBatch)  # both items of the engine batch, together
    bad = [r for r in batch.rollouts if r.work_id == "bad"]
    good = [r for r in batch.rollouts if r.work_id == "good"]
    assert [r.reward for r in bad] == [None, None]
    assert bad[0].reward_info["kind"] == "exception"
    assert "detokenize" in str(bad[0].reward_info["error"])
    assert "bad task" in str(bad[1].reward_info["error"])
    assert [r.reward for r in good] == [None, 4.0]
    assert loop.stats.counts["reward_failures"] == 3 and conn.closed is None


# -- shutdown -------------------------------------------------------------------------------
@pytest.mark.parametrize("finishes", [True, False])
def test_stop_finishes_or_hands_back_and_says_goodbye(finishes: bool) -> None:
    loop, engine, conn, _ = make(max_inflight=4, max_batch_items=2, threaded=True)
    loop.drain_timeout_s = 5.0 if finishes else 0.2
    loop.ack_wait_s = 0.0
    engine.gate = threading.Event()
    conn.push(welcome(), *[item(f"w{i}") for i in range(4)])
    worker = threading.Thread(target=loop.run)
    worker.start()
    deadline = time.monotonic() + 10
    while not generated(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert generated(engine) == [(["w0", "w1"], 0)]
    loop.stop("SIGTERM")
    time.sleep(0.1)
    conn.push(item("late"))  # arrives while draining: handed back
    time.sleep(0.1)
    if finishes:
        engine.gate.set()
    worker.join(10)
    assert not worker.is_alive()
    returned = {w: r.reason for r in conn.of(WorkReturn) for w in r.work_ids}
    done = {r.work_id for b in conn.of(RolloutBatch) for r in b.rollouts}
    assert {"w2", "w3", "late"} <= set(returned) and returned["w2"] == "SIGTERM"
    if finishes:
        assert done == {"w0", "w1"} and "w0" not in returned
    else:
        assert not done and "not finished within" in returned["w0"] and "w1" in returned
    assert isinstance(conn.sent[-1], Goodbye) and conn.closed == "SIGTERM"
    assert generated(engine) == [(["w0", "w1"], 0)]
    engine.gate.set()


def test_engine_failure_hands_back_work_says_goodbye_and_raises() -> None:
    loop, engine, conn, _ = make()
    engine.fail = True
    conn.push(welcome(), item("a"), item("b"))
    with pytest.raises(FatalError, match="engine exploded"):
        loop.run()
    assert sorted(w for r in conn.of(WorkReturn) for w in r.work_ids) == ["a", "b"]
    assert conn.closed is not None and conn.closed.startswith("error: FatalError")


def test_unusable_welcome_settings_are_fatal() -> None:
    def check(w: Welcome) -> None:
        if w.settings.get("numerics") != "exact":
            raise ValueError("learner wants numerics fast, we serve exact")

    loop, _, conn, _ = make(check_welcome=check)
    conn.push(welcome())
    with pytest.raises(FatalError, match="numerics"):
        loop.run()
    assert isinstance(conn.sent[-1], Goodbye)


# -- acks and reconnects --------------------------------------------------------------------
def test_reconnect_resends_unacked_only() -> None:
    loop, _, conn, _ = make()
    conn.push(welcome(), item("a"), item("b"), item("c"))
    spin(loop)
    assert loop.outbox.unacked == ["a", "b", "c"]
    conn.push(Ack("rollout", "a"), Ack("rollout", "b/0"), Ack("rollout", "b/1"))
    conn.push(Ack("rollout", "c/0"))
    spin(loop)
    assert loop.outbox.unacked == ["c"]
    conn.ready = False  # the learner went away; the connection re-Hellos
    conn.push(item("d"))
    spin(loop)
    assert len(conn.of(RolloutBatch)) == 1  # a, b, c together; d waits for a Welcome
    conn.sent.clear()
    conn.push(welcome())
    spin(loop)
    resent = [[r.rollout_id for r in b.rollouts] for b in conn.of(RolloutBatch)]
    assert sorted(resent) == [["c/0", "c/1"], ["d/0", "d/1"]]
    assert loop.stats.counts["reconnects"] == 1
    # a re-dispatch of a finished, unacknowledged item re-sends instead of regenerating
    conn.sent.clear()
    conn.push(item("c"))
    spin(loop)
    assert [b.rollouts[0].work_id for b in conn.of(RolloutBatch)] == ["c"]


def test_learner_restart_in_memory_transport_loses_and_duplicates_nothing() -> None:
    transport_config = pytest.importorskip("pipeline.net.transport.config")
    transport_memory = pytest.importorskip("pipeline.net.transport.memory")
    cfg = transport_config.TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=5.0)
    net, clock = transport_memory.MemoryNetwork(), FakeClock()
    ep1 = net.bind("learner", cfg, clock=clock)
    log: list[tuple[Any, ...]] = []
    engine = FakeEngine(log)
    hello = Hello(GID, "host", 1, ["fake"], 4, 0, 0.0)
    conn = net.connect("learner", hello, cfg, clock=clock)
    loop = GeneratorLoop(
        engine, conn, RewardRunner(length_reward, mode="inline"), to_rollouts=to_rollouts,
        generator_id=GID, max_inflight=4, batch_wait_s=0.0, threaded=False, clock=clock,
        weights=open_receiver(conn, GID, serving_version=0),
    )  # fmt: skip

    def learner_turn(ep: Any, got: dict[str, int], ack: Callable[[str], bool]) -> list[str]:
        seen = []
        while (inc := ep.recv(0.0)) is not None:
            seen.append(type(inc.record).__name__)
            if isinstance(inc.record, Hello):
                ep.send(GID, Welcome("run-1", GID, 0, 1.0))
            elif isinstance(inc.record, RolloutBatch):
                for r in inc.record.rollouts:
                    got[r.rollout_id] = got.get(r.rollout_id, 0) + 1
                    if ack(r.work_id):
                        ep.send(GID, Ack("rollout", r.rollout_id))
        return seen

    got1: dict[str, int] = {}
    assert learner_turn(ep1, got1, lambda w: False) == ["Hello"]
    for i in range(4):
        ep1.send(GID, item(f"w{i}"))
    for _ in range(3):
        spin(loop, 2)
        learner_turn(ep1, got1, lambda w: w in ("w0", "w1"))
    assert set(got1) == {f"w{i}/{j}" for i in range(4) for j in range(2)}
    spin(loop, 2)
    assert loop.outbox.unacked == ["w2", "w3"]
    ep1.send(GID, item("w4"))
    ep1.close()  # the learner dies with w4 in flight and w2, w3 unacknowledged
    spin(loop, 2)  # w4 finishes while nobody listens: queued by the transport
    ep2 = net.bind("learner", cfg, clock=clock)  # restarted learner, same address
    got2: dict[str, int] = {}
    for _ in range(6):
        clock.advance(0.5)
        learner_turn(ep2, got2, lambda w: True)
        spin(loop, 2)
    assert conn.ready and loop.stats.counts["reconnects"] >= 1  # one per Welcome received
    acked_by_1 = {f"w{i}/{j}" for i in (0, 1) for j in range(2)}
    assert not acked_by_1 & set(got2), "acknowledged rollouts were sent again"
    assert set(got2) == {f"w{i}/{j}" for i in (2, 3, 4) for j in range(2)}  # nothing lost
    assert set(got1) | set(got2) == {f"w{i}/{j}" for i in range(5) for j in range(2)}
    assert loop.outbox.unacked == []
    loop.stop()
    loop.run()
    assert conn.closed


def test_chunked_weights_through_the_weights_package() -> None:
    """weights.publisher's WeightPublisher and weights.receiver's WeightReceiver satisfy the
    loop's Receiver protocol: a chunked version reaches the engine as checked views."""
    transport_memory = pytest.importorskip("pipeline.net.transport.memory")
    publisher = pytest.importorskip("weights.publisher")
    receiver = pytest.importorskip("weights.receiver")
    torch = pytest.importorskip("torch")

    net = transport_memory.MemoryNetwork()
    ep = net.bind("learner")
    conn = net.connect("learner", Hello(GID, "host", 1, ["fake"], 4, 0, 0.0))
    log: list[tuple[Any, ...]] = []
    engine = FakeEngine(log, version=0)
    loop = GeneratorLoop(
        engine, conn, RewardRunner(length_reward, mode="inline"), to_rollouts=to_rollouts,
        generator_id=GID, max_inflight=2, batch_wait_s=0.0, threaded=False,
        weights=receiver.WeightReceiver(conn, serving_version=0),
    )  # fmt: skip
    pub = publisher.WeightPublisher(ep, chunk_bytes=100, window=2)
    a = torch.arange(60, dtype=torch.float32).reshape(3, 20)
    b = torch.ones(4, dtype=torch.bfloat16)
    raw = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    metas = [
        TensorMeta("a", "float32", [3, 20], 0, 240, hashlib.sha256(raw[:240]).hexdigest()),
        TensorMeta("b", "bfloat16", [4], 240, 8, hashlib.sha256(raw[240:]).hexdigest()),
    ]
    while (inc := ep.recv(0.1)) is not None and not isinstance(inc.record, Hello):
        pass
    ep.send(GID, Welcome("run-1", GID, 1, 1.0))
    pub.add_generator(GID, 0)
    pub.publish_blob(1, raw, tensors=metas)
    ep.send(GID, item("w0", min_version=1))
    for _ in range(50):
        pub.pump()
        loop.step(0.0)
        while (inc := ep.recv(0.0)) is not None:
            pub.handle(inc.peer, inc.record)
        if pub.serving(GID) == 1 and not loop.held:
            break
    (load,) = [e for e in log if e[0] == "load"]
    state = load[3].state()
    assert load[1] == 1 and torch.equal(state["a"], a) and torch.equal(state["b"], b)
    assert pub.serving(GID) == 1  # the receiver's Ack(kind="weights") reached the learner
    assert [e[1:] for e in log if e[0] == "generate"] == [(["w0"], 1)]
