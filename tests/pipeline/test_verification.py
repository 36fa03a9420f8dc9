"""pipeline.core.verification.LogpVerifier on fakes: a rollout's log-prob bound counts the
optimizer updates between the weights that sampled it and the trainer's (publish.every per
version of staleness, plus the steps since the newest version was taken); a refused step
quarantines its liars, takes its groups back and bans each generator over budget once; the
check after a step does the same for a trainer that does not refuse (docs/PIPELINE.md,
"Verified rollouts")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.backends.results import StepResult
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import LOGP_DRIFT_PER_UPDATE, Refusal, logp_bound
from pipeline.core.verification import LogpVerifier
from proto.records import Rollout
from tests.pipeline.fakes import FakeGenerator, FakeTrainer, drive, make_coordinator


def _roll(rid: str, version: int, gid: str = "g0") -> Any:
    """What the verifier reads of a rollout: its id, generator and versions."""
    return SimpleNamespace(rollout_id=rid, generator_id=gid, weight_version=version,
                           token_versions=None)  # fmt: skip


class FakeIntake:
    """Records what the verifier asks; the budget bans a generator at its ``budget``-th lie."""

    def __init__(self, budget: int = 2) -> None:
        self.counts: Counter[str] = Counter()
        self.refused: list[tuple[str, str, str]] = []  # (generator, rollout, reason)
        self.taken_back: list[set[str]] = []
        self.budget = budget

    def refuse_trained(self, gid: str, r: Any, why: Refusal) -> str | None:
        self.refused.append((gid, r.rollout_id, why.reason))
        n = sum(g == gid for g, _, _ in self.refused)
        return f"{n} refused rollouts" if n >= self.budget else None

    def take_back(self, groups: list[Any], refused: set[str]) -> int:
        self.taken_back.append(set(refused))
        return len(refused)


def _verifier(budget: int = 2, every: int = 2) -> tuple[LogpVerifier, FakeIntake, list]:
    bans: list[tuple[str, str]] = []
    intake = FakeIntake(budget)
    v = LogpVerifier(base=1e-3, every=every, gate=StalenessGate(4, "drop"),
                     intake=intake, ban=lambda g, why: bans.append((g, why)))  # type: ignore[arg-type]  # fmt: skip
    return v, intake, bans


def test_the_bound_counts_the_updates_behind_the_trainer_with_publish_every_2() -> None:
    v, _, _ = _verifier(every=2)
    rolls = [_roll("a", 3), _roll("b", 2), _roll("c", 0)]
    # the trainer at version 3, taken this step (since 0): 0, 2 and 6 updates behind
    assert v.bounds(rolls, 3, 0) == [logp_bound(1e-3, u) for u in (0, 2, 6)]
    # one step after version 3 was taken: every rollout one update further behind
    assert v.bounds(rolls, 3, 1) == [logp_bound(1e-3, u) for u in (1, 3, 7)]
    assert v.bounds(rolls, 3, 1)[0] == pytest.approx(1e-3 + LOGP_DRIFT_PER_UPDATE)
    # a rollout claiming a version above the trainer's is not given a smaller bound
    assert v.updates(3, _roll("d", 5), 0) == 0


def test_a_refused_step_quarantines_its_liars_and_bans_each_over_budget_once() -> None:
    v, intake, bans = _verifier(budget=2)
    rolls = [_roll("h/0", 0, "honest"), _roll("l/0", 0, "liar"), _roll("l/1", 0, "liar"),
             _roll("l/2", 0, "liar")]  # fmt: skip
    v.refuse_step(5, rolls, ["group"], [1.0] * 4, refused=[1, 2, 3], mismatch=[0, 40, 40, 40])
    assert [(g, r) for g, r, _ in intake.refused] == [("liar", "l/0"), ("liar", "l/1"),
                                                      ("liar", "l/2")]  # fmt: skip
    assert {why for _, _, why in intake.refused} == {"logp_mismatch"}
    assert intake.taken_back == [{"l/0", "l/1", "l/2"}] and intake.counts["steps_refused"] == 1
    assert bans == [("liar", "2 refused rollouts")]  # its first reason, once


def test_the_check_after_a_step_refuses_only_rollouts_over_their_bound() -> None:
    v, intake, bans = _verifier(budget=1)
    rolls = [_roll("a", 0, "g0"), _roll("b", 0, "g1")]
    v.verify(rolls, [], [0.5, 0.5])  # nothing measured: nothing checked
    v.verify(rolls, [0.4, float("nan")], [0.5, 0.5])  # within, and not measured
    assert not intake.refused and not bans
    v.verify(rolls, [0.4, 0.6], [0.5, 0.5])
    assert [(g, r) for g, r, _ in intake.refused] == [("g1", "b")]
    assert bans == [("g1", "1 refused rollouts")]


class BoundsTrainer(FakeTrainer):
    """Records, per step, each rollout's weight version and the bound it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[tuple[int, float]]] = []

    def step(self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
             logp_bounds: Sequence[float] | None = None) -> StepResult:  # fmt: skip
        assert logp_bounds is not None and len(logp_bounds) == len(rollouts)
        self.seen.append([(r.weight_version, b) for r, b in zip(rollouts, logp_bounds)])
        return super().step(rollouts, needs_correction, logp_bounds)


def test_the_coordinator_bounds_each_rollout_by_the_trainers_updates(tmp_path: Path) -> None:
    """publish.every=2, max_staleness 1, through the coordinator: at step k the trainer has
    made k - 1 updates and version w holds the weights after 2 w of them, so a rollout of w
    is (k - 1) - 2 w updates behind, whatever the step's position between publications."""
    t = BoundsTrainer()
    c, net, _ = make_coordinator(tmp_path, ["publish.every=2", "staleness.max_staleness=1",
                                            "numerics=exact"], trainer=t)  # fmt: skip
    drive(c, [FakeGenerator(net, "g0"), FakeGenerator(net, "g1", seed=1, delay=2)], 8)
    c.close()
    assert c.verifier.base == 0.0 and len(t.seen) == 8
    behind = set()
    for k, step in enumerate(t.seen, start=1):
        for w, bound in step:
            behind.add((k - 1) - 2 * w)
            assert bound == logp_bound(0.0, (k - 1) - 2 * w), (k, w, bound)
    assert {0, 1, 2} <= behind  # on a version, one step after it, a version behind
