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

from proto import Rollout

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

    # -- train side --------------------------------------------------------------------
    def staleness(self, learner_version: int, rollout: Rollout) -> int:
        return learner_version - oldest_version(rollout)

    def is_fresh(self, learner_version: int, rollout: Rollout) -> bool:
        """Within the bound (no counting; for peeking at a buffer)."""
        o = oldest_version(rollout)
        return 0 <= o <= learner_version and learner_version - o <= self.max_staleness

    def check(self, learner_version: int, rollout: Rollout) -> Verdict:
        """Decide (and count) whether ``rollout`` may be trained at ``learner_version``."""
        o = oldest_version(rollout)
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
        return generator_version >= 0 and generator_version >= self.min_dispatch_version(
            learner_version
        )

    def dispatched(self, work_id: str, generator_version: int) -> None:
        """Work went out to a generator serving ``generator_version`` (a re-dispatch updates)."""
        if generator_version < 0:
            raise StalenessConfigError(f"work {work_id!r}: generator serves no version yet")
        self._deadline[work_id] = generator_version + self.max_staleness

    def settled(self, work_id: str) -> None:
        """All of ``work_id`` arrived, or its generator died / returned it: stop waiting."""
        self._deadline.pop(work_id, None)

    def inflight(self) -> dict[str, int]:
        """In-flight work id -> deadline (last learner version that can train it)."""
        return dict(self._deadline)
