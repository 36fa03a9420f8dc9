"""StalenessGate: verdicts, counting, the dispatch bound and the train barrier."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.staleness import StalenessConfigError, StalenessGate, oldest_version
from tests.pipeline import rollout


def test_verdicts_drop_policy() -> None:
    g = StalenessGate(max_staleness=2, policy="drop")
    cases = [  # (learner version, rollout version, token versions) -> (accept, staleness, reason)
        (5, 5, None, True, 0, "fresh"),
        (5, 3, None, True, 2, "fresh"),
        (5, 2, None, False, 3, "stale_dropped"),
        (5, 4, [4, 4, 2], False, 3, "stale_dropped"),  # the oldest token decides
        (5, 3, [3, 4, 5], True, 2, "fresh"),
        (5, 6, None, False, -1, "future"),
        (5, -1, None, False, 6, "invalid"),
    ]
    for lv, rv, tv, accept, s, reason in cases:
        v = g.check(lv, rollout(version=rv, token_versions=tv))
        assert (v.accept, v.staleness, v.reason, v.needs_correction) == (accept, s, reason, False)
    assert g.counts == {"fresh": 3, "stale_dropped": 2, "future": 1, "invalid": 1}


def test_keep_policy_flags_for_correction() -> None:
    g = StalenessGate(max_staleness=1, policy="keep")
    v = g.check(10, rollout(version=7))
    assert v.accept and v.needs_correction and v.reason == "stale_kept" and v.staleness == 3
    assert not g.check(10, rollout(version=10)).needs_correction
    assert not g.check(10, rollout(version=11)).accept  # "future" is never kept
    g.dispatched("w", 0)
    assert g.can_train(50)  # "keep" never waits


def test_oldest_version_ignores_empty_token_versions() -> None:
    assert oldest_version(rollout(version=4, token_versions=[])) == 4
    assert oldest_version(rollout(version=4, token_versions=[6, 5, 4])) == 4


def test_dispatch_bound() -> None:
    g = StalenessGate(max_staleness=2)
    assert g.min_dispatch_version(10) == 8
    assert g.can_dispatch(10, 8) and g.can_dispatch(10, 10)
    assert not g.can_dispatch(10, 7)  # must load newer weights first
    assert not g.can_dispatch(0, -1)  # serves nothing yet
    with pytest.raises(StalenessConfigError):
        g.dispatched("w", -1)


def test_learner_waits_for_work_about_to_expire() -> None:
    g = StalenessGate(max_staleness=2)
    g.dispatched("w1", 3)  # trainable up to version 5
    g.dispatched("w2", 4)  # up to 6
    assert g.can_train(3) and g.can_train(4)
    assert g.blocking(5) == ["w1"] and not g.can_train(5)  # stepping 5 -> 6 would waste w1
    g.settled("w1")  # it arrived (or its generator died and the coordinator released it)
    assert g.can_train(5) and not g.can_train(6)
    g.dispatched("w2", 6)  # re-dispatched to a newer generator: new deadline
    assert g.can_train(6) and g.inflight() == {"w2": 8}
    assert g.can_train(9)  # already too stale: waiting would not help


def test_learner_waits_when_everything_buffered_is_too_stale() -> None:
    g = StalenessGate(max_staleness=1)
    buffered = [rollout(version=1), rollout(version=2)]
    assert g.can_train(3, buffered)
    assert not g.can_train(4, buffered)
    assert not g.can_train(4, [])
    assert g.counts == {}  # peeking does not count


def test_max_staleness_zero_is_synchronous() -> None:
    g = StalenessGate(max_staleness=0)
    assert g.can_dispatch(3, 3) and not g.can_dispatch(3, 2)
    g.dispatched("w", 3)
    assert not g.can_train(3)  # must wait for the on-policy data
    g.settled("w")
    assert g.can_train(3)
    assert g.check(3, rollout(version=3)).accept and not g.check(4, rollout(version=3)).accept


def test_bad_settings() -> None:
    with pytest.raises(StalenessConfigError, match="max_staleness"):
        StalenessGate(-1)
    with pytest.raises(StalenessConfigError, match="policy"):
        StalenessGate(1, policy="maybe")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4), st.integers(0, 2**32))
def test_invariant_nothing_too_stale_is_trained(max_staleness: int, seed: int) -> None:
    """Random async run: generators lag, the learner steps when the gate allows."""
    rng = random.Random(seed)
    g = StalenessGate(max_staleness)
    v, gens = 0, [0, 0, 0]
    inflight: list[tuple[str, int, int]] = []  # (work id, generator, its version at dispatch)
    buffer, trained = [], []
    for step in range(200):
        i = rng.randrange(3)
        if rng.random() < 0.3:
            gens[i] = rng.randint(gens[i], v)  # generator loads some newer weights
        if rng.random() < 0.4 and g.can_dispatch(v, gens[i]):
            w = f"w{step}"
            g.dispatched(w, gens[i])
            inflight.append((w, i, gens[i]))
        if inflight and rng.random() < 0.4:
            w, gi, gv = inflight.pop(rng.randrange(len(inflight)))
            buffer.append(rollout(w, version=rng.randint(gv, max(gv, gens[gi]))))
            g.settled(w)
        if rng.random() < 0.5 and g.can_train(v):
            batch = [r for r in buffer if g.check(v, r).accept]
            trained += [(v, r.weight_version) for r in batch]
            buffer = []
            v += 1
        assert all(d >= v for d in g.inflight().values())  # nothing in flight has expired
    assert all(lv - rv <= max_staleness for lv, rv in trained)
    assert g.counts["stale_dropped"] == 0  # the barrier made dropping unnecessary
