"""Staleness gate: what the learner may train on, when it may step, when work may go out.

Versions are the learner's weight versions; the learner "at version v" trains weights v
(its step publishes v+1). A rollout's oldest version is o = min(weight_version,
token_versions); its staleness at learner version v is ``v - o``.

Train-side rule (``check``; call it when a rollout enters a training batch, since data
ages in the buffer while the learner steps): staleness <= max_staleness -> accept;
staler -> drop (policy "drop") or accept flagged ``needs_correction`` (policy "keep": the
objective applies its off-policy correction). A version newer than the learner's
("future") or negative ("invalid") is always dropped. Invariant: nothing staler than
max_staleness is trained on, except flagged under "keep". Every verdict is counted.

Dispatch-side rule (the bound chosen here): work dispatched to a generator serving
version g yields tokens of version >= g (WorkItem.min_weight_version = g, and a
generator's version never decreases), so it is trainable up to learner version
``deadline = g + max_staleness``.

- ``can_dispatch(v, g)``: ``g >= v - max_staleness`` (the work is trainable now); a
  generator further behind gets new weights first, not work.
- ``can_train(v)``: under "drop" the learner at v does not step while in-flight work has
  ``deadline == v`` (stepping would make it too stale on arrival): it waits for that work,
  or for the coordinator to declare its generator dead (``settled``), which bounds the
  wait by the heartbeat timeout. It also waits when ``buffered`` rollouts are given and
  none is fresh. Under "keep" it never waits. With max_staleness = 0 this is synchronous
  on-policy RL; larger values let generation overlap that many learner steps.

Loop::

    if gate.can_dispatch(v, g): send WorkItem(min_weight_version=g); gate.dispatched(w, g)
    on all samples of w received / w released: gate.settled(w)
    batch = [r for r in buffer if gate.check(v, r).accept]   # once per rollout
    if gate.can_train(v): step
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from proto.records import Rollout

Policy = Literal["drop", "keep"]


class StalenessConfigError(ValueError):
    """Bad staleness settings."""


@dataclass(frozen=True)
class Verdict:
    """accept: train on it. needs_correction: stale, kept under policy "keep".
    reason: "fresh" | "stale_kept" | "stale_dropped" | "future" | "invalid"."""

    accept: bool
    staleness: int
    reason: str
    needs_correction: bool = False


def oldest_version(rollout: Rollout) -> int:
    """The oldest weight version that produced any token of ``rollout``."""
    v = rollout.weight_version
    tv = rollout.token_versions
    if tv is not None and tv.size:
        v = min(v, int(tv.min()))
    return v


class VersionLineage:
    """Where a version number sits on the learner's current line of weights, after resumes.

    A learner resumed from a checkpoint taken at version c, when versions up to m > c had been
    published since, holds the weights of c again and publishes them as n = m + 1 (versions
    strictly increase). Staleness must then measure distance to the weights the learner really
    has: a version v <= c is (c - v) updates away, so it counts as v + (n - c); a version
    c < v <= m came from an abandoned branch (v - c) updates away from c, so it counts as
    n - (v - c). Versions after the resume are unchanged. Several resumes compose in order.
    Saved with the checkpoint's pipeline state (``to_list`` / ``from_list``).
    """

    def __init__(self, resumes: list[tuple[int, int, int]] | None = None) -> None:
        self.resumes: list[tuple[int, int, int]] = [tuple(r) for r in resumes or []]  # type: ignore[misc]

    def add_resume(self, checkpoint_version: int, new_version: int, newest_before: int) -> None:
        """The learner at ``checkpoint_version`` publishes itself as ``new_version`` while
        versions up to ``newest_before`` had been published by its previous life."""
        if not checkpoint_version <= newest_before < new_version:
            raise StalenessConfigError(
                f"resume: need checkpoint {checkpoint_version} <= newest published "
                f"{newest_before} < new version {new_version}"
            )
        self.resumes.append((checkpoint_version, new_version, newest_before))

    def effective(self, v: int) -> int:
        for c, n, m in self.resumes:
            if v <= c:
                v = v + (n - c)
            elif v <= m:
                v = n - (v - c)
        return v

    def to_list(self) -> list[list[int]]:
        return [list(r) for r in self.resumes]


class StalenessGate:
    """Bounded-staleness gate; see the module docstring for the rules and the loop."""

    def __init__(self, max_staleness: int, policy: Policy = "drop") -> None:
        if max_staleness < 0:
            raise StalenessConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        if policy not in ("drop", "keep"):
            raise StalenessConfigError(f"policy must be 'drop' or 'keep', got {policy!r}")
        self.max_staleness = max_staleness
        self.policy: Policy = policy
        self.counts: Counter[str] = Counter()
        self._deadline: dict[str, int] = {}  # in-flight work id -> last trainable version
        self.lineage = VersionLineage()

    # -- train side --------------------------------------------------------------------
    def oldest(self, rollout: Rollout) -> int:
        """The rollout's oldest version, as a position on the learner's current lineage."""
        return self.lineage.effective(oldest_version(rollout))

    def staleness(self, learner_version: int, rollout: Rollout) -> int:
        return learner_version - self.oldest(rollout)

    def is_fresh(self, learner_version: int, rollout: Rollout) -> bool:
        """Within the bound (no counting; for peeking at a buffer)."""
        o = self.oldest(rollout)
        return 0 <= o <= learner_version and learner_version - o <= self.max_staleness

    def check(self, learner_version: int, rollout: Rollout) -> Verdict:
        """Decide (and count) whether ``rollout`` may be trained at ``learner_version``."""
        o = self.oldest(rollout)
        s = learner_version - o
        if o < 0:
            v = Verdict(False, s, "invalid")
        elif s < 0:
            v = Verdict(False, s, "future")
        elif s <= self.max_staleness:
            v = Verdict(True, s, "fresh")
        elif self.policy == "keep":
            v = Verdict(True, s, "stale_kept", needs_correction=True)
        else:
            v = Verdict(False, s, "stale_dropped")
        self.counts[v.reason] += 1
        return v

    def can_train(self, learner_version: int, buffered: Iterable[Rollout] | None = None) -> bool:
        """May the learner at ``learner_version`` take a step now?"""
        if self.policy == "keep":
            return True
        if self.blocking(learner_version):
            return False
        if buffered is not None:
            return any(self.is_fresh(learner_version, r) for r in buffered)
        return True

    def blocking(self, learner_version: int) -> list[str]:
        """In-flight work that becomes too stale if the learner steps past ``learner_version``."""
        return sorted(w for w, d in self._deadline.items() if d == learner_version)

    # -- dispatch side -------------------------------------------------------------------
    def min_dispatch_version(self, learner_version: int) -> int:
        """Oldest version a generator may serve and still get work."""
        return learner_version - self.max_staleness

    def can_dispatch(self, learner_version: int, generator_version: int) -> bool:
        g = self.lineage.effective(generator_version) if generator_version >= 0 else -1
        return g >= 0 and g >= self.min_dispatch_version(learner_version)

    def dispatched(self, work_id: str, generator_version: int) -> None:
        """Work went out to a generator serving ``generator_version`` (a re-dispatch updates)."""
        if generator_version < 0:
            raise StalenessConfigError(f"work {work_id!r}: generator serves no version yet")
        self._deadline[work_id] = self.lineage.effective(generator_version) + self.max_staleness

    def settled(self, work_id: str) -> None:
        """All of ``work_id`` arrived, or its generator died / returned it: stop waiting."""
        self._deadline.pop(work_id, None)

    def inflight(self) -> dict[str, int]:
        """In-flight work id -> deadline (last learner version that can train it)."""
        return dict(self._deadline)
