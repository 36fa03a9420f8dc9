"""Rollout intake: ledger accounting, record-before-ack, GRPO group assembly, batch selection.

Loop (coordinator thread)::

    res = intake.receive(sender, batch)   # the door (pipeline.core.validation) checks each rollout
                                          # the sender owns; refused ones are Nack'ed with the
                                          # reason, quarantined and re-dispatched, and
                                          # res.ban says when the sender must be dropped; the
                                          # ledger accounts the rest; accepted ones are
                                          # recorded (stream append + flush) and buffered;
                                          # then res.replies are sent (accepted and duplicates
                                          # Ack'ed, unknown Nack'ed)
    groups = intake.select(v, k)          # k complete groups within the staleness bound,
                                          # or None; stale groups are generated again
                                          # (policy drop), never dropped
    ... train ...
    intake.settle(groups)                 # ledger.settle: trained, never again

Invariants (asserted by tests/pipeline/test_coordinator.py): a rollout is buffered only if
the ledger accepted it, and only after the recorder made it durable (nothing acknowledged
is lost); a group enters a batch only when all ``n`` samples are accepted, and each group
is trained at most once; a group is trained at learner version v only if every rollout
passes ``gate.check(v, r)`` (fresh, or stale-kept flagged for correction).

Sample identity: the index of a sample is the position of its latent seed in the work
item's seed list; a rollout whose ``sample_index`` disagrees (a generator that numbered a
partial re-dispatch 0..k-1) is renumbered by its seed and counted (``remapped``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.dispatch import Dispatcher, WorkSpec
from pipeline.core.ledger import InFlightLedger, Redispatch
from pipeline.core.quarantine import Quarantine
from pipeline.core.staleness import StalenessGate, Verdict
from pipeline.core.validation import (
    DoorRules,
    Expected,
    ModelLimits,
    Refusal,
    check_rollout,
    sanitize_reward,
)
from proto.records import Ack, Nack, Rollout, RolloutBatch, WorkItem

log = logging.getLogger(__name__)


@dataclass
class IntakeResult:
    """What one RolloutBatch did: the replies to send, the counts, and a ban, if any."""

    replies: list[Any] = field(default_factory=list)
    accepted: int = 0
    duplicate: int = 0
    unknown: int = 0
    refused: int = 0
    ban: str | None = None  # why the sender must be dropped for the run (None: it may stay)


@dataclass
class Group:
    """A complete GRPO group: the n accepted samples of one work item, by sample index."""

    work_id: str
    rollouts: list[Rollout]
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def needs_correction(self) -> list[bool]:
        return [v.needs_correction for v in self.verdicts]


class RefusalTracker:
    """Refusals per generator: totals per reason, and a sliding window that says when a
    generator has sent ``max_refused`` bad rollouts within ``window_s`` seconds (drop it)."""

    def __init__(self, max_refused: int, window_s: float, clock: Callable[[], float]) -> None:
        self.max_refused, self.window_s, self.clock = max_refused, window_s, clock
        self.by_generator: dict[str, Counter[str]] = {}
        self._recent: dict[str, deque[float]] = {}

    def note(self, gid: str, reason: str) -> str | None:
        """Count one refusal; returns the ban reason when the window overflows."""
        self.by_generator.setdefault(gid, Counter())[reason] += 1
        now = self.clock()
        q = self._recent.setdefault(gid, deque())
        q.append(now)
        while q and q[0] < now - self.window_s:
            q.popleft()
        if self.max_refused and len(q) >= self.max_refused:
            reasons = dict(self.by_generator[gid])
            return (f"{len(q)} refused rollouts within {self.window_s:g} s "
                    f"(intake.max_refused={self.max_refused}); by reason {reasons}")  # fmt: skip
        return None


class Intake:
    """See the module docstring."""

    def __init__(
        self,
        *,
        ledger: InFlightLedger,
        gate: StalenessGate,
        dispatcher: Dispatcher,
        record: Callable[[list[Rollout]], Any],
        n: int,
        limits: ModelLimits,
        rules: DoorRules,
        quarantine: Quarantine,
        version: Callable[[], int],
        max_refused: int = 8,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        void: Callable[[list[dict[str, Any]]], None] | None = None,
        dynamic_sampling: bool = False,
    ) -> None:
        if dynamic_sampling and n < 2:  # the run config refuses it first (pipeline.config.run)
            raise ValueError(f"objective.dynamic_sampling with rollout.n={n}: a group of one "
                             "sample always has equal rewards, so every group would be dropped")  # fmt: skip
        self.ledger, self.gate, self.dispatcher, self.record, self.n = (
            ledger, gate, dispatcher, record, n,
        )  # fmt: skip
        self.limits, self.rules, self.quarantine, self.version = limits, rules, quarantine, version
        self.refusals = RefusalTracker(max_refused, window_s, clock)
        self.void = void  # records rollouts whose samples are generated again (RUN_DIR/voided)
        self.dynamic_sampling = dynamic_sampling  # drop groups whose rewards are all equal
        self.restored: set[str] = set()  # restored by a resume, not yet trained
        self._partial: dict[str, dict[int, Rollout]] = {}
        self.complete: OrderedDict[str, Group] = OrderedDict()  # in order of completion
        self.counts: Counter[str] = Counter()
        self.trained: set[str] = set()  # work ids trained or dropped (for the invariant tests)

    # -- receiving -----------------------------------------------------------------------------
    def _identify(self, r: Rollout) -> tuple[Rollout, WorkSpec | None, bool]:
        """(rollout renumbered by its seed, its work spec or None if not ours (anymore),
        whether the seed is one of the work item's seeds)."""
        spec = self.dispatcher.spec(r.work_id)
        if spec is None:
            return r, None, True  # the ledger says duplicate / unknown
        idx = spec.index_of(int(r.latent_seed))
        if idx is None:
            return r, spec, False
        if idx != r.sample_index:
            self.counts["remapped"] += 1
            r = dataclasses.replace(r, sample_index=idx, rollout_id=f"{r.work_id}/{idx}")
        return r, spec, True

    def expected(self, spec: WorkSpec, index: int, sender: str | None) -> Expected:
        """What sample ``index`` of ``spec`` was dispatched as (the door's reference). From a
        live ``sender``, its versions lie between the lowest min_weight_version the sample was
        issued to it with (it may answer an earlier issue) and the newest version it
        acknowledged serving (Hello, heartbeat or weights Ack: a generator serves only what it
        acknowledged, and the log-prob bound follows the version it served)."""
        seed = spec.seeds[index] if 0 <= index < len(spec.seeds) else -1
        lo = spec.issued.get(index, max(spec.min_version, 0))
        hi = self.version()
        if sender is not None:
            lo = spec.issued_to.get((index, sender), lo)
            hi = min(hi, self.dispatcher.serving(sender))
        return Expected(
            prompt_id=spec.prompt.prompt_id, prompt_tokens=list(spec.prompt.tokens),
            latent_seed=seed, max_tokens=self.dispatcher.max_tokens,
            min_version=lo, max_version=hi, sender=sender,
        )  # fmt: skip

    def receive(self, sender: str, batch: RolloutBatch | Rollout) -> IntakeResult:
        rolls = batch.rollouts if isinstance(batch, RolloutBatch) else [batch]
        res = IntakeResult()
        accepted: list[tuple[str, Rollout]] = []
        for orig in rolls:
            r, spec, seed_known = self._identify(orig)
            r, failed = sanitize_reward(r)
            if failed:
                self.counts["reward_nonfinite"] += 1
            if spec is not None and self.ledger.owner(r.work_id, r.sample_index) == sender:
                refusal = (
                    check_rollout(
                        r,
                        expect=self.expected(spec, r.sample_index, sender),
                        limits=self.limits,
                        rules=self.rules,
                    )  # fmt: skip
                    if seed_known
                    else Refusal(
                        "seed_mismatch",
                        f"latent seed {int(r.latent_seed)} was not dispatched for {r.work_id}",
                    )  # fmt: skip
                )
                if refusal is not None:
                    self._refuse(sender, orig, r, refusal, res)
                    continue
            outcome = "unknown" if not seed_known else self.ledger.receive(r, sender=sender)
            self.counts[outcome] += 1
            if outcome == "accepted":
                accepted.append((orig.rollout_id, r))
                res.accepted += 1
            elif outcome == "duplicate":
                res.duplicate += 1
                self.dispatcher.heard(sender)  # late, but it answers
                res.replies.append(Ack("rollout", orig.rollout_id))
            else:
                res.unknown += 1
                res.replies.append(Nack("rollout", orig.rollout_id, "unknown work or sample"))
        if accepted:
            self.record([r for _, r in accepted])  # durable BEFORE anything is acknowledged
            for _, r in accepted:
                self._buffer(r)
                self.dispatcher.received(sender, r.work_id, r.sample_index)
            res.replies += self._acks(rolls, [orig_id for orig_id, _ in accepted])
        return res

    def _acks(self, rolls: list[Rollout], accepted: list[str]) -> list[Ack]:
        """The Acks of the accepted rollouts: one per work id whose whole group (all ``n``
        samples) came in this batch and was accepted (``Ack(ref=work_id)`` acknowledges a
        group: a generator that sends its finished groups together gets one Ack per group, not
        one per rollout), else one per rollout."""
        ok = set(accepted)
        ids: dict[str, list[str]] = {}
        for r in rolls:
            ids.setdefault(r.work_id, []).append(r.rollout_id)
        out = []
        for wid, rids in ids.items():
            mine = [i for i in rids if i in ok]
            if len(mine) == len(rids) == self.n and len(set(rids)) == self.n:
                out.append(Ack("rollout", wid))
            else:
                out += [Ack("rollout", i) for i in mine]
        return out

    def check_eval(
        self, sender: str, r: Rollout, item: WorkItem
    ) -> tuple[Rollout, Refusal | None, str | None]:
        """The door for an eval rollout (pipeline.core.eval_rounds): the same rules against its
        eval work item; a refusal is quarantined and counted toward a ban like any other.
        Returns the rollout with a NaN/inf reward made a failed reward, as for training, the
        refusal, and the ban it decided (the coordinator carries it out), or None."""
        seeds = [int(s) for s in item.latent_seeds]
        seed = int(r.latent_seed) if int(r.latent_seed) in seeds else -1
        expect = Expected(
            prompt_id=item.prompt_id, prompt_tokens=[int(t) for t in item.prompt_tokens],
            latent_seed=seed, max_tokens=item.max_tokens, min_version=item.min_weight_version,
            max_version=self.version(), sender=sender,
        )  # fmt: skip
        r, _ = sanitize_reward(r)
        limits, rules = self.limits, self.rules  # an eval.depths item may run deeper than the
        if item.eval_depth > limits.max_depth:  # run's policy
            limits = dataclasses.replace(limits, max_depth=item.eval_depth)
        if item.eval_depth:  # and runs FixedDepth: no exit is sampled, none claimed
            rules = dataclasses.replace(rules, sampled_exit=False)
        why = check_rollout(r, expect=expect, limits=limits, rules=rules)
        if why is None:
            return r, None, None
        self.counts["refused"] += 1
        self.counts[f"refused_{why.reason}"] += 1
        self.quarantine.put(r, generator=sender, reason=why.reason, detail=why.detail)
        return r, why, self.refusals.note(sender, why.reason)

    def _refuse(self, sender: str, orig: Rollout, r: Rollout, why: Refusal,
                res: IntakeResult) -> None:  # fmt: skip
        """Never trained: Nack with the reason, quarantine, count, re-dispatch the sample."""
        self.counts["refused"] += 1
        self.counts[f"refused_{why.reason}"] += 1
        res.refused += 1
        self.quarantine.put(orig, generator=sender, reason=why.reason, detail=why.detail)
        self.dispatcher.refused(sender, r.work_id, r.sample_index)
        res.replies.append(Nack("rollout", orig.rollout_id, f"refused: {why}"))
        ban = self.refusals.note(sender, why.reason)
        if ban is not None and res.ban is None:
            res.ban = ban

    def _buffer(self, r: Rollout) -> None:
        g = self._partial.setdefault(r.work_id, {})
        assert r.sample_index not in g, f"sample {r.rollout_id} accepted twice"
        g[r.sample_index] = r
        if len(g) == self.n:
            del self._partial[r.work_id]
            assert r.work_id not in self.complete and r.work_id not in self.trained
            group = Group(r.work_id, [g[i] for i in range(self.n)])
            if self.dynamic_sampling and len({x.reward for x in group.rollouts}) == 1:
                # every sample scored the same: no group-relative signal; dropped (settled)
                # and its place in the open-work cap goes to a new prompt
                self.counts["groups_filtered_uniform"] += 1
                self._settle(group)
                return
            self.complete[r.work_id] = group

    def restore_accepted(self, r: Rollout) -> None:
        """Resume: a rollout the ledger holds as accepted (from the checkpoint or the stream).
        If it grows too stale before it is trained, its group is generated again, not dropped."""
        self.restored.add(r.rollout_id)
        self._buffer(r)

    def _regenerate(self, g: Group) -> None:
        idx = list(range(self.n))
        self.ledger.reopen(g.work_id, idx)
        self.dispatcher.queue_redispatch([Redispatch(g.work_id, self.n, tuple(idx))])
        restored = any(r.rollout_id in self.restored for r in g.rollouts)
        self.counts["restored_regenerated" if restored else "rollouts_regenerated_stale"] += len(
            g.rollouts
        )
        if self.void is not None:
            self.void([{"rollout_id": r.rollout_id, "reason": "stale"} for r in g.rollouts])
        for r in g.rollouts:
            self.restored.discard(r.rollout_id)

    def refuse_trained(self, gid: str, r: Rollout, why: Refusal) -> str | None:
        """A rollout the trainer found lying (its claimed log-probs are beyond the bound, seen
        when its step measured them): quarantined (source "train"), counted toward ``gid``'s
        budget; returns the ban when the budget is spent (the coordinator carries it out)."""
        self.counts["refused"] += 1
        self.counts[f"refused_{why.reason}"] += 1
        self.quarantine.put(r, generator=gid, reason=why.reason, detail=why.detail,
                            source="train")  # fmt: skip
        return self.refusals.note(gid, why.reason)

    def take_back(self, groups: list[Group], refused: Collection[str] | Mapping[str, str]) -> int:
        """A step the trainer refused before its update (``refused``: the rollout ids over
        their log-prob bound, or id -> reason: "logp_mismatch" for a lie, "logp_drift" /
        "logp_unverified" for a stale rollout the verifier does not blame): its groups come
        back untrained. The refused rollouts are voided (RUN_DIR/voided.jsonl, their reason):
        their samples re-opened in the ledger and dispatched again, a lie's to another
        generator than the one that lied where there is one; the rest wait in the buffer
        (complete groups first in line again, partial ones for their new samples). Returns
        the samples dispatched again."""
        why = (
            dict(refused)
            if isinstance(refused, Mapping)
            else dict.fromkeys(refused, "logp_mismatch")
        )
        voided: list[Rollout] = []
        for g in reversed(groups):
            bad = [r for r in g.rollouts if r.rollout_id in why]
            if not bad:
                self.complete[g.work_id] = Group(g.work_id, list(g.rollouts))
                self.complete.move_to_end(g.work_id, last=False)
                continue
            keep = {r.sample_index: r for r in g.rollouts if r.rollout_id not in why}
            if keep:
                self._partial[g.work_id] = keep
            idx = sorted(int(r.sample_index) for r in bad)
            self.ledger.reopen(g.work_id, idx)
            avoid = {int(r.sample_index): r.generator_id for r in bad
                     if why[r.rollout_id] == "logp_mismatch"}  # fmt: skip
            self.dispatcher.redo(g.work_id, idx, avoid=avoid)
            voided += bad
        for r in voided:
            self.restored.discard(r.rollout_id)
        if voided and self.void is not None:
            self.void([{"rollout_id": r.rollout_id, "reason": why[r.rollout_id]} for r in voided])
        for r in voided:
            self.counts[f"voided_{why[r.rollout_id]}"] += 1
        return len(voided)

    def void_generator(self, gid: str) -> int:
        """A banned generator's accepted, untrained rollouts are voided: out of the buffer,
        their samples re-opened in the ledger and dispatched again (RUN_DIR/voided.jsonl names
        the voided copies). Returns the samples voided."""
        voided: list[Rollout] = []
        for wid in list(self.complete):
            g = self.complete[wid]
            if any(r.generator_id == gid for r in g.rollouts):
                del self.complete[wid]
                self._partial[wid] = {r.sample_index: r for r in g.rollouts}
        for wid, part in list(self._partial.items()):
            mine = sorted(i for i, r in part.items() if r.generator_id == gid)
            if not mine:
                continue
            voided += [part.pop(i) for i in mine]
            if not part:
                del self._partial[wid]
            self.ledger.reopen(wid, mine)
            self.dispatcher.queue_redispatch([Redispatch(wid, self.n, tuple(mine))])
        for r in voided:
            self.restored.discard(r.rollout_id)
        if voided and self.void is not None:
            self.void([{"rollout_id": r.rollout_id, "reason": "banned"} for r in voided])
        self.counts["voided_banned"] += len(voided)
        return len(voided)

    # -- selecting -----------------------------------------------------------------------------
    def select(self, version: int, k: int) -> list[Group] | None:
        """k complete groups trainable at ``version`` (oldest version, then oldest
        completion first), or None.

        Under policy "drop", a complete group holding a rollout staler than the bound is
        generated again first (voided, re-opened in the ledger, re-dispatched, counted): an
        accepted sample is never dropped, its fresh copy is trained instead.
        """
        for wid in list(self.complete):
            g = self.complete[wid]
            if all(self.gate.is_fresh(version, r) for r in g.rollouts):
                continue
            verdicts = [self.gate.check(version, r) for r in g.rollouts]
            if not all(v.accept for v in verdicts):
                # accepted, never lost: the group is generated again (its copy voided) and
                # that copy trained; the same for a copy that grew stale in its turn
                del self.complete[wid]
                if not any(r.rollout_id in self.restored for r in g.rollouts):
                    self.counts["groups_regenerated_stale"] += 1
                self._regenerate(g)
        if len(self.complete) < k:
            return None
        out = []
        order = sorted(  # the groups closest to expiring first, then completion order
            enumerate(self.complete.values()),
            key=lambda ig: (min(self.gate.oldest(r) for r in ig[1].rollouts), ig[0]),
        )
        for wid in [g.work_id for _, g in order[:k]]:
            g = self.complete.pop(wid)
            g.verdicts = [self.gate.check(version, r) for r in g.rollouts]
            assert all(v.accept for v in g.verdicts)
            out.append(g)
        return out

    def settle(self, groups: list[Group]) -> None:
        for g in groups:
            self._settle(g)

    def _settle(self, g: Group) -> None:
        assert g.work_id not in self.trained, f"group {g.work_id} trained twice"
        for r in g.rollouts:
            self.restored.discard(r.rollout_id)
        self.ledger.settle(g.work_id, range(self.n))
        self.trained.add(g.work_id)
        self.dispatcher.finished(g.work_id)

    # -- state -----------------------------------------------------------------------------------
    def buffered_ids(self) -> list[str]:
        """Accepted, untrained rollout ids (partial and complete groups)."""
        ids = [r.rollout_id for g in self._partial.values() for r in g.values()]
        ids += [r.rollout_id for g in self.complete.values() for r in g.rollouts]
        return sorted(ids)
