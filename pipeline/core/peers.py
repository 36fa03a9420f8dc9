"""The generators as the learner sees them: each record a generator sends handled (Hello,
Heartbeat, rollouts, WorkReturn, Goodbye, weights Acks), the serving version it claims checked
against what was delivered to it, bans and departures, and one receive-and-handle pass
(``poll``). docs/PIPELINE.md, "The coordinator loop" and "What the learner promises about its
generators"."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from models.exits import ExitPolicy, policy_to_dict
from pipeline.core.dispatch import Dispatcher
from pipeline.core.eval_rounds import EvalRounds, is_eval_work
from pipeline.core.intake import Intake
from pipeline.core.timeline import StepTimeline
from pipeline.net.log_limit import Throttle
from proto.records import (
    Ack,
    ErrorMsg,
    Goodbye,
    Heartbeat,
    Hello,
    Nack,
    Rollout,
    RolloutBatch,
    Welcome,
    WorkReturn,
)
from weights.deliveries import DeliveryLog

log = logging.getLogger("pipeline.core.coordinator")  # the coordinator's lines, one logger name
HELLO_INTERVAL_S = 1.0  # a generator id's Hellos are answered once per interval
MAX_WORK_TIMEOUTS = 3  # a generator whose work is taken back this often is banned


class Peers:
    """Generators' records in, their claims checked, bans and departures.

    Loop (the coordinator's thread, once per turn): ``poll(timeout_s)`` receives what arrived
    and ``handle``\\ s each record (at most 512 a turn), then declares gone the generators the
    endpoint heard nothing from for ``transport.peer_timeout_s``, takes back work held past
    ``work_timeout_s`` (banning a generator after ``MAX_WORK_TIMEOUTS`` timeouts without an
    answer in between) and drops the generators that refused the current weights too often.

    Invariant: a banned generator stays banned for the run under its first reason; nothing it
    sends afterwards reaches the intake, the dispatcher or the publisher (each record is only
    counted, ``from_banned``, and a Hello answered with ErrorMsg "banned"). A serving version a
    generator claims is believed only if it was delivered to it (``deliveries``); a false claim
    counts toward its refusal budget (reason ``claim``)."""

    def __init__(
        self,
        endpoint: Any,
        *,
        dispatcher: Dispatcher,
        publisher: Any,
        intake: Intake,
        deliveries: DeliveryLog,
        timeline: StepTimeline,
        evals: EvalRounds | None,
        run_id: Callable[[], str],
        version: Callable[[], int],
        welcome_settings: Mapping[str, Any],
        exit_policy: ExitPolicy | None,
        work_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        """``endpoint``: a pipeline.net.transport.session.LearnerEndpoint; ``publisher``: the weight
        transfers (weights); ``run_id`` and ``version``: the run's id and the newest
        announced version when a Welcome is sent; ``welcome_settings``: the run-wide scalar
        settings a generator checks on Welcome (numerics); ``exit_policy``: the run's exit
        policy (None: full depth), which the Welcome states as its map (Welcome.exit_policy) and
        a generator checks too; ``work_timeout_s``: intake.work_timeout_s
        resolved (0: work is never taken back)."""
        self.endpoint, self.dispatcher, self.publisher = endpoint, dispatcher, publisher
        self.intake, self.deliveries, self.timeline = intake, deliveries, timeline
        self.evals, self.run_id, self.version = evals, run_id, version
        self.welcome_settings = dict(welcome_settings)
        self.exit_policy = exit_policy
        self.work_timeout_s = work_timeout_s
        self.banned: dict[str, str] = {}  # generator id -> why it was dropped for the run
        self._throttle = Throttle(HELLO_INTERVAL_S, clock)  # Hellos and claim warnings, per id

    def handle(self, channel: str, peer: str, rec: Any) -> None:
        ep, d = self.endpoint, self.dispatcher
        if peer in self.banned:
            self.intake.counts["from_banned"] += 1
            if isinstance(rec, Hello):
                ep.send(peer, ErrorMsg("banned", f"dropped for this run: {self.banned[peer]}"))
            return
        if channel == "weights":
            if isinstance(rec, Ack) and rec.kind == "weights":  # "I serve v": a claim too
                if self._claimed(peer, rec.version, "weights Ack") < 0 <= rec.version:
                    return  # never delivered to it: the publisher keeps offering the current
            if self.publisher.handle(peer, rec) and peer in self.publisher.generators():
                d.set_version(peer, self.publisher.serving(peer))
                self.timeline.served(self.publisher.generators())
            return
        if isinstance(rec, Hello):
            self._hello(peer, rec)
        elif isinstance(rec, Heartbeat):
            v = self._claimed(peer, rec.weight_version, "heartbeat")
            if v < 0 or peer in self.banned:
                return
            d.set_version(peer, v)
            if peer in self.publisher.generators():
                self.publisher.observe(peer, v)
        elif isinstance(rec, RolloutBatch | Rollout):
            rolls = rec.rollouts if isinstance(rec, RolloutBatch) else [rec]
            if self.evals is not None and any(is_eval_work(r.work_id) for r in rolls):
                ev = [r for r in rolls if is_eval_work(r.work_id)]
                acks, ban = self.evals.receive(peer, ev, self.intake.check_eval)
                for ack in acks:
                    ep.send(peer, ack)
                if ban is not None:  # refused eval rollouts count toward a ban too
                    self.ban(peer, ban)
                    return
                for w in {r.work_id for r in ev} - set(self.evals.held.get(peer, {})):
                    d.received_eval(peer, w)
                rolls = [r for r in rolls if not is_eval_work(r.work_id)]
                if not rolls:
                    return
                rec = RolloutBatch(rolls)
            self.timeline.intake_start()
            res = self.intake.receive(peer, rec)
            self.timeline.intake_end()
            for reply in res.replies:
                ep.send(peer, reply)
            if res.ban is not None:
                self.ban(peer, res.ban)
        elif isinstance(rec, WorkReturn):
            n = d.returned(peer, list(rec.work_ids))
            log.info("generator %s returned %d samples: %s", peer, n, rec.reason)
        elif isinstance(rec, Goodbye):
            self.gone(peer, f"goodbye: {rec.reason}")
        elif isinstance(rec, Ack | Nack):
            pass  # the generator acknowledges nothing we act on yet

    def _claimed(self, peer: str, v: int, what: str) -> int:
        """A generator's claimed serving version, checked against what was delivered to it
        (weights.deliveries: the starting checkpoint v0, or a version whose announcement
        this learner sent to ``peer``; a version above the newest was never even published).
        A false claim is refused (counted ``claims_refused``, logged at most once per
        ``HELLO_INTERVAL_S`` per generator) and -1 returned: the generator is treated as
        serving nothing and gets the current weights before any work. A false claim also
        counts toward the generator's refusal budget (intake.max_refused within
        intake.window_s, reason ``claim``): one that keeps claiming what it was never sent is
        banned. -1 (serves nothing yet) is no claim."""
        if v >= 0 and peer in self.publisher.generators():
            t = self.publisher.target(peer)  # being sent (or acknowledged, checked here first)
            if t >= 0:
                self.deliveries.record(peer, t)
        if v < 0 or self.deliveries.delivered(peer, v):
            return v
        self.intake.counts["claims_refused"] += 1
        if self._throttle.allow(f"claim:{peer}"):
            newest = self.version()
            why = (f"the newest version published is v{newest}" if v > newest
                   else f"v{v} was never delivered to it (delivered: "
                   f"{self.deliveries.versions(peer)[-4:]})")  # fmt: skip
            log.warning("generator %s claims to serve v%d in its %s, but %s: refused", peer, v,
                        what, why)  # fmt: skip
        ban = self.intake.refusals.note(peer, "claim")
        if ban is not None:
            self.ban(peer, f"{ban}: claims to serve weights it was never sent")
        return -1

    def _hello(self, peer: str, rec: Hello) -> None:
        """Hello, answered once per ``HELLO_INTERVAL_S`` per generator id (the rest counted,
        not logged): a new process under ``peer`` joins (its old work released); the same
        process again (a reconnect, or the Hellos it queued while the learner was down) keeps
        its work and its weight transfer (a repeated
        Hello used to restart the transfer of a version it was loading: "version 9 is not
        newer than 9"), and is logged at DEBUG."""
        d, ep = self.dispatcher, self.endpoint
        inc = (rec.pid, rec.started_at)
        same = d.incarnation(peer) == inc
        if not self._throttle.allow(f"hello:{peer}"):  # a new "process" every Hello included:
            self.intake.counts["hellos_throttled"] += 1  # its work is released once per interval
            return
        v = self._claimed(peer, rec.weight_version, "Hello")
        if peer in self.banned:
            return
        if same:
            log.debug("generator %s said Hello again (serving v%d)", peer, v)
        else:
            log.info("generator %s joined (serving v%d)", peer, v)
        d.add_generator(peer, rec.max_inflight, v, inc)
        if same and peer in self.publisher.generators():
            if v >= 0:
                self.publisher.observe(peer, v)
        else:
            self.publisher.add_generator(peer, v)
        ep.send(peer, Welcome(self.run_id(), peer, self.version(),
                              ep.config.heartbeat_interval_s, dict(self.welcome_settings),
                              exit_policy=policy_to_dict(self.exit_policy) or {}))  # fmt: skip

    def ban(self, gid: str, why: str) -> None:
        """Drop ``gid`` for the rest of the run: its work is re-dispatched, whatever it sends
        is ignored, and it is told so (ErrorMsg "banned"; a looprl generator exits). A
        generator banned already stays banned for its first reason (nothing is done again)."""
        if gid in self.banned:
            return
        self.banned[gid] = why
        self.endpoint.send(gid, ErrorMsg("banned", f"dropped for this run: {why}"))
        n = self.dispatcher.remove_generator(gid)
        self.publisher.remove_generator(gid)
        void = self.intake.void_generator(gid)  # its accepted, untrained rollouts: not trusted
        log.error("generator %s dropped for the run: %s; %d samples re-dispatched, %d accepted "
                  "but untrained voided and dispatched again", gid, why, n, void)  # fmt: skip

    def gone(self, gid: str, why: str) -> None:
        """``gid`` left (Goodbye, silence, weights refused): the samples it held go back to
        the re-dispatch queue; it may come back with a Hello."""
        n = self.dispatcher.remove_generator(gid)
        self.publisher.remove_generator(gid)
        log.warning("generator %s gone (%s): %d samples to re-dispatch", gid, why, n)

    def poll(self, timeout_s: float) -> int:
        """Receive and handle what arrives within ``timeout_s``; returns records handled."""
        handled = 0
        inc = self.endpoint.recv(timeout_s)
        while inc is not None and handled < 512:
            self.handle(inc.channel, inc.peer, inc.record)
            handled += 1
            inc = self.endpoint.recv(0.0)
        for gid in self.endpoint.expired_peers():
            self.gone(gid, "heartbeat expired")
        timeout = self.work_timeout_s
        if timeout:
            self.dispatcher.overdue(timeout)
            for gid, k in list(self.dispatcher.timeouts.items()):
                if k >= MAX_WORK_TIMEOUTS:  # swallows work
                    self.ban(gid, f"held work past intake.work_timeout_s={timeout:g} s without "
                             f"answering, {k} times in a row")  # fmt: skip
        for gid in list(self.publisher.generators()):
            if self.publisher.gave_up(gid):  # its work may wait for weights it will never load
                self.gone(gid, "refused the current weights too often")
        return handled
