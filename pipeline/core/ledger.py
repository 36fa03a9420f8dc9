"""Exactly-once accounting of work in flight: which sample of which work item is where.

The loop (coordinator, learner rank 0)::

    ledger.dispatch(work_id, gid, n)          # WorkItem sent: samples 0..n-1 owned by gid
    ledger.receive(rollout, sender=gid)       # "accepted" -> buffer it; else discard it
    ledger.settle(work_id, [i, ...])          # sample trained (or deliberately dropped)
    ledger.generator_died(gid) / .returned(gid, work_ids) -> [Redispatch(work_id, indices)]
    ledger.dispatch(work_id, other_gid, n, indices=missing)   # re-dispatch only what's missing
    snap = ledger.snapshot()                  # JSON-able, saved with the learner checkpoint
    ledger, todo = InFlightLedger.restore(snap)                # after kill -9: re-dispatch todo

Each sample index of a work item is in exactly one state: ``unassigned`` (waiting for
(re-)dispatch), ``assigned`` to one generator, ``accepted`` (in the training buffer) or
``settled`` (trained or deliberately dropped). Invariant: a sample is accepted at most once
and only from the generator it is currently assigned to; so a late or duplicate rollout
(from a generator declared dead, after a re-dispatch, a replay of the same frame) is
discarded, no sample is trained twice, and none is lost: every index not accepted is
assigned or reported for re-dispatch. A fully settled item is forgotten (its id is kept in
a bounded set so that late copies still read "duplicate").

``restore`` turns every ``assigned`` sample into ``unassigned`` (the generators of the old
run may be gone) and returns them for re-dispatch; ``accepted`` samples are kept when the
caller persisted its buffer with the checkpoint, else (``requeue_accepted=True``) they are
re-requested too: they were never trained, so this loses nothing and trains nothing twice.

Note: a re-dispatch reuses ``work_id`` and sends only the missing indices' latent seeds;
the generator must report the original ``sample_index`` (see docs/PROTOCOL.md).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from proto.records import Rollout

Outcome = Literal["accepted", "duplicate", "unknown"]
UNASSIGNED, ACCEPTED, SETTLED = "", "\0accepted", "\0settled"  # else: the owner's generator id
SNAPSHOT_VERSION = 1


class LedgerError(ValueError):
    """The coordinator asked for something that would break exactly-once accounting."""


@dataclass(frozen=True)
class Redispatch:
    """Sample ``indices`` of ``work_id`` (a group of ``n``) must be dispatched again."""

    work_id: str
    n: int
    indices: tuple[int, ...]


class InFlightLedger:
    """Per-sample state of every open work item; see the module docstring."""

    def __init__(self, *, remember_done: int = 100_000) -> None:
        self._items: dict[str, list[str]] = {}  # work_id -> state of each sample index
        self._by_gen: dict[str, set[str]] = defaultdict(set)  # gid -> work ids it holds
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember_done = remember_done
        self.counts: Counter[str] = Counter()

    # -- dispatch side -----------------------------------------------------------------
    def dispatch(
        self, work_id: str, generator_id: str, n: int, *, indices: Iterable[int] | None = None
    ) -> None:
        """Record that ``generator_id`` now owns ``indices`` (default all) of ``work_id``."""
        if not generator_id or generator_id.startswith("\0"):
            raise LedgerError(f"invalid generator id {generator_id!r}")
        if work_id in self._done:
            raise LedgerError(f"work {work_id!r} is complete; it cannot be dispatched again")
        states = self._items.get(work_id)
        if states is None:
            if n < 1:
                raise LedgerError(f"work {work_id!r}: n must be >= 1, got {n}")
            states = self._items[work_id] = [UNASSIGNED] * n
        elif len(states) != n:
            raise LedgerError(f"work {work_id!r} has {len(states)} samples, not {n}")
        idx = sorted(set(range(n) if indices is None else indices))
        if not idx:
            raise LedgerError(f"work {work_id!r}: no sample indices to dispatch")
        for i in idx:
            if not 0 <= i < n:
                raise LedgerError(f"work {work_id!r}: sample index {i} outside 0..{n - 1}")
            if states[i] != UNASSIGNED:
                raise LedgerError(
                    f"work {work_id!r} sample {i} is {self._state_name(states[i])}; only "
                    "unassigned samples can be dispatched (that would train it twice)"
                )
        for i in idx:
            states[i] = generator_id
        self._by_gen[generator_id].add(work_id)
        self.counts["dispatched"] += len(idx)

    def generator_died(self, generator_id: str) -> list[Redispatch]:
        """Unassign everything ``generator_id`` held; return what must be re-dispatched."""
        return self._release(generator_id, list(self._by_gen.pop(generator_id, ())))

    def returned(self, generator_id: str, work_ids: Iterable[str]) -> list[Redispatch]:
        """The generator handed ``work_ids`` back (WorkReturn): unassign its samples of them."""
        held = self._by_gen.get(generator_id, set())
        mine = [w for w in work_ids if w in held]
        held.difference_update(mine)
        return self._release(generator_id, mine)

    def _release(self, generator_id: str, work_ids: list[str]) -> list[Redispatch]:
        out = []
        for w in sorted(work_ids):
            states = self._items[w]
            idx = tuple(i for i, s in enumerate(states) if s == generator_id)
            for i in idx:
                states[i] = UNASSIGNED
            if idx:
                out.append(Redispatch(w, len(states), idx))
                self.counts["released"] += len(idx)
        return out

    def release(self, generator_id: str, work_id: str, indices: Iterable[int]) -> list[Redispatch]:
        """Samples ``generator_id`` holds of ``work_id`` whose rollout was refused at the door:
        unassign them for re-dispatch (the generator keeps the rest of the item)."""
        states = self._items.get(work_id)
        if states is None:
            return []
        idx = tuple(i for i in sorted(set(indices)) if 0 <= i < len(states)
                    and states[i] == generator_id)  # fmt: skip
        for i in idx:
            states[i] = UNASSIGNED
        if generator_id not in states:
            held = self._by_gen.get(generator_id)
            if held is not None:
                held.discard(work_id)
                if not held:
                    del self._by_gen[generator_id]
        if not idx:
            return []
        self.counts["released"] += len(idx)
        return [Redispatch(work_id, len(states), idx)]

    def reopen(self, work_id: str, indices: Iterable[int]) -> None:
        """Resume only: accepted samples whose rollout turned out invalid go back to
        unassigned (never trained), to be dispatched again."""
        states = self._items[work_id]
        for i in indices:
            if states[i] != ACCEPTED:
                raise LedgerError(f"reopen: work {work_id!r} sample {i} is not accepted")
            states[i] = UNASSIGNED

    # -- intake side -------------------------------------------------------------------
    def owner(self, work_id: str, index: int) -> str | None:
        """The generator that sample ``index`` of ``work_id`` is assigned to, else None."""
        states = self._items.get(work_id)
        if states is None or not 0 <= index < len(states):
            return None
        s = states[index]
        return None if s in (UNASSIGNED, ACCEPTED, SETTLED) else s

    def receive(self, rollout: Rollout, *, sender: str | None = None) -> Outcome:
        """Account one rollout; only "accepted" ones may go into the training buffer.

        ``sender`` is the transport's peer id (authoritative); it defaults to the
        rollout's self-reported generator_id.
        """
        gid = rollout.generator_id if sender is None else sender
        w, i = rollout.work_id, rollout.sample_index
        states = self._items.get(w)
        if states is None:
            outcome: Outcome = "duplicate" if w in self._done else "unknown"
        elif not 0 <= i < len(states) or not gid or gid.startswith("\0"):
            outcome = "unknown"
        elif states[i] == gid:
            states[i] = ACCEPTED
            self._drop_holder(gid, w)
            outcome = "accepted"
        else:
            outcome = "duplicate"  # accepted already, or from a generator that no longer owns it
            if states[i] not in (ACCEPTED, SETTLED):
                self.counts["late"] += 1
        self.counts[outcome] += 1
        return outcome

    def settle(self, work_id: str, indices: Iterable[int]) -> None:
        """Accepted samples were trained (or dropped on purpose): they are done for good."""
        states = self._items.get(work_id)
        if states is None:
            raise LedgerError(f"settle: unknown or already complete work {work_id!r}")
        for i in indices:
            if not 0 <= i < len(states) or states[i] != ACCEPTED:
                got = self._state_name(states[i]) if 0 <= i < len(states) else "out of range"
                raise LedgerError(f"settle: work {work_id!r} sample {i} is {got}, not accepted")
            states[i] = SETTLED
        if all(s == SETTLED for s in states):
            del self._items[work_id]
            self._done[work_id] = None
            while len(self._done) > self._remember_done:
                self._done.popitem(last=False)

    def _drop_holder(self, gid: str, work_id: str) -> None:
        if gid not in self._items[work_id] and work_id in self._by_gen.get(gid, ()):
            self._by_gen[gid].discard(work_id)
            if not self._by_gen[gid]:
                del self._by_gen[gid]

    # -- queries -----------------------------------------------------------------------
    @staticmethod
    def _state_name(s: str) -> str:
        return {UNASSIGNED: "unassigned", ACCEPTED: "accepted", SETTLED: "settled"}.get(
            s, f"assigned to {s!r}"
        )

    def state(self, work_id: str) -> list[str]:
        """Readable state of each sample ("unassigned", "accepted", "assigned to 'g'", ...)."""
        if work_id in self._done:
            return ["settled"]
        return [self._state_name(s) for s in self._items[work_id]]

    def unassigned(self) -> list[Redispatch]:
        """Every sample waiting for (re-)dispatch."""
        out = []
        for w, states in sorted(self._items.items()):
            idx = tuple(i for i, s in enumerate(states) if s == UNASSIGNED)
            if idx:
                out.append(Redispatch(w, len(states), idx))
        return out

    def inflight(self, generator_id: str | None = None) -> int:
        """Samples assigned (to ``generator_id``, or to anyone) and not yet received."""
        return sum(
            1
            for states in self._items.values()
            for s in states
            if s not in (UNASSIGNED, ACCEPTED, SETTLED) and generator_id in (None, s)
        )

    def is_open(self, work_id: str) -> bool:
        """Dispatched and not yet fully settled."""
        return work_id in self._items

    def is_done(self, work_id: str) -> bool:
        """Fully settled (remembered among the last ``remember_done`` items)."""
        return work_id in self._done

    def is_received(self, work_id: str) -> bool:
        """Every sample of ``work_id`` accepted or settled (the group is complete)."""
        states = self._items.get(work_id)
        return work_id in self._done or (
            states is not None and all(s in (ACCEPTED, SETTLED) for s in states)
        )

    # -- persistence ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """JSON-able state, to be saved atomically with the learner checkpoint."""
        items = {}
        for w, states in self._items.items():
            items[w] = {
                "n": len(states),
                "accepted": [i for i, s in enumerate(states) if s == ACCEPTED],
                "settled": [i for i, s in enumerate(states) if s == SETTLED],
            }
        return {"version": SNAPSHOT_VERSION, "items": items, "done": list(self._done)}

    @classmethod
    def restore(
        cls, snap: dict[str, Any], *, requeue_accepted: bool = False, remember_done: int = 100_000
    ) -> tuple[InFlightLedger, list[Redispatch]]:
        """Rebuild a ledger from ``snapshot()``; returns it and the samples to re-dispatch."""
        if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
            raise LedgerError(f"not a ledger snapshot of version {SNAPSHOT_VERSION}")
        led = cls(remember_done=remember_done)
        for w in snap["done"]:
            led._done[str(w)] = None
        for w, it in snap["items"].items():
            n = int(it["n"])
            states = [UNASSIGNED] * n
            for i in it["settled"]:
                states[int(i)] = SETTLED
            if not requeue_accepted:
                for i in it["accepted"]:
                    states[int(i)] = ACCEPTED
            led._items[str(w)] = states
        return led, led.unassigned()
