"""Work dispatch: prompts -> WorkItems for generators, within capacity and the staleness gate.

Loop (on the coordinator's thread)::

    d = Dispatcher(rollout_cfg, run_seed, prompts, ledger, gate)
    d.add_generator(gid, hello.max_inflight, hello.weight_version)     # on Hello
    d.set_version(gid, v)                                               # Heartbeat / weights Ack
    d.pump(learner_version, send)      # re-dispatch first, then new work, while capacity lasts,
                                       # an item at a time to the least loaded generator (ties:
                                       # the one served least recently)
    d.received(gid, work_id, index)    # an accepted sample frees capacity
    d.remove_generator(gid)            # death / Goodbye: ledger.generator_died -> re-dispatch
    d.returned(gid, work_ids)          # WorkReturn -> re-dispatch
    d.refused(gid, work_id, index)     # its rollout was refused at the door -> re-dispatch
                                       # to another generator when there is one
    d.redo(work_id, indices, avoid)    # accepted samples a refused step took back: the same
    d.overdue(timeout_s)               # work unanswered for too long -> re-dispatch elsewhere
    d.finished(work_id)                # trained or dropped: forget it

Work ids are ``w<counter>`` with a counter that only increases (saved in the checkpoint), and
the prompt and latent seeds of a work id are a pure function of (run seed, counter), so a
restarted learner re-creates exactly the work items it had dispatched.

Fair share (``share_ratio`` k > 0, run config intake.share_ratio): among the last ``window``
new work items (4 x cap, at least 16), a generator gets a new one only while it holds fewer
than k x (m + 1) of them for every other live generator that has answered correctly (an
accepted sample), m being that one's count: a generator that answers instantly cannot take
all the work from a slower honest one, which keeps about 1/(k + 1) of it with two generators
(at least 1/(k x n) of n); the fast one waits instead (re-dispatches are not counted: they
go where they can). A generator that never answered (just joined, or swallows work) is not
owed a share, and a dead one stops being owed one when it is declared gone.

Invariants: a generator holds at most ``max_inflight`` work items from us; work goes only to
a generator whose served version ``g`` passes ``gate.can_dispatch(v, g)``
(WorkItem.min_weight_version = g); at most ``cap`` work items are open (dispatched and not
yet trained or dropped), so generation runs at most ``max_staleness`` steps ahead; a
re-dispatch sends only the sample indices the ledger says are unassigned.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.noise import derive_latent_seed
from pipeline.core.eval_rounds import EvalRounds
from pipeline.core.ledger import InFlightLedger, Redispatch
from pipeline.core.staleness import StalenessGate
from proto.records import WorkItem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One dataset prompt: id, token ids and the reward's task dict."""

    prompt_id: str
    tokens: list[int]
    task: dict[str, Any]


class PromptSource:
    """Prompts in a deterministic order: epoch e visits every prompt once, shuffled by
    (seed, e); ``at(c)`` is the c-th prompt of the run (a pure function of c)."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        if not prompts:
            raise ValueError("the prompt set is empty")
        self.prompts, self.seed = prompts, seed
        self._orders: dict[int, list[int]] = {}

    def at(self, counter: int) -> Prompt:
        epoch, i = divmod(counter, len(self.prompts))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self.prompts[order[i]]


@dataclass
class WorkSpec:
    """What a work id stands for (kept until it is trained or dropped)."""

    work_id: str
    prompt: Prompt
    seeds: list[int]
    created_at: float
    min_version: int = -1  # oldest weight version it was dispatched to (-1: not yet)
    issued: dict[int, int] = field(default_factory=dict)  # sample index -> its min_weight_version
    issued_to: dict[tuple[int, str], int] = field(default_factory=dict)
    """(sample index, generator) -> the lowest min_weight_version it was issued to that
    generator with: a generator may answer an earlier issue (it was paused, declared gone,
    and its work issued to it again at a newer version); that answer is honest."""

    def index_of(self, seed: int) -> int | None:
        try:
            return self.seeds.index(seed)
        except ValueError:
            return None


@dataclass
class _Gen:
    max_inflight: int
    version: int
    pending: dict[str, set[int]] = field(default_factory=dict)  # work id -> indices it holds
    issued_at: dict[str, float] = field(default_factory=dict)  # work id -> last sent (clock)
    incarnation: Any = None  # (pid, started_at) of the process behind the id
    served: int = -1  # the dispatch sequence number of its last item (-1: none yet)
    answered: bool = False  # an accepted sample came from it: owed a fair share
    late: bool = False  # work timed out in its hands and it has not answered since


def work_id_of(counter: int) -> str:
    return f"w{counter}"


def counter_of(work_id: str) -> int:
    if not work_id.startswith("w") or not work_id[1:].isdigit():
        raise ValueError(f"not a coordinator work id: {work_id!r}")
    return int(work_id[1:])


class Dispatcher:
    """See the module docstring."""

    def __init__(
        self,
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        cap: int,
        stop: list[str] | None = None,
        per_step: int,
        run_seed: int,
        prompts: PromptSource,
        ledger: InFlightLedger,
        gate: StalenessGate,
        clock: Callable[[], float] = time.time,
        evals: EvalRounds | None = None,
        share_ratio: float = 0.0,
    ) -> None:
        if cap < 1 or n < 1:
            raise ValueError("need cap >= 1 and n >= 1")
        self.n, self.max_tokens, self.temperature, self.top_p = n, max_tokens, temperature, top_p
        self.stop_token_ids = list(stop_token_ids)
        self.stop = list(stop or [])
        self.cap, self.per_step, self.run_seed, self.prompts = cap, per_step, run_seed, prompts
        self.ledger, self.gate, self.clock = ledger, gate, clock
        self.counter = 0  # next new work id
        self.version = 0  # the learner's version at the last pump
        self.open: dict[str, WorkSpec] = {}  # dispatched, not yet trained or dropped
        self._redo: deque[Redispatch] = deque()
        self._avoid: dict[tuple[str, int], str] = {}  # refused sample -> generator to avoid
        self.evals = evals  # evaluation rounds (eval.every > 0): their items go out first
        self._gens: dict[str, _Gen] = {}
        self.sent = 0  # WorkItems sent (new + re-dispatch)
        self.timeouts: Counter[str] = Counter()  # generator -> timeouts since its last answer
        self._seq = 0  # items issued (work and evaluation): orders ties between generators
        self.share_ratio = share_ratio  # fair share (module docstring); 0: off
        self._recent: deque[str] = deque(maxlen=max(16, 4 * cap))  # owners of the last new items
        self._recent_n: Counter[str] = Counter()
        self.share_waits = 0  # new items held back from a generator over its share

    # -- generators ----------------------------------------------------------------------------
    def add_generator(
        self, gid: str, max_inflight: int, version: int, incarnation: Any = None
    ) -> None:
        """A generator said Hello. The same process again (same ``incarnation``: pid and
        start time) keeps its work, which it still holds and will deliver; a new process
        under a known id lost it: what the old one held is released for re-dispatch."""
        old = self._gens.get(gid)
        if old is not None and incarnation is not None and old.incarnation == incarnation:
            old.max_inflight, old.version = max_inflight, max(old.version, version)
            return
        if old is not None:
            self.remove_generator(gid)
        self._gens[gid] = _Gen(max_inflight, version, incarnation=incarnation)

    def incarnation(self, gid: str) -> Any:
        """The (pid, started_at) of the process known under ``gid``, or None."""
        g = self._gens.get(gid)
        return None if g is None else g.incarnation

    def set_version(self, gid: str, version: int) -> None:
        g = self._gens.get(gid)
        if g is not None and version > g.version:
            g.version = version

    def generators(self) -> dict[str, int]:
        return {k: g.version for k, g in self._gens.items()}

    def serving(self, gid: str) -> int:
        """The newest version ``gid`` acknowledged serving (-1: none, or not registered)."""
        g = self._gens.get(gid)
        return -1 if g is None else g.version

    def received_eval(self, gid: str, work_id: str) -> None:
        """An eval item is fully answered: ``gid`` no longer holds it."""
        g = self._gens.get(gid)
        if g is not None:
            g.pending.pop(work_id, None)
            g.issued_at.pop(work_id, None)

    def remove_generator(self, gid: str) -> int:
        """Dead or gone: every sample it held goes back to the re-dispatch queue, preferably
        to another generator (one that reconnects as a new process in a loop, taking work
        each time, does not get the same work back while another can take it)."""
        if self.evals is not None:
            self.evals.release(gid)
        self._gens.pop(gid, None)
        redo = self.ledger.generator_died(gid)
        for r in redo:
            for i in r.indices:
                self._avoid[(r.work_id, i)] = gid
        return self._requeue(redo)

    def heard(self, gid: str) -> None:
        """``gid`` answered work (an accepted rollout, or a late copy of work taken back from
        it): it is owed new work again after a timeout (``overdue``)."""
        self.timeouts.pop(gid, None)
        g = self._gens.get(gid)
        if g is not None:
            g.late = False

    def returned(self, gid: str, work_ids: list[str]) -> int:
        g = self._gens.get(gid)
        if g is not None:
            for w in work_ids:
                g.pending.pop(w, None)
                g.issued_at.pop(w, None)
        if self.evals is not None:
            self.evals.release(gid, list(work_ids))
        return self._requeue(self.ledger.returned(gid, work_ids))

    def refused(self, gid: str, work_id: str, index: int) -> int:
        """``gid``'s rollout for sample ``index`` was refused: it no longer holds the sample,
        which goes back to the queue, preferably to another generator."""
        g = self._gens.get(gid)
        if g is not None and work_id in g.pending:
            g.pending[work_id].discard(index)
            if not g.pending[work_id]:
                del g.pending[work_id]
        self._avoid[(work_id, index)] = gid
        return self._requeue(self.ledger.release(gid, work_id, [index]))

    def overdue(self, timeout_s: float) -> int:
        """Work held longer than ``timeout_s`` without an answer (a generator that accepts
        work and never delivers): released for re-dispatch elsewhere; returns samples. Each
        such release counts one timeout against the generator (``timeouts``: since its last
        answer, so a slow generator that does answer is never banned for it), and the
        generator gets no new work while another generator can take it, until it answers
        (``heard``): a peer that holds work delays training by one work timeout, not one
        per item it is given."""
        now, n = self.clock(), 0
        for gid, g in list(self._gens.items()):
            late = [w for w in g.pending if now - g.issued_at.get(w, now) > timeout_s]
            if late:
                self.timeouts[gid] += 1
                g.late = True
                log.warning("generator %s held %s for over %.0f s: dispatched again elsewhere",
                            gid, late, timeout_s)  # fmt: skip
                for w in late:
                    for i in g.pending.get(w, ()):
                        self._avoid[(w, i)] = gid
                n += self.returned(gid, late)
        return n

    def _requeue(self, redo: list[Redispatch]) -> int:
        for r in redo:
            self.gate.settled(r.work_id)  # no longer in flight anywhere: the gate stops waiting
            for g in self._gens.values():
                g.pending.pop(r.work_id, None)
            self._redo.append(r)
        return sum(len(r.indices) for r in redo)

    # -- work lifecycle ----------------------------------------------------------------------------
    def spec(self, work_id: str) -> WorkSpec | None:
        return self.open.get(work_id)

    def make_spec(self, counter: int) -> WorkSpec:
        p = self.prompts.at(counter)
        seeds = [derive_latent_seed(self.run_seed, p.prompt_id, i) for i in range(self.n)]
        return WorkSpec(work_id_of(counter), p, seeds, self.clock())

    def received(self, gid: str, work_id: str, index: int) -> None:
        """An accepted sample: ``gid`` no longer holds it."""
        g = self._gens.get(gid)
        if g is None:
            return
        g.answered, g.late = True, False
        self.timeouts.pop(gid, None)
        held = g.pending.get(work_id)
        if held is not None:
            held.discard(index)
            if not held:
                del g.pending[work_id]
                g.issued_at.pop(work_id, None)
        if self.ledger.is_received(work_id):
            self.gate.settled(work_id)

    def finished(self, work_id: str) -> None:
        """Trained or dropped (the ledger has settled it)."""
        spec = self.open.pop(work_id, None)
        if spec is not None:
            for i in range(self.n):
                self._avoid.pop((work_id, i), None)

    def redo(self, work_id: str, indices: list[int], avoid: dict[int, str]) -> None:
        """Accepted samples taken back (a step refused their rollouts): dispatched again, each
        preferably to another generator than ``avoid[index]``."""
        for i in indices:
            if i in avoid:
                self._avoid[(work_id, i)] = avoid[i]
        self._redo.append(Redispatch(work_id, self.n, tuple(indices)))

    def queue_redispatch(self, redo: list[Redispatch]) -> None:
        """Samples to send again (after a restore)."""
        self._redo.extend(redo)

    def inflight(self) -> int:
        return sum(len(g.pending) for g in self._gens.values())

    # -- sending -----------------------------------------------------------------------------------
    def pump(
        self,
        learner_version: int,
        send: Callable[[str, WorkItem], bool],
        expected: Callable[[str], int] | None = None,
    ) -> int:
        """Send what capacity, the staleness gate and ``cap`` allow; returns items sent.

        ``learner_version``: the version the trainer holds (the coordinator's trained_version,
        versions still being written included): the gate and the budget count the steps left
        from there.

        ``expected(gid)``: the version a generator will serve once the weights being sent to
        it are loaded. Work is issued against max(acknowledged, expected): the generator
        loads pending weights before it starts a batch and never starts an item above the
        version it serves (``min_weight_version``), so the staleness deadline stays exact,
        and a generator whose batch arrives just before it loads the new version is not left
        idle for a whole training step."""
        sent = 0
        self.version = learner_version
        # one item at a time to the least loaded; among equals, the one served least recently
        # (when work, not generators, is short, a generator that joined later is not starved
        # by the first one taking every item that frees up); a heap: O(items x log N)
        punctual = any(not g.late for g in self._gens.values())  # late ones wait for them
        heap = [(len(g.pending), g.served, k) for k, g in self._gens.items()
                if len(g.pending) < g.max_inflight and not (g.late and punctual)]  # fmt: skip
        heapq.heapify(heap)
        while heap:
            gid = heapq.heappop(heap)[2]
            g = self._gens.get(gid)
            if g is None:
                continue
            ver = max(g.version, expected(gid)) if expected is not None else g.version
            if not (self.gate.can_dispatch(learner_version, ver) and self._give(gid, g, ver, send)):
                continue  # nothing for it now, or it is gone
            sent += 1
            if len(g.pending) < g.max_inflight:
                heapq.heappush(heap, (len(g.pending), g.served, gid))
        return sent

    def _give(self, gid: str, g: _Gen, ver: int, send: Callable[[str, WorkItem], bool]) -> bool:
        """Send ``gid`` its next item (evaluation work first); False: nothing for it now
        (what is left avoids it) or it is unroutable (removed: death handling requeues)."""
        evals = self.evals
        ev = evals.next_item(gid, ver) if evals is not None else None
        if evals is not None and ev is not None:  # evaluation work: outside ledger and gate
            if not send(gid, ev):
                evals.release(gid, [ev.work_id])
                self.remove_generator(gid)
                return False
            g.pending[ev.work_id] = set(range(len(ev.latent_seeds)))
            g.issued_at[ev.work_id] = self.clock()
            g.served, self._seq = self._seq, self._seq + 1
            return True
        item = self._next_item(gid, g, ver)
        if item is None:
            return False
        if not send(gid, item):
            self.remove_generator(gid)
            return False
        self.sent += 1
        return True

    def _next_item(self, gid: str, g: _Gen, ver: int) -> WorkItem | None:
        others = len(self._gens) > 1
        skipped: list[Redispatch] = []
        item = None
        while self._redo and item is None:
            r = self._redo.popleft()
            spec = self.open.get(r.work_id)
            if spec is None:
                continue
            states = self.ledger.state(r.work_id)
            unassigned = [i for i in r.indices if states[i] == "unassigned"]
            mine = [
                i for i in unassigned if not (others and self._avoid.get((r.work_id, i)) == gid)
            ]
            if len(mine) < len(unassigned):  # refused by this generator: leave to another
                rest = tuple(i for i in unassigned if i not in mine)
                skipped.append(Redispatch(r.work_id, r.n, rest))
            if mine:  # with the other re-dispatches of the same work that it may take
                for other in list(self._redo):
                    if other.work_id == r.work_id:
                        more = [i for i in other.indices if states[i] == "unassigned" and i not in mine
                                and not (others and self._avoid.get((r.work_id, i)) == gid)]  # fmt: skip
                        if more:
                            self._redo.remove(other)
                            rest = tuple(i for i in other.indices if i not in more)
                            if rest:
                                skipped.append(Redispatch(other.work_id, other.n, rest))
                            mine += more
                item = self._issue(gid, g, spec, sorted(mine), ver)
        self._redo.extendleft(reversed(skipped))
        if item is not None:
            return item
        if len(self.open) >= self.cap or not self._budget(ver) or not self._fair(gid):
            return None
        self._note_new(gid)
        spec = self.make_spec(self.counter)
        self.counter += 1
        self.open[spec.work_id] = spec
        return self._issue(gid, g, spec, list(range(self.n)), ver)

    def _fair(self, gid: str) -> bool:
        """May ``gid`` take a new item under the fair share (module docstring)?"""
        k = self.share_ratio
        if k <= 0:
            return True
        mine = self._recent_n[gid]
        for h, other in self._gens.items():
            if h != gid and other.answered and mine >= k * (self._recent_n[h] + 1):
                self.share_waits += 1
                return False
        return True

    def _note_new(self, gid: str) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            self._recent_n[old] -= 1
        self._recent.append(gid)
        self._recent_n[gid] += 1

    def _budget(self, g: int) -> bool:
        """Policy "drop": new work for a generator serving ``g`` is trainable up to learner
        version d = g + max_staleness, i.e. in the (d - v + 1) steps left at versions v..d;
        it is sent only while fewer than (d - v + 1) x prompts_per_step open work items
        expire by d, so nothing is generated only to be dropped as stale."""
        if self.gate.policy == "keep":
            return True
        s, v = self.gate.max_staleness, self.version
        d = g + s
        due = sum(1 for w in self.open.values() if 0 <= w.min_version and w.min_version + s <= d)
        return due < (d - v + 1) * self.per_step

    def _issue(self, gid: str, g: _Gen, spec: WorkSpec, indices: list[int], ver: int) -> WorkItem:
        spec.min_version = ver if spec.min_version < 0 else min(spec.min_version, ver)
        for i in indices:
            spec.issued[i] = ver
            spec.issued_to[(i, gid)] = min(spec.issued_to.get((i, gid), ver), ver)
            self._avoid.pop((spec.work_id, i), None)
        self.ledger.dispatch(spec.work_id, gid, self.n, indices=indices)
        self.gate.dispatched(spec.work_id, ver)
        g.pending.setdefault(spec.work_id, set()).update(indices)
        g.issued_at[spec.work_id] = self.clock()
        g.served, self._seq = self._seq, self._seq + 1
        full = indices == list(range(self.n))
        return WorkItem(
            work_id=spec.work_id,
            prompt_id=spec.prompt.prompt_id,
            prompt_tokens=np.asarray(spec.prompt.tokens, dtype=np.int32),
            latent_seeds=np.asarray([spec.seeds[i] for i in indices], dtype=np.uint64),
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
            task=dict(spec.prompt.task),
            min_weight_version=ver,
            issued_at=time.time(),
            sample_indices=[] if full else list(indices),
        )
