"""InFlightLedger: the orderings that could lose a sample or train it twice."""

from __future__ import annotations

import json
import random

import pytest

from pipeline.core.ledger import InFlightLedger, LedgerError, Redispatch
from tests.pipeline import rollout


def test_happy_path_and_settle_forgets() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 2)
    assert led.inflight() == 2 and led.inflight("a") == 2
    assert led.receive(rollout("w", 0, "a")) == "accepted"
    assert led.receive(rollout("w", 1, "a")) == "accepted"
    assert led.is_received("w") and led.inflight() == 0
    led.settle("w", [0, 1])
    assert led.snapshot()["items"] == {}
    assert led.receive(rollout("w", 1, "a")) == "duplicate"  # late copy of a finished item
    assert led.receive(rollout("nope", 0, "a")) == "unknown"
    with pytest.raises(LedgerError, match="complete"):
        led.dispatch("w", "b", 2)


def test_die_before_any_sample() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 3)
    assert led.generator_died("a") == [Redispatch("w", 3, (0, 1, 2))]
    assert led.receive(rollout("w", 0, "a")) == "duplicate"  # from the dead one: discarded
    led.dispatch("w", "b", 3, indices=[0, 1, 2])
    assert [led.receive(rollout("w", i, "b")) for i in range(3)] == ["accepted"] * 3
    assert led.counts["late"] == 1


def test_die_mid_group_redispatches_only_missing_indices() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 4)
    assert led.receive(rollout("w", 0, "a")) == "accepted"
    assert led.receive(rollout("w", 2, "a")) == "accepted"
    (rd,) = led.generator_died("a")
    assert rd == Redispatch("w", 4, (1, 3))
    with pytest.raises(LedgerError, match="accepted"):
        led.dispatch("w", "b", 4)  # re-requesting accepted samples would train them twice
    led.dispatch("w", "b", 4, indices=rd.indices)
    assert led.state("w") == ["accepted", "assigned to 'b'", "accepted", "assigned to 'b'"]
    assert led.receive(rollout("w", 1, "b")) == "accepted"
    assert led.receive(rollout("w", 3, "b")) == "accepted"
    assert led.is_received("w")


def test_duplicate_after_redispatch_either_order() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 1)
    led.generator_died("a")  # declared dead, but only partitioned
    led.dispatch("w", "b", 1, indices=[0])
    assert led.receive(rollout("w", 0, "a")) == "duplicate"  # the old owner's late result
    assert led.receive(rollout("w", 0, "b")) == "accepted"
    assert led.receive(rollout("w", 0, "b")) == "duplicate"  # the same frame twice
    assert led.counts["accepted"] == 1 and led.counts["duplicate"] == 2


def test_reorder_and_sender_is_authoritative() -> None:
    led = InFlightLedger()
    led.dispatch("w1", "a", 3)
    led.dispatch("w2", "a", 2)
    order = [("w2", 1), ("w1", 2), ("w1", 0), ("w2", 0), ("w1", 1)]
    assert [led.receive(rollout(w, i, "a")) for w, i in order] == ["accepted"] * 5
    led.dispatch("w3", "a", 1)
    assert led.receive(rollout("w3", 0, "a"), sender="b") == "duplicate"  # b does not own it
    assert led.receive(rollout("w3", 5, "a")) == "unknown"  # no such index
    assert led.receive(rollout("w3", 0, ""), sender="") == "unknown"
    assert led.generator_died("a") == [Redispatch("w3", 1, (0,))]


def test_returned_work() -> None:
    led = InFlightLedger()
    led.dispatch("w1", "a", 2)
    led.dispatch("w2", "a", 2)
    led.receive(rollout("w1", 0, "a"))
    assert led.returned("a", ["w1", "zzz"]) == [Redispatch("w1", 2, (1,))]
    assert led.inflight("a") == 2 and led.unassigned() == [Redispatch("w1", 2, (1,))]


def test_split_group_across_generators() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 4, indices=[0, 1])
    led.dispatch("w", "b", 4, indices=[2, 3])
    assert led.receive(rollout("w", 2, "a")) == "duplicate"
    with pytest.raises(LedgerError, match="assigned to 'a'"):
        led.dispatch("w", "c", 4, indices=[1])
    with pytest.raises(LedgerError, match="has 4 samples"):
        led.dispatch("w", "c", 3, indices=[1])
    assert led.generator_died("b") == [Redispatch("w", 4, (2, 3))]


@pytest.mark.parametrize("requeue_accepted", [False, True])
def test_snapshot_restore_after_kill(requeue_accepted: bool) -> None:
    led = InFlightLedger()
    led.dispatch("w1", "a", 3)
    led.dispatch("w2", "b", 2)
    led.receive(rollout("w1", 0, "a"))
    led.receive(rollout("w1", 1, "a"))
    led.settle("w1", [0])  # trained before the checkpoint; sample 1 sits in the buffer
    snap = json.loads(json.dumps(led.snapshot()))  # what the checkpoint holds
    new, todo = InFlightLedger.restore(snap, requeue_accepted=requeue_accepted)
    w1 = (1, 2) if requeue_accepted else (2,)
    assert todo == [Redispatch("w1", 3, w1), Redispatch("w2", 2, (0, 1))]
    assert new.receive(rollout("w2", 0, "b")) == "duplicate"  # old run's work: re-dispatched
    for rd in todo:
        new.dispatch(rd.work_id, "c", rd.n, indices=rd.indices)
    assert new.receive(rollout("w1", 0, "c")) == "duplicate"  # settled: never again
    assert [new.receive(rollout("w1", i, "c")) for i in w1] == ["accepted"] * len(w1)
    assert new.is_received("w1")
    with pytest.raises(LedgerError, match="snapshot"):
        InFlightLedger.restore({"version": 99})


def test_settle_errors() -> None:
    led = InFlightLedger()
    led.dispatch("w", "a", 2)
    with pytest.raises(LedgerError, match="not accepted"):
        led.settle("w", [0])
    with pytest.raises(LedgerError, match="unknown"):
        led.settle("x", [0])


def _owned(led: InFlightLedger, w: str) -> list[tuple[int, str]]:
    states = [] if w in led._done or w not in led._items else led.state(w)
    return [(i, s.split("'")[1]) for i, s in enumerate(states) if s.startswith("assigned")]


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_are_exactly_once(seed: int) -> None:
    """Deaths, returns, duplicates, reorders, kill -9 + restore: each sample trained once."""
    rng = random.Random(seed)
    led = InFlightLedger()
    gens = ["g0", "g1", "g2"]
    sizes = {f"w{k}": rng.randint(1, 4) for k in range(12)}
    network: list[tuple[str, int, str]] = []  # rollouts on the wire (duplicated, reordered)
    buffer: list[tuple[str, int]] = []  # accepted, not yet trained
    trained: dict[tuple[str, int], int] = {}
    for w, n in sizes.items():
        led.dispatch(w, rng.choice(gens), n)
    for _ in range(400):
        r = rng.random()
        if r < 0.08:
            led.generator_died(rng.choice(gens))  # re-dispatched below via unassigned()
        elif r < 0.12:
            led.returned(rng.choice(gens), rng.sample(sorted(sizes), 3))
        elif r < 0.16:  # kill -9; the buffer survived with the checkpoint, or not
            persisted = rng.random() < 0.5
            snap = json.loads(json.dumps(led.snapshot()))
            led, _ = InFlightLedger.restore(snap, requeue_accepted=not persisted)
            buffer = buffer if persisted else []
        elif r < 0.4 and buffer:
            w, i = buffer.pop(rng.randrange(len(buffer)))
            led.settle(w, [i])
            trained[(w, i)] = trained.get((w, i), 0) + 1
        for rd in led.unassigned():
            if rng.random() < 0.7:
                led.dispatch(rd.work_id, rng.choice(gens), rd.n, indices=rd.indices)
        for w in sizes:
            for i, g in _owned(led, w):
                if rng.random() < 0.3:
                    network += [(w, i, g)] * rng.choice([1, 1, 2])
        rng.shuffle(network)
        keep = rng.randint(0, len(network))
        for w, i, g in network[keep:]:
            if led.receive(rollout(w, i, g)) == "accepted":
                buffer.append((w, i))
        network = network[:keep]
    for rd in led.unassigned():  # calm down: deliver what is left, once
        led.dispatch(rd.work_id, "final", rd.n, indices=rd.indices)
    for w in sizes:
        for i, g in _owned(led, w):
            assert led.receive(rollout(w, i, g)) == "accepted"
            buffer.append((w, i))
    for w, i in buffer:
        led.settle(w, [i])
        trained[(w, i)] = trained.get((w, i), 0) + 1
    assert trained == {(w, i): 1 for w, n in sizes.items() for i in range(n)}
    assert led.snapshot()["items"] == {}
