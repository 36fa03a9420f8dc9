"""Outbox with a fake connection and clock: first sends together, resends alone, acks and
nacks, the max_unacked bound, and a random walk checking the invariant at every call."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

import generator.outbox
from generator.outbox import Outbox
from proto.records import Ack, Nack, RolloutBatch
from tests.generator.loop_fakes import FakeClock, FakeConnection, rollouts


class StrictConnection(FakeConnection):
    """Fails the test on a send while not ready (the outbox must wait for a Welcome)."""

    def send(self, record: Any, *, channel: str = "control") -> bool:
        assert self.ready, f"sent {type(record).__name__} while not connected"
        return super().send(record, channel=channel)


def make(
    *, ready: bool = True, max_unacked: int = 8, resend_after_s: float = 0.0
) -> tuple[Outbox, StrictConnection, FakeClock, Counter[str]]:
    conn, clock, counts = StrictConnection([], ready=ready), FakeClock(), Counter[str]()
    ob = Outbox(conn, max_unacked=max_unacked, resend_after_s=resend_after_s, counts=counts,
                clock=clock)  # fmt: skip
    return ob, conn, clock, counts


def sent_ids(conn: FakeConnection) -> list[list[str]]:
    """Each RolloutBatch sent so far, as its rollout ids; then forgets them."""
    out = [[r.rollout_id for r in b.rollouts] for b in conn.of(RolloutBatch)]
    conn.sent.clear()
    return out


def test_nothing_goes_out_before_a_welcome_then_each_group_alone_in_order() -> None:
    ob, conn, _, counts = make(ready=False)
    ob.add([("a", rollouts("a")), ("b", rollouts("b", n=1))])
    ob.resend_due()
    assert ob.unacked == ["a", "b"] and sent_ids(conn) == []
    conn.ready = True
    ob.on_welcome(reconnect=False)
    assert sent_ids(conn) == [["a/0", "a/1"], ["b/0"]]
    assert counts["rollouts_sent"] == 3 and counts["rollouts_resent"] == 0
    ob.resend_due()  # resend_after_s 0: sent ones wait for a reconnect
    assert sent_ids(conn) == [] and ob.unacked == ["a", "b"]


def test_one_add_goes_out_together_in_messages_cut_between_groups(monkeypatch: Any) -> None:
    monkeypatch.setattr(generator.outbox, "MESSAGE_TOKENS", 21)  # a rollout: 3 + 4 tokens
    ob, conn, _, counts = make()
    groups = [("a", rollouts("a", n=2)), ("b", rollouts("b", n=1)), ("c", rollouts("c", n=1))]
    ob.add([*groups, ("d", rollouts("d", n=4))])  # d alone is over the limit: sent alone
    assert sent_ids(conn) == [["a/0", "a/1", "b/0"], ["c/0"], ["d/0", "d/1", "d/2", "d/3"]]
    assert counts["rollouts_sent"] == 8 and ob.unacked == ["a", "b", "c", "d"]


def test_acks_forget_groups_and_rollouts_and_nacks_drop_them() -> None:
    ob, conn, clock, counts = make(resend_after_s=5.0)
    ob.add([("a", rollouts("a")), ("b", rollouts("b")), ("c", rollouts("c"))])
    ob.acknowledge(Ack("rollout", "a"))  # a whole group
    ob.acknowledge(Ack("rollout", "b/0"))  # one rollout: b waits for b/1
    assert ob.unacked == ["b", "c"] and counts["groups_acked"] == 1
    ob.acknowledge(Nack("rollout", "b/1", "log-prob mismatch"))  # refused: dropped, not retried
    assert ob.unacked == ["c"] and counts["rollouts_refused"] == 1
    assert counts["groups_acked"] == 2
    for ref in ("a", "b/0", "x", "c/7"):  # already forgotten, or never held: ignored
        ob.acknowledge(Ack("rollout", ref))
    assert ob.unacked == ["c"] and counts["groups_acked"] == 2
    sent_ids(conn)
    clock.advance(5.0)
    ob.resend_due()
    assert sent_ids(conn) == [["c/0", "c/1"]]  # only what is still unacknowledged


def test_resend_after_s_resends_each_group_alone_once_due() -> None:
    ob, conn, clock, counts = make(resend_after_s=5.0)
    ob.add([("a", rollouts("a"))])
    clock.advance(2.0)
    ob.add([("b", rollouts("b"))])
    sent_ids(conn)
    clock.advance(2.9)
    ob.resend_due()
    assert sent_ids(conn) == []
    clock.advance(0.1)  # a was sent 5 s ago, b 3 s ago
    ob.resend_due()
    assert sent_ids(conn) == [["a/0", "a/1"]] and counts["rollouts_resent"] == 2
    clock.advance(2.0)  # b due; a re-sent 2 s ago
    ob.resend_due()
    assert sent_ids(conn) == [["b/0", "b/1"]] and counts["rollouts_resent"] == 4


def test_a_reconnect_resends_everything_still_buffered() -> None:
    ob, conn, _, counts = make()
    ob.add([("a", rollouts("a")), ("b", rollouts("b"))])
    ob.acknowledge(Ack("rollout", "a"))
    conn.ready = False  # the learner went away
    ob.add([("c", rollouts("c"))])  # waits for the Welcome
    sent_ids(conn)
    conn.ready = True
    ob.on_welcome(reconnect=True)
    assert sent_ids(conn) == [["b/0", "b/1"], ["c/0", "c/1"]]
    assert counts["rollouts_sent"] == 4 and counts["rollouts_resent"] == 4


def test_resend_of_a_redispatched_group() -> None:
    ob, conn, _, counts = make()
    ob.add([("a", rollouts("a"))])
    sent_ids(conn)
    assert ob.resend("a") and sent_ids(conn) == [["a/0", "a/1"]]
    assert not ob.resend("x") and sent_ids(conn) == []
    assert counts["rollouts_resent"] == 2


def test_max_unacked_drops_the_oldest_after_sending() -> None:
    ob, conn, _, counts = make(max_unacked=2)
    ob.add([("a", rollouts("a"))])
    ob.add([("b", rollouts("b"))])
    ob.add([("c", rollouts("c"))])
    assert ob.unacked == ["b", "c"] and counts["unacked_evicted"] == 1
    ob.add([("d", rollouts("d")), ("e", rollouts("e")), ("f", rollouts("f"))])
    assert ob.unacked == ["e", "f"] and counts["unacked_evicted"] == 4
    assert [b[0].split("/")[0] for b in sent_ids(conn)] == ["a", "b", "c", "d"]  # d, e, f: one
    ob.acknowledge(Ack("rollout", "a"))  # evicted: nothing to forget
    assert counts["groups_acked"] == 0


def test_a_refused_send_is_sent_again_as_a_first_send() -> None:
    ob, conn, _, counts = make()
    conn.refuse = True
    ob.add([("a", rollouts("a")), ("b", rollouts("b"))])
    ob.resend_due()
    assert counts["send_failed"] == 3 and ob.unacked == ["a", "b"]  # the pair, then a and b
    conn.refuse = False
    ob.resend_due()
    assert sent_ids(conn) == [["a/0", "a/1"], ["b/0", "b/1"]]
    assert counts["rollouts_sent"] == 4 and counts["rollouts_resent"] == 0


def test_an_empty_group_is_forgotten_once_sent() -> None:
    ob, conn, _, _ = make(ready=False)
    ob.add([("e", [])])
    assert ob.unacked == ["e"]  # nothing to acknowledge, but not sent yet
    conn.ready = True
    ob.add([("f", [])])
    assert ob.unacked == ["e"] and sent_ids(conn) == [[]]


def test_bad_limits_are_refused() -> None:
    conn, clock = FakeConnection([]), FakeClock()
    with pytest.raises(ValueError, match="max_unacked"):
        Outbox(conn, max_unacked=0, resend_after_s=0.0, counts=Counter(), clock=clock)
    with pytest.raises(ValueError, match="resend_after_s"):
        Outbox(conn, max_unacked=1, resend_after_s=-1.0, counts=Counter(), clock=clock)


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_keeps_the_invariant(seed: int) -> None:
    """Adds, acks, nacks, disconnects, refused sends and time in random order: at most
    max_unacked groups are held, in the order they were added; a group leaves only when every
    rollout of it was acknowledged or refused, else it was evicted (and counted); nothing is
    sent while not connected; once connected and sending, no held group is left unsent."""
    rng = random.Random(seed)
    ob, conn, clock, counts = make(max_unacked=4, resend_after_s=3.0)
    order: list[str] = []  # every group added, in order
    pending: dict[str, set[str]] = {}  # group -> rollout ids not acknowledged by the test
    ever_sent: set[str] = set()
    for step in range(400):
        op = rng.choice(["add", "add", "ack", "ack", "nack", "drop", "welcome", "refuse", "tick"])
        if op == "add":
            groups = [(f"w{step}.{k}", rollouts(f"w{step}.{k}", n=rng.randint(1, 3)))
                      for k in range(rng.randint(1, 3))]  # fmt: skip
            order += [w for w, _ in groups]
            pending.update({w: {r.rollout_id for r in rs} for w, rs in groups})
            ob.add(groups)
        elif op in ("ack", "nack") and ob.unacked:
            wid = rng.choice(ob.unacked)
            ref = rng.choice([wid, *sorted(pending[wid])])
            ob.acknowledge(Ack("rollout", ref) if op == "ack" else Nack("rollout", ref, "no"))
            pending[wid] = set() if ref == wid else pending[wid] - {ref}
        elif op == "drop":
            conn.ready = False
        elif op == "welcome":
            conn.ready = True
            ob.on_welcome(reconnect=True)
        elif op == "refuse":
            conn.refuse = not conn.refuse
        else:
            clock.advance(rng.choice([0.5, 1.0, 3.0]))
            ob.resend_due()
        ever_sent |= {r.work_id for b in conn.of(RolloutBatch) for r in b.rollouts}
        conn.sent.clear()
        held = ob.unacked
        assert len(held) <= 4
        assert held == [w for w in order if w in set(held)], "not in the order added"
        gone = [w for w in order if w not in set(held)]
        evicted = [w for w in gone if pending[w]]  # left with rollouts unacknowledged
        assert counts["unacked_evicted"] == len(evicted)
        if evicted and held:
            assert order.index(evicted[-1]) < order.index(held[0]), "evicted a newer group"
        assert all(pending[w] for w in held), "a fully acknowledged group is still held"
        if op == "tick" and conn.ready and not conn.refuse:
            assert set(held) <= ever_sent, "a held group was never sent"
