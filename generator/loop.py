"""The generator main loop: work in, rollouts out, weights loaded between engine steps.

Order of events (one ``GeneratorLoop.run()``)::

    connection sends Hello (on connect and on every reconnect: the connection's job)
    recv Welcome ─► required version := welcome.weight_version
    until the engine serves >= that version: take WeightAnnounce/WeightChunk, load, Ack
    loop until stop():
        recv (control + weights; at least every poll_s, so the connection's heartbeats flow)
          WorkItem        -> queue it, or hand it back (WorkReturn) when max_inflight are held
          WeightAnnounce/Chunk -> the receiver; a VerifiedWeights waits for the engine to be idle
          Ack/Nack rollout     -> the outbox forgets the acknowledged rollouts
          Welcome again        -> a reconnect: the outbox re-sends every unacknowledged group
        engine idle: load pending weights, else start a batch (full, or oldest waited batch_wait_s)
        batch generated -> score (reward runner, on its own thread) -> its finished items into
                           the outbox (generator.outbox), sent together (as few RolloutBatch
                           messages as size allows; acked and re-sent per item)
    stop(): hand back queued items, let the batch in progress finish within drain_timeout_s
            (else hand it back too), wait briefly for acks, close the connection (Goodbye)

Invariants: never more than ``max_inflight`` work items held (queued + generating +
scoring), reported through ``connection.set_status`` (-> Heartbeat.inflight); no batch
starts before the Welcome's weight version is served, nor with an item whose
min_weight_version is above the served one; weights change only between engine calls (one
engine thread runs generate and load_weights in order); a finished group stays in the
outbox (generator.outbox.Outbox, bounded by max_unacked) until the learner acks it, and is
re-sent after a reconnect (the learner dedups by rollout_id); a failing reward never stops
the loop (it scores None); the Goodbye is always sent, also when the loop dies of an error.

Acks: ``Ack(kind="rollout" | "work", ref=work_id)`` acknowledges a whole group,
``ref=rollout_id`` one rollout; a Nack of the same kinds drops them (refused, not retried).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from generator.collaborators import Connection, Engine, ToRollouts
from generator.lane import Lane
from generator.outbox import Outbox
from generator.reward_runner import RewardRunner
from proto.records import (
    Ack,
    ErrorMsg,
    Goodbye,
    Heartbeat,
    Nack,
    Rollout,
    WeightAnnounce,
    WeightChunk,
    Welcome,
    WorkItem,
    WorkReturn,
)
from weights.receiver import Receiver
from weights.verified import VerifiedWeights

__all__ = ["FatalError", "GeneratorLoop", "LoopStats"]

log = logging.getLogger(__name__)


@dataclass
class LoopStats:
    """Counters of one loop (all monotone)."""

    counts: Counter[str] = field(default_factory=Counter)
    max_held: int = 0  # the most work items ever held at once (<= max_inflight)


@dataclass
class _Held:
    item: WorkItem
    received_at: float
    started_at: float = 0.0


@dataclass
class _Batch:
    held: list[_Held]
    future: Future[Any]
    scoring: Future[Any] | None = None


class FatalError(RuntimeError):
    """The loop cannot go on (the engine failed, or the learner's settings are unusable)."""


class GeneratorLoop:
    """Serves work items from the learner; see the module docstring for the loop.

    Threads: the caller's thread runs ``run()`` and owns the connection; one engine thread
    runs engine.generate, ``to_rollouts`` and engine.load_weights in order (an announced
    directory is read and hashed there, not on the caller's thread); one scoring thread runs
    the reward runner. ``weights``: the receiver of the weights channel (weights.transports.open_receiver);
    its Acks and Nacks go out through it. ``threaded=False`` runs both inline in ``step()``.
    ``stop()`` only sets a flag, so a signal handler may call it. Finished rollouts go to
    ``outbox`` (generator.outbox.Outbox), which sends them and keeps them until acknowledged.
    """

    def __init__(
        self,
        engine: Engine,
        connection: Connection,
        reward: RewardRunner,
        *,
        to_rollouts: ToRollouts,
        generator_id: str,
        max_inflight: int,
        batch_wait_s: float = 0.05,
        max_batch_items: int = 0,
        weights: Receiver,
        detokenize: Callable[[list[int]], str] | None = None,
        check_welcome: Callable[[Welcome], None] | None = None,
        drain_timeout_s: float = 30.0,
        ack_wait_s: float = 2.0,
        resend_after_s: float = 0.0,
        max_unacked: int = 256,
        poll_s: float = 0.02,
        threaded: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_inflight < 1 or max_batch_items < 0 or max_unacked < 1:
            raise ValueError("need max_inflight >= 1, max_batch_items >= 0, max_unacked >= 1")
        if min(batch_wait_s, drain_timeout_s, ack_wait_s, resend_after_s) < 0 or poll_s <= 0:
            raise ValueError("waits and timeouts must be >= 0 (poll_s > 0)")
        self.engine, self.conn, self.reward, self.weights = engine, connection, reward, weights
        self.to_rollouts = to_rollouts
        self.generator_id, self.max_inflight = generator_id, max_inflight
        self.max_batch_items = max_batch_items or max_inflight
        self.batch_wait_s, self.drain_timeout_s, self.ack_wait_s = (
            batch_wait_s, drain_timeout_s, ack_wait_s,
        )  # fmt: skip
        self.poll_s = poll_s
        self.detokenize, self.check_welcome, self.clock = detokenize, check_welcome, clock
        self.stats = LoopStats()
        self.outbox = Outbox(
            connection, max_unacked=max_unacked, resend_after_s=resend_after_s,
            counts=self.stats.counts, clock=clock,
        )  # fmt: skip
        self.last_turn = clock()  # when step() last ran to its end (generator.health)
        self.welcome: Welcome | None = None
        self.version = engine.weight_version  # the version the engine serves
        self._need = 0  # the Welcome's version: nothing is generated below it
        self._queue: deque[_Held] = deque()
        self._ids: set[str] = set()  # work ids held (queued, generating or scoring)
        self._batch: _Batch | None = None  # on the engine thread
        self._scoring: deque[_Batch] = deque()  # on the scoring thread, in order
        self._pending: VerifiedWeights | None = None  # waiting for the engine to be idle
        self._load: tuple[VerifiedWeights, Future[Any]] | None = None
        # an engine that swaps weights between the steps of a running batch
        # (inflight_updates): a version is loaded (checked, staged) on its own lane while a
        # batch runs, and served once the engine's weight_version reaches it
        self._inflight = bool(getattr(engine, "inflight_updates", False))
        self._beside = False  # the load in progress runs beside a batch (the weights lane)
        self._swapping: VerifiedWeights | None = None  # staged in the engine, not yet in
        self._heard: dict[int, tuple[float, float]] = {}  # version -> (record in, handed out)
        self._stopping, self._stop_reason = False, "shutdown"
        # a lane's finished call wakes run()'s recv (connection.waker), not the next poll_s
        waker = getattr(connection, "waker", None)
        wake = waker() if threaded and callable(waker) else None
        self._engine_lane = Lane("generator-engine", inline=not threaded, on_done=wake)
        self._score_lane = Lane("generator-score", inline=not threaded, on_done=wake)
        self._weights_lane = (Lane("generator-weights", inline=not threaded, on_done=wake)
                              if self._inflight else None)  # fmt: skip
        notify = getattr(engine, "notify_swaps", None)
        if self._inflight and wake is not None and callable(notify):
            notify(wake)  # a version swapped in mid-batch is acknowledged at once

    # -- public ---------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Work items held: queued + generating + scoring."""
        return len(self._ids)

    @property
    def serving(self) -> bool:
        """Welcomed and serving at least the Welcome's weight version."""
        return self.welcome is not None and self.version >= self._need

    def stop(self, reason: str = "shutdown") -> None:
        """Ask ``run()`` to finish (see the module docstring); safe in a signal handler."""
        self._stop_reason = reason
        self._stopping = True

    def run(self) -> None:
        """Serve until ``stop()``; then drain, hand back, say Goodbye. Re-raises fatal errors
        after handing back every held item and sending Goodbye."""
        try:
            while not self._stopping:
                self.step()
            self._drain()
        except BaseException as e:
            self._abort(e)
            raise
        finally:
            self._engine_lane.close()
            self._score_lane.close()

    def step(self, timeout_s: float | None = None) -> None:
        """One turn: receive (waiting up to ``timeout_s``, default poll_s), harvest finished
        batches, load weights or start a batch, re-send what is due, report status."""
        inc = self.conn.recv(self.poll_s if timeout_s is None else timeout_s)
        for _ in range(256):  # take what is queued, but keep the engine fed
            if inc is None:
                break
            self._dispatch(inc.channel, inc.record)
            inc = self.conn.recv(0.0)
        self._harvest()
        self._advance()
        self._harvest()  # inline mode finishes within _advance
        self.outbox.resend_due()
        self.conn.set_status(self.version, self.held)
        self.last_turn = self.clock()

    # -- incoming -------------------------------------------------------------------------
    def _dispatch(self, channel: str, rec: Any) -> None:
        c = self.stats.counts
        if isinstance(rec, Welcome):
            self._on_welcome(rec)
        elif isinstance(rec, WorkItem):
            self._admit(rec)
        elif isinstance(rec, WeightAnnounce | WeightChunk):
            self._on_weights(rec)
        elif isinstance(rec, Ack | Nack) and rec.kind in ("rollout", "work"):
            self.outbox.acknowledge(rec)
        elif isinstance(rec, ErrorMsg):
            c["learner_errors"] += 1
            if rec.code == "banned":  # the learner dropped us for the run: serving is pointless
                raise FatalError(f"the learner dropped this generator: {rec.message}")
            log.warning("learner error on %s: %s: %s", channel, rec.code, rec.message)
        elif isinstance(rec, Goodbye):
            c["learner_goodbyes"] += 1
            log.warning("the learner left (%s); waiting for it to come back", rec.reason)

    def _on_welcome(self, w: Welcome) -> None:
        again = self.welcome is not None
        self.welcome, self._need = w, w.weight_version
        if self.check_welcome is not None:
            try:
                self.check_welcome(w)
            except ValueError as e:
                raise FatalError(f"the learner's settings are unusable here: {e}") from e
        self.stats.counts["reconnects" if again else "welcomes"] += 1
        log.info(
            "welcomed by run %s (weights v%d required, serving v%d)%s",
            w.run_id, w.weight_version, self.version, "; re-sending unacked" if again else "",
        )  # fmt: skip
        self.outbox.on_welcome(reconnect=again)

    def _admit(self, item: WorkItem) -> None:
        wid, c = item.work_id, self.stats.counts
        c["work_received"] += 1
        if wid in self._ids:
            c["work_duplicate"] += 1  # a re-dispatch of what we hold: its result will come
            return
        if self.outbox.resend(wid):
            c["work_duplicate"] += 1  # finished already: our rollouts were lost, sent again
            return
        if self._stopping:
            self._return([wid], self._stop_reason)
            return
        if self.held >= self.max_inflight:
            c["work_over_capacity"] += 1
            self._return([wid], f"over capacity: max_inflight={self.max_inflight} held")
            return
        self._queue.append(_Held(item, self.clock()))
        self._ids.add(wid)
        self.stats.max_held = max(self.stats.max_held, self.held)

    def _on_weights(self, rec: WeightAnnounce | WeightChunk) -> None:
        t0 = time.perf_counter()
        ready = self.weights.handle(rec)
        if ready is None:
            return
        self._heard[ready.version] = (t0, time.perf_counter())
        loading = max(self._load[0].version if self._load is not None else -1,
                      self._swapping.version if self._swapping is not None else -1)  # fmt: skip
        if ready.version <= self.version:  # already served (our Ack was lost): acknowledge
            self.conn.send(Ack("weights", str(self.version), self.version), channel="weights")
        elif ready.version <= loading:  # heard again while it loads (e.g. after a pause):
            pass  # the load's end acknowledges it
        else:
            self._pending = ready  # a newer version replaces one not yet loaded

    # -- engine ---------------------------------------------------------------------------
    def _advance(self) -> None:
        if self._load is not None and self._load[1].done():
            ready, fut = self._load
            self._load, self._beside = None, False
            exc = fut.exception()
            if exc is None and int(fut.result()) < ready.version:
                self._swapping = ready  # staged: the running batch swaps it in
            else:
                if exc is None:
                    self.version = int(fut.result())
                self._weights_done(ready.version, exc)
        swap, broken = self._swapping, getattr(self.engine, "broken", "")
        if swap is not None and (self.engine.weight_version >= swap.version or broken):
            self._swapping = None
            served = int(self.engine.weight_version)
            failed = None if served >= swap.version else RuntimeError(str(broken))
            self.version = max(self.version, served)
            self._weights_done(swap.version, failed)
        if self._stopping:
            return
        if (self._inflight and self._batch is not None and self._load is None
                and self._swapping is None and self._pending is not None):  # fmt: skip
            ready, self._pending = self._pending, None  # loaded beside the running batch
            if ready.version <= self.version:
                self.conn.send(Ack("weights", str(self.version), self.version), channel="weights")
            else:
                assert self._weights_lane is not None
                self._beside = True
                self._load = (ready, self._weights_lane.submit(lambda: self._load_weights(ready)))
            return
        if self._batch is not None or (self._load is not None and not self._beside):
            return
        if self._swapping is not None and self._load is None:  # staged as the batch ended:
            if self._pending is None:  # loaded on the idle engine (a newer pending replaces it)
                self._pending = self._swapping
            self._swapping = None
        if self._pending is not None and self._load is None:
            ready, self._pending = self._pending, None
            if ready.version <= self.version:  # a load that ended meanwhile served it
                self.conn.send(Ack("weights", str(self.version), self.version), channel="weights")
                return self._advance()
            self._load = (ready, self._engine_lane.submit(lambda: self._load_weights(ready)))
            return self._advance() if self._engine_lane.inline else None
        if self.serving:
            self._maybe_start_batch()

    def _load_weights(self, ready: VerifiedWeights) -> int:
        self.engine.load_weights(ready)  # its state checked on this (the engine's) thread
        return self.engine.weight_version

    def _weights_done(self, version: int, exc: BaseException | None) -> None:
        c = self.stats.counts
        if exc is not None:
            c["weights_failed"] += 1
            log.error("loading weights v%d failed: %r", version, exc)
            self.weights.load_failed(version, repr(exc)[:2000])
            return
        c["weights_loaded"] += 1
        heard = self._heard.pop(version, None)
        for v in [v for v in self._heard if v < version]:
            del self._heard[v]
        if heard is None:
            log.info("serving weights v%d", self.version)
        else:  # the announce's record received -> handed out (checked) -> served
            now = time.perf_counter()
            log.info("serving weights v%d: received and checked in %.1f ms, served %.1f ms "
                     "after", self.version, 1e3 * (heard[1] - heard[0]), 1e3 * (now - heard[1]))  # fmt: skip
        self.weights.loaded(self.version)
        # The learner accepts rollouts of a version only from a generator that said it serves
        # it. The weights Ack travels on the other socket; a Heartbeat on the control channel
        # now, before any batch of this version starts, arrives ahead of its rollouts.
        self.conn.set_status(self.version, self.held)
        self.conn.send(Heartbeat(self.generator_id, time.time(), self.version, self.held))

    def _maybe_start_batch(self) -> None:
        ready = [h for h in self._queue if h.item.min_weight_version <= self.version]
        if not ready:
            return
        now = self.clock()
        if not (
            len(ready) >= self.max_batch_items
            or self.held >= self.max_inflight  # nothing more can arrive
            or now - ready[0].received_at >= self.batch_wait_s
        ):
            return
        take = ready[: self.max_batch_items]
        taken = {id(h) for h in take}
        self._queue = deque(h for h in self._queue if id(h) not in taken)
        for h in take:
            h.started_at = now
        items = [h.item for h in take]
        self._batch = _Batch(take, self._engine_lane.submit(lambda: self._generate(items)))
        self.stats.counts["batches"] += 1

    def _generate(self, items: list[WorkItem]) -> tuple[list[list[Rollout]], float]:
        t0 = time.perf_counter()
        samples = self.engine.generate(items)
        gen_s = time.perf_counter() - t0
        if len(samples) != len(items):
            raise FatalError(f"engine.generate returned {len(samples)} groups for {len(items)}")
        rolls = [self.to_rollouts(it, list(s), self.generator_id) for it, s in zip(items, samples)]
        return rolls, gen_s

    def _score(
        self, rolls: list[list[Rollout]], held: list[_Held], gen_s: float
    ) -> list[list[Rollout]]:
        calls, targets = [], []
        for rs, h in zip(rolls, held):
            for r in rs:
                r.metrics.update(gen_time_s=gen_s, queue_time_s=h.started_at - h.received_at)
                if "turns" in r.reward_info:  # a conversation: its environment scored it
                    continue
                toks = [int(t) for t in r.tokens]
                try:
                    text = self.detokenize(toks) if self.detokenize is not None else ""
                except Exception as e:  # a reward failure, not a generator failure
                    r.reward = None
                    r.reward_info = {"error": f"detokenize: {e!r}", "kind": "exception"}
                    continue
                calls.append((text, toks, dict(h.item.task)))
                targets.append(r)
        for r, res in zip(targets, self.reward.score_many(calls)):
            r.reward, r.reward_info = res.reward, res.info
            r.metrics["reward_time_s"] = res.elapsed_s
        return rolls

    def _harvest(self) -> None:
        b = self._batch
        if b is not None and b.future.done():
            self._batch = None
            exc = b.future.exception()
            if exc is not None:
                self._scoring.append(b)  # still held: _abort hands it back
                raise FatalError(f"engine.generate failed: {exc!r}") from exc
            rolls, gen_s = b.future.result()
            held = b.held
            b.scoring = self._score_lane.submit(lambda: self._score(rolls, held, gen_s))
            self._scoring.append(b)
        while (
            self._scoring
            and self._scoring[0].scoring is not None
            and self._scoring[0].scoring.done()
        ):
            b = self._scoring[0]
            assert b.scoring is not None
            exc = b.scoring.exception()
            if exc is not None:
                raise FatalError(f"scoring failed: {exc!r}") from exc
            self._scoring.popleft()
            done = [(h.item.work_id, rs) for h, rs in zip(b.held, b.scoring.result())]
            for wid, rs in done:
                self._ids.discard(wid)
                self.stats.counts["reward_failures"] += sum(r.reward is None for r in rs)
                self.stats.counts["groups_done"] += 1
            self.outbox.add(done)

    # -- work handed back (finished rollouts go out through self.outbox) ------------------
    def _return(self, work_ids: list[str], reason: str) -> None:
        if work_ids:
            self.conn.send(WorkReturn(self.generator_id, work_ids, reason))
            self.stats.counts["work_returned"] += len(work_ids)

    # -- shutdown -------------------------------------------------------------------------
    def _drain(self) -> None:
        reason = self._stop_reason
        queued = [h.item.work_id for h in self._queue]
        self._queue.clear()
        self._ids.difference_update(queued)
        self._return(queued, reason)
        deadline = self.clock() + self.drain_timeout_s
        while (self._batch or self._scoring or self._load) and self.clock() < deadline:
            self.step()
        left = [wid for b in self._busy_batches() for wid in (h.item.work_id for h in b.held)]
        if left:
            log.warning(
                "batch not finished within drain_timeout_s: handing back %d items", len(left)
            )
            self._ids.difference_update(left)
            self._return(left, f"{reason} (not finished within {self.drain_timeout_s}s)")
            self._batch = None
            self._scoring.clear()
        deadline = self.clock() + self.ack_wait_s
        while len(self.outbox) and self.conn.ready and self.clock() < deadline:
            self.step()
        self.conn.set_status(self.version, self.held)
        self.conn.close(reason)
        self.stats.counts["stopped"] += 1

    def _busy_batches(self) -> list[_Batch]:
        return ([self._batch] if self._batch is not None else []) + list(self._scoring)

    def _abort(self, exc: BaseException) -> None:
        reason = f"error: {type(exc).__name__}: {exc}"[:500]
        try:
            held = [h.item.work_id for h in self._queue]
            held += [h.item.work_id for b in self._busy_batches() for h in b.held]
            self._return(held, reason)
            self.conn.close(reason)
        except Exception:  # the original error matters more
            log.exception("could not hand back work after a fatal error")
