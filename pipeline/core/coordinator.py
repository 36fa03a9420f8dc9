"""The coordinator (learner rank 0): dispatch, intake, staleness, training, publication.

One thread runs ``Coordinator.run()``::

    loop until `steps` training steps are done:
        recv (<= poll_s; the endpoint's heartbeats ride on it), for each record:
            Hello       -> Welcome(run_id, version); dispatcher/publisher learn the generator
            Heartbeat   -> its served version (dispatcher, publisher)
            RolloutBatch-> intake: ledger.receive; accepted -> stream (flushed) -> Ack
            WorkReturn  -> re-dispatch those samples;  Goodbye -> generator gone
            Ack/Nack on weights -> publisher
        expired peers (silent > peer_timeout_s) -> generator gone: ledger re-dispatch
        dispatcher.pump(v)      new / re-dispatched work within capacity, cap, staleness gate;
                                v = trained_version (announced + being written): work issued
                                against an older announced version while v is written would
                                expire a step early (generated again as stale)
        publisher.pump()        weight transfers within credit windows
            (both again right after a step completes or a version is announced; ``turn``)
        groups = intake.select(v, prompts_per_step); if groups and gate.can_train(v):
            trainer.step -> step log -> ledger.settle -> metrics
                (the trainer checks every claimed log-prob before its update: a step holding
                a lie is refused whole, its liars quarantined and dispatched again elsewhere,
                its other groups back in the buffer: ``_refuse_step``)
            every publish.every steps: trainer.snapshot(RUN_DIR/weights/vN) on the trainer
            thread; hashed and written beside the next step (pipeline.core.publishing); announced
            when ready: v = N (publish.max_pending 0: written and announced before the next step)
            every checkpoint.every steps: trainer.save(ckpt, pipeline_state)

Invariants: exactly-once (pipeline.core.ledger; nothing acknowledged before it is recorded),
staleness (pipeline.core.staleness: nothing staler than max_staleness is trained except flagged
under policy "keep"), and versions strictly increase, also across a resume (the restored
weights are published as a new version). Checkpoint / resume: pipeline.core.resume.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import NonFiniteWeightsError
from models.exits import policy_json
from models.weights.collective_learner import make_publisher
from models.weights.publication import Publication, prune_weights, weights_dir
from models.weights.shm import prune_shm, publish_shm
from pipeline.backends.trainer_api import Trainer
from pipeline.config import RunConfig
from pipeline.core import faults
from pipeline.core.dispatch import Dispatcher, PromptSource
from pipeline.core.eval_rounds import EvalRounds, is_eval_work
from pipeline.core.intake import Group, Intake
from pipeline.core.ledger import InFlightLedger
from pipeline.core.publishing import PublicationQueue, Snapshot
from pipeline.core.quarantine import Quarantine
from pipeline.core.recorder import Recorder, StepRecord
from pipeline.core.staleness import StalenessGate
from pipeline.core.step_row import step_row
from pipeline.core.timeline import StepTimeline
from pipeline.core.validation import (
    ModelLimits,
    Refusal,
    check_logp,
    door_rules,
    logp_base,
    logp_bound,
)
from pipeline.net.log_limit import Throttle
from pipeline.net.weight_sync import DeliveryLog
from proto import (
    Ack,
    ErrorMsg,
    Goodbye,
    Heartbeat,
    Hello,
    Nack,
    Rollout,
    RolloutBatch,
    Welcome,
    WorkItem,
    WorkReturn,
)

log = logging.getLogger(__name__)
VOIDED_NAME = "voided.jsonl"
HELLO_INTERVAL_S = 1.0  # a generator id's Hellos are answered once per interval
MAX_WORK_TIMEOUTS = 3  # a generator whose work is taken back this often is banned
StepCallback = Callable[[dict[str, Any]], None]


class CoordinatorError(RuntimeError):
    """The run cannot go on (no progress for max_wait_s, non-finite weights)."""


class NonFinitePublication(CoordinatorError):
    """The trainer's weights hold NaN or inf: they were not published."""


@dataclass
class _Refused:
    """A step the trainer refused before its update (verified rollouts): the liars (indices
    into the job's rollouts) and every rollout's measured mismatch."""

    liars: list[int]
    mismatch: list[float]


@dataclass
class _Job:
    """One training step in flight: its batch and the trainer thread's future
    (metrics, train seconds, the Publication written after it or None)."""

    groups: list[Group]
    rolls: list[Rollout]
    flags: list[bool]
    failed: int
    publish: bool
    base: int
    """The version of the weights the step updates (``Coordinator.trained_version``)."""
    version: int
    """The version the step publishes (when ``publish``)."""
    future: Future[Any]


class Coordinator:
    """See the module docstring. ``endpoint`` is a pipeline.net.transport.LearnerEndpoint."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        endpoint: Any,
        trainer: Trainer,
        prompts: PromptSource,
        run_dir: Path,
        limits: ModelLimits,
        on_step: StepCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.02,
        background: bool = False,
        evals: EvalRounds | None = None,
    ) -> None:
        self.cfg, self.endpoint, self.trainer, self.run_dir = cfg, endpoint, trainer, run_dir
        self.on_step, self.clock, self.poll_s = on_step, clock, poll_s
        self.run_id = uuid.uuid4().hex[:12]
        self.step = 0
        self.version = 0
        self.ledger = InFlightLedger()
        st = cfg.staleness
        self.gate = StalenessGate(st.max_staleness, st.policy)  # type: ignore[arg-type]
        r = cfg.rollout
        self.dispatcher = Dispatcher(
            n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
            stop_token_ids=list(r.stop_token_ids), stop=list(r.stop),
            cap=r.prompts_per_step * (st.max_staleness + 1),
            per_step=r.prompts_per_step,
            run_seed=cfg.seed, prompts=prompts, ledger=self.ledger, gate=self.gate, evals=evals,
            share_ratio=cfg.intake.share_ratio,
        )  # fmt: skip
        self.recorder = Recorder(run_dir, enabled=cfg.record.enabled, fsync=cfg.record.fsync)  # type: ignore[arg-type]
        self.quarantine = Quarantine(run_dir)
        self.limits = limits
        door = cfg.intake
        self.intake = Intake(
            ledger=self.ledger, gate=self.gate, dispatcher=self.dispatcher,
            record=self.recorder.record, n=r.n, limits=limits,
            rules=door_rules(cfg), quarantine=self.quarantine,
            version=lambda: self.version, max_refused=door.max_refused,
            window_s=door.window_s, clock=clock, void=self.void,
            dynamic_sampling=cfg.objective.dynamic_sampling,
        )  # fmt: skip
        self.banned: dict[str, str] = {}  # generator id -> why it was dropped for the run
        self._throttle = Throttle(HELLO_INTERVAL_S, clock)  # Hellos and claim warnings, per id
        # the behaviour log-prob check's bound at staleness 0 (validation.logp_base): tight only
        # when both sides compute in float32 (generators: float32, or auto on a float32
        # checkpoint; the launcher's auto is bfloat16 under a bf16 learner in fast numerics)
        gd = cfg.generators.dtype
        gen32 = gd == "float32" or (gd == "auto" and limits.weights_dtype == "float32"
                                    and not (cfg.learner.precision == "bf16"))  # fmt: skip
        self._logp_base = logp_base(cfg.numerics,
                                    float32=gen32 and cfg.learner.precision == "fp32")  # fmt: skip
        self.evals = evals  # evaluation rounds on the generators (eval.every > 0)
        self.deliveries = DeliveryLog()  # versions announced to each generator: claims' truth
        self.publisher = make_publisher(cfg.publish.transport, self.deliveries.endpoint(endpoint),
                                        cfg.publish)  # fmt: skip
        self.last_digest = ""
        self._last_progress = clock()
        self._job: _Job | None = None
        self._hurry = False  # a step just completed: the next turn does not wait in poll
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer") if background else None
        self._t0 = time.time()
        self._last_step_t = time.time()
        self.timeline = StepTimeline()  # the time/* keys of each step's metrics
        self._publish_times: dict[str, float] = {}  # the last publication's stages (s)
        # the trainer and publishing threads wake the loop's recv when a step or a version is
        # done (when the endpoint offers a waker): completed, announced and new work sent at
        # once, not at the next poll_s
        waker = getattr(endpoint, "waker", None)
        self._wake: Callable[[], None] | None = waker() if background and callable(waker) else None
        mp = cfg.publish.max_pending  # versions hashed and written beside the next steps
        self.publications = PublicationQueue(mp, on_done=self._wake) if mp and background else None
        self._announced_stages: dict[str, float] = {}  # since the last metrics row

    # -- incoming --------------------------------------------------------------------------------
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
            if v < 0:
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
            self._gone(peer, f"goodbye: {rec.reason}")
        elif isinstance(rec, Ack | Nack):
            pass  # the generator acknowledges nothing we act on yet

    def _claimed(self, peer: str, v: int, what: str) -> int:
        """A generator's claimed serving version, checked against what was delivered to it
        (pipeline.net.weight_sync: the starting checkpoint v0, or a version whose announcement
        this learner sent to ``peer``; a version above the newest was never even published).
        A false claim is refused (counted ``claims_refused``, logged at most once per
        ``HELLO_INTERVAL_S`` per generator) and -1 returned: the generator is treated as
        serving nothing and gets the current weights before any work. -1 (serves nothing
        yet) is no claim."""
        if v >= 0 and peer in self.publisher.generators():
            t = self.publisher.target(peer)  # being sent (or acknowledged, checked here first)
            if t >= 0:
                self.deliveries.record(peer, t)
        if v < 0 or self.deliveries.delivered(peer, v):
            return v
        self.intake.counts["claims_refused"] += 1
        if self._throttle.allow(f"claim:{peer}"):
            why = (f"the newest version published is v{self.version}" if v > self.version
                   else f"v{v} was never delivered to it (delivered: "
                   f"{self.deliveries.versions(peer)[-4:]})")  # fmt: skip
            log.warning("generator %s claims to serve v%d in its %s, but %s: refused", peer, v,
                        what, why)  # fmt: skip
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
        ep.send(peer, Welcome(self.run_id, peer, self.version,
                              ep.config.heartbeat_interval_s, self._welcome_settings()))  # fmt: skip

    def _welcome_settings(self) -> dict[str, Any]:
        """Run-wide generator settings a generator checks on Welcome: numerics and the exit
        policy (canonical JSON, '' = full depth; its kv and max depth bound replay)."""

        return {
            "numerics": self.cfg.numerics,
            "exit_policy": policy_json(self.cfg.rollout.policy()),
        }

    def void(self, entries: list[dict[str, Any]]) -> None:
        """Recorded rollouts whose samples are generated again (a resume voided them):
        RUN_DIR/voided.jsonl; replay takes the last recorded copy of a rollout id."""
        with (self.run_dir / VOIDED_NAME).open("a", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps({**e, "step": self.step}) + "\n")

    def ban(self, gid: str, why: str) -> None:
        """Drop ``gid`` for the rest of the run: its work is re-dispatched, whatever it sends
        is ignored, and it is told so (ErrorMsg "banned"; a looprl generator exits)."""
        self.banned[gid] = why
        self.endpoint.send(gid, ErrorMsg("banned", f"dropped for this run: {why}"))
        n = self.dispatcher.remove_generator(gid)
        self.publisher.remove_generator(gid)
        void = self.intake.void_generator(gid)  # its accepted, untrained rollouts: not trusted
        log.error("generator %s dropped for the run: %s; %d samples re-dispatched, %d accepted "
                  "but untrained voided and dispatched again", gid, why, n, void)  # fmt: skip

    def _gone(self, gid: str, why: str) -> None:
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
            self._gone(gid, "heartbeat expired")
        if self.cfg.intake.work_timeout_s:
            self.dispatcher.overdue(self.cfg.intake.work_timeout_s)
            for gid, k in list(self.dispatcher.timeouts.items()):
                if k >= MAX_WORK_TIMEOUTS and gid not in self.banned:  # swallows work
                    self.ban(gid, f"held work past intake.work_timeout_s="
                             f"{self.cfg.intake.work_timeout_s:g} s without answering {k} times")  # fmt: skip
        for gid in list(self.publisher.generators()):
            if self.publisher.gave_up(gid):  # its work may wait for weights it will never load
                self._gone(gid, "refused the current weights too often")
        return handled

    def _expected_version(self, gid: str) -> int:
        """The version ``gid`` will serve once the weights being sent to it are loaded."""
        return self.publisher.target(gid) if gid in self.publisher.generators() else -1

    def _send_work(self, gid: str, item: WorkItem) -> bool:
        return bool(self.endpoint.send(gid, item))

    # -- training ----------------------------------------------------------------------------------
    def try_train(self) -> bool:
        """True when a training step completed in this call. Synchronous mode: one step now,
        if k complete, trainable groups are buffered and the gate allows. Background mode: a
        step that finished on the trainer thread is completed here (logged, settled,
        published), else a new one is started; the caller keeps listening meanwhile."""
        if self._job is not None:
            if not self._job.future.done():
                return False
            job, self._job = self._job, None
            return self._complete(job)
        k, tv = self.cfg.rollout.prompts_per_step, self.trained_version
        if not self.gate.can_train(tv):
            return False
        groups = self.intake.select(tv, k)
        if groups is None:
            return False
        self.timeline.step_started()
        job = self._start(groups)
        if self._pool is None:
            return self._complete(job)
        self._job = job
        return False

    @property
    def trained_version(self) -> int:
        """The version of the trainer's weights: the newest announced plus those still being
        hashed and written (publish.max_pending). Staleness is measured from it, so a bound
        means the same with publication overlapped as without; generators only ever get
        announced versions."""
        return self.version + (len(self.publications) if self.publications is not None else 0)

    @property
    def training(self) -> bool:
        """A step is running on the trainer thread."""
        return self._job is not None

    def drain(self) -> bool:
        """Wait for the step in flight (if any) and complete it, then announce every version
        still being written; True if there was a step."""
        job, self._job = self._job, None
        if job is not None:
            job.future.result()  # (errors are raised by _complete)
            self._complete(job)
        self.announce_ready(wait=True)
        return job is not None

    def _start(self, groups: list[Group]) -> _Job:
        """Everything that touches the trainer (step, then the publication's files when one
        is due) as one job: on the trainer thread in background mode, else run here."""
        rolls = [r for g in groups for r in g.rollouts]  # raw rewards: the step shapes them
        failed = sum(r.reward is None for r in rolls)
        flags = [f for g in groups for f in g.needs_correction]
        publish = (self.step + 1) % self.cfg.publish.every == 0
        queue = self.publications
        base = self.trained_version
        v = base + 1  # after those still pending
        snap = getattr(self.trainer, "snapshot", None) if queue is not None else None
        bounds = self._bounds(rolls, base)

        def work() -> tuple[dict[str, Any], float, Any]:
            t0 = time.time()
            tm, refused = self._train(rolls, flags, bounds)
            train_s = time.time() - t0
            if refused is not None:  # nothing applied: no step, nothing to publish
                return tm, train_s, refused
            faults.kill_at("step", self.step + 1)  # the crash tests' kill -9 mid-step
            if not publish:
                return tm, train_s, None
            if queue is None or snap is None:  # written now, announced when the step completes
                return tm, train_s, self._write_publication(v)
            room = queue.make_room()
            t1 = time.perf_counter()
            finish = self._with_shm(self._guarded(v, lambda out: snap(out, v)))
            stages = {**(getattr(self.trainer, "last_publish_times", None) or {}),
                      "snapshot": time.perf_counter() - t1, "room_wait": room}  # fmt: skip
            return tm, train_s, Snapshot(v, finish, stages)

        if self._pool is None:
            fut: Future[Any] = Future()
            try:
                fut.set_result(work())
            except BaseException as e:  # raised again by _complete, on this thread
                fut.set_exception(e)
        else:
            fut = self._pool.submit(work)
            if self._wake is not None:
                wake = self._wake
                fut.add_done_callback(lambda _f: wake())
        return _Job(groups, rolls, flags, failed, publish, base, v, fut)

    def _complete(self, job: _Job) -> bool:
        """The step's bookkeeping on the coordinator thread; False if the trainer refused it
        (verified rollouts: ``_refuse_step``)."""
        tm, train_s, pub = job.future.result()
        if isinstance(pub, _Refused):
            self._refuse_step(job, pub)
            self.timeline.step_done()
            return False
        groups, rolls, flags = job.groups, job.rolls, job.flags
        self.step += 1
        self.recorder.log_step(
            StepRecord(self.step, job.base, [r.rollout_id for r in rolls], flags,
                       job.version if job.publish else None)
        )  # fmt: skip
        self.intake.settle(groups)
        now = time.time()
        per = getattr(self.trainer, "last_mismatch", None) or []
        m = step_row(
            self.step, job.base, groups, rolls, flags, tm, per,
            fresh=[self.gate.oldest(r) == job.base for r in rolls],
            counts={**self.intake.counts, "released": self.ledger.counts["released"]},
            failed=job.failed, train_s=train_s, step_s=now - self._last_step_t,
            elapsed_s=now - self._t0, generators=len(self.dispatcher.generators()),
        )  # fmt: skip
        if len(per) == len(rolls):
            self._verify(rolls, per, job.base)
        self._last_step_t = now
        announce_s, stages = None, None
        if isinstance(pub, Snapshot):  # hashed and written beside the next step
            assert self.publications is not None
            stages = dict(pub.stages)  # before the publishing thread adds its own
            self.publications.submit(pub)
        elif pub is not None:
            t_ann = time.perf_counter()
            self._announce(pub)
            announce_s = time.perf_counter() - t_ann
            self.timeline.announced(pub.version)
            stages = self._publish_times
        self.announce_ready()
        if self._announced_stages:  # versions of earlier steps announced since the last row
            stages = {**(stages or {}), **self._announced_stages}
            announce_s = self._announced_stages.pop("announce")
            self._announced_stages = {}
        m.update(self.timeline.row(rolls, train_s=train_s, publish=stages, announce_s=announce_s))
        self.timeline.step_done()
        if self.on_step is not None:
            self.on_step(m)
        if self.evals is not None and self.evals.due(self.step):
            self.evals.start(self.step, self.version)
        return True

    # -- verified rollouts -------------------------------------------------------------------
    def _bounds(self, rolls: list[Rollout], base: int) -> list[float] | None:
        """Each rollout's log-prob bound (validation.logp_bound: the numerics' base and its
        staleness at ``base``) for a trainer that checks before its update, else None."""
        if not getattr(self.trainer, "checks_logp_before_update", False):
            return None
        return [logp_bound(self._logp_base, self.gate.staleness(base, r)) for r in rolls]

    def _train(
        self, rolls: list[Rollout], flags: list[bool], bounds: list[float] | None
    ) -> tuple[dict[str, Any], _Refused | None]:
        """The trainer's step (on the trainer thread); with ``bounds`` the trainer compares
        every rollout's claimed log-probs with its own before the update and refuses the step
        when one is over its bound: (metrics, the liars) then, nothing applied."""
        if bounds is None:
            return dict(self.trainer.step(rolls, flags)), None
        tm = dict(self.trainer.step(rolls, flags, bounds))
        liars = list(getattr(self.trainer, "last_refused", None) or [])
        if not liars:
            return tm, None
        return tm, _Refused(liars, list(getattr(self.trainer, "last_mismatch", None) or []))

    def _refuse_step(self, job: _Job, ref: _Refused) -> None:
        """A step refused before its update: its liars are quarantined and counted toward
        their generators' budgets (as ``_verify``'s), their samples voided and dispatched again
        (to another generator where there is one); the rest of its groups go back to the
        buffer, untrained, and a later step takes them. Over budget: banned (which voids the
        generator's other accepted, untrained rollouts)."""
        bans: dict[str, str] = {}
        liars: set[str] = set()
        for i in ref.liars:
            r = job.rolls[i]
            x = ref.mismatch[i] if i < len(ref.mismatch) else float("nan")
            st = self.gate.staleness(job.base, r)
            why = check_logp(float(x), base=self._logp_base, staleness=st) or Refusal(
                "logp_mismatch", f"the trainer measured {x:.3g} nats (bound "
                f"{logp_bound(self._logp_base, st):.3g} at staleness {st})")  # fmt: skip
            liars.add(r.rollout_id)
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        who = sorted({job.rolls[i].generator_id for i in ref.liars})
        n = self.intake.take_back(job.groups, liars)
        self.intake.counts["steps_refused"] += 1
        log.warning("step %d refused before its update: %d rollouts of %s claim log-probs the "
                    "learner does not compute (quarantined; %d samples dispatched again, %d "
                    "groups back in the buffer)", self.step + 1, len(liars), who, n,
                    len(job.groups))  # fmt: skip
        for gid, reason in bans.items():
            if gid not in self.banned:
                self.ban(gid, reason)

    def _verify(self, rolls: list[Rollout], per: list[float], base: int) -> None:
        """Verified rollouts after the step, for a trainer that cannot refuse a step before its
        update (the real ones do: ``_train``): each trained rollout's claimed log-probs against
        the learner's (pipeline.core.validation.check_logp, the bound of the run's numerics and
        the rollout's staleness). A lie is quarantined and counted toward its generator's budget
        (intake.max_refused within intake.window_s); over budget, the generator is banned and
        its accepted, untrained rollouts are voided and their samples dispatched again."""
        bans: dict[str, str] = {}
        for x, r in zip(per, rolls, strict=True):
            why = check_logp(float(x), base=self._logp_base,
                             staleness=self.gate.staleness(base, r))  # fmt: skip
            if why is None:
                continue
            log.warning("generator %s: rollout %s trained with %s", r.generator_id,
                        r.rollout_id, why)  # fmt: skip
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        for gid, reason in bans.items():
            if gid not in self.banned:
                self.ban(gid, reason)

    # -- weights -------------------------------------------------------------------------------------
    def announce_ready(self, *, wait: bool = False) -> int:
        """Announce the versions whose hash and write are done, in order (``wait``: every
        pending one, waited for); the number announced."""
        q = self.publications
        if q is None or not len(q):
            return 0
        done = q.wait_all() if wait else q.ready()
        for pub, stages in done:
            t = time.perf_counter()
            self._announce(pub)
            ann = time.perf_counter() - t
            self.timeline.announced(pub.version)
            log.debug("v%d published: snapshot %.3f s, hash + write %.3f s beside training, "
                      "waited %.3f s for room, announced %.3f s after", pub.version,
                      stages.get("snapshot", 0.0), stages.get("total", 0.0),
                      stages.get("room_wait", 0.0), stages.get("lag", 0.0))  # fmt: skip
            acc = self._announced_stages
            for key in ("total", "blob", "digest", "write"):  # the finish's, summed
                if key in stages:
                    acc[key] = acc.get(key, 0.0) + stages[key]
            acc["lag"] = max(acc.get("lag", 0.0), stages.get("lag", 0.0))
            acc["announce"] = acc.get("announce", 0.0) + ann
        return len(done)

    def publish(self) -> None:
        """Publish the trainer's current weights as version + 1 (on disk, and sent if set).
        Only while no step runs (resume, tests); steps publish through their job."""
        assert self._job is None, "publish() while a step is running"
        self.announce_ready(wait=True)
        self._announce(self._write_publication(self.version + 1))

    def announce_again(self, pub: Publication) -> None:
        """Resume at the newest announced version ``pub`` (read back from its directory, its
        digest the one digests.jsonl recorded): the publisher offers it to every generator
        that does not serve it, e.g. one started after the learner stopped."""
        self.announce_ready(wait=True)
        assert self._job is None and pub.version == self.version, "announce_again: not current"
        self._announce(pub, again=True)

    def _write_publication(self, v: int) -> Publication:
        """The trainer writes RUN_DIR/weights/v<v>; read back (digest, finiteness)."""
        t0 = time.perf_counter()
        pub = self._guarded(v, lambda out: self.trainer.publish(out, v))
        if pub is None:
            raise CoordinatorError(f"the trainer returned no publication for v{v}")
        stages = getattr(self.trainer, "last_publish_times", None) or {}  # optional
        self._with_shm(lambda: pub)()
        self._publish_times = {**stages, **pub.stage_s, "total": time.perf_counter() - t0}
        return pub

    def _with_shm(self, finish: Callable[[], Publication]) -> Callable[[], Publication]:
        """``finish`` then, with publish.transport shm, the same bytes once more into /dev/shm
        (models.weights.shm; its seconds in ``pub.stage_s["shm_write"]``)."""
        if self.cfg.publish.transport != "shm":
            return finish

        def run() -> Publication:
            pub = finish()
            t0 = time.perf_counter()
            publish_shm(pub)
            pub.stage_s["shm_write"] = time.perf_counter() - t0
            return pub

        return run

    def _guarded(self, v: int, take: Callable[[Path], Any]) -> Any:
        """``take(RUN_DIR/weights/v<v>)``; non-finite weights end the run, nothing written."""
        out = weights_dir(self.run_dir, v)
        try:
            return take(out)
        except NonFiniteWeightsError as e:  # never announced; nothing non-finite is served
            shutil.rmtree(out, ignore_errors=True)
            raise NonFinitePublication(
                f"step {self.step + 1}: the trainer's weights are not finite ({e}); version "
                f"v{v} was not published (generators keep v{v - 1}); resume from the last "
                "checkpoint with a lower optimizer.lr or a tighter optimizer.grad_clip"
            ) from e

    def _announce(self, pub: Publication, *, again: bool = False) -> None:
        """Announce the trainer's Publication as it is (its digest is not computed again).
        ``again``: a version announced before this learner started (a resume at the newest
        version: generators that join now need it), not recorded a second time."""
        v = pub.version
        if pub.path is None:
            raise CoordinatorError(f"publication v{v} has no directory")
        if not again:
            # Write-ahead: a version is in digests.jsonl before any generator can hear of it, so
            # a resume never reuses the number of weights that were announced (core.resume).
            with (self.run_dir / "weights" / "digests.jsonl").open("a") as f:
                f.write(json.dumps(pub.record()) + "\n")  # with its digest kind
            faults.kill_at("announce", v)  # the crash tests' kill -9: written, never announced
        self.publisher.publish(
            v, pub.blob, tensors=pub.tensor_metas(), config_json=pub.config_json,
            path=str(Path(pub.path).resolve()), digest=pub.digests,
            chunked=self.cfg.publish.transport not in ("shared_fs", "shm"),  # collective: blob too
        )  # fmt: skip
        self.version, self.last_digest = v, pub.digest
        self.endpoint.set_status(v, self.dispatcher.inflight())
        # every directory older than the newest publish.keep (0: all kept), a killed run's too
        prune_weights(self.run_dir, v, self.cfg.publish.keep)
        if self.cfg.publish.transport == "shm":  # bounded like the directories
            prune_shm(self.run_dir / "weights", v, self.cfg.publish.keep)

    # -- the loop ------------------------------------------------------------------------------------
    def turn(self, timeout_s: float | None = None) -> bool:
        """One loop turn; True if a training step happened.

        What another thread finished is acted on in the same turn, not after the next wait in
        ``poll``: a version whose hash and write ended while the loop waited (the publishing
        thread woke it) is announced and sent at once; a completed step's settled groups free
        room for new work, which is sent at once, and the next turn does not wait in ``poll``
        before it starts the next step (rollouts for it may be buffered already)."""
        self.announce_ready()
        wait = self.poll_s if timeout_s is None else timeout_s
        self.poll(0.0 if self._hurry else wait)
        self._hurry = False
        self.announce_ready()  # what the publishing thread finished while poll waited
        self._pump()
        trained = self.try_train()
        if trained:
            self._last_progress = self.clock()
            self.announce_ready()  # versions whose write ended during the step
            self._pump()
            self._hurry = True
        return trained

    def serve(self, timeout_s: float) -> None:
        """A turn that trains nothing (after the last step: the last eval round is served)."""
        self.announce_ready()
        self.poll(timeout_s)
        self._pump()

    def _pump(self) -> None:
        """Send the work and the weight transfers that capacity, the gate and credits allow."""
        self.dispatcher.pump(self.trained_version, self._send_work, self._expected_version)
        self.publisher.pump()
        self.endpoint.set_status(self.version, self.dispatcher.inflight())

    def run(
        self,
        steps: int,
        *,
        checkpoint: Callable[[], object] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Run until ``steps`` training steps are done (or ``stop()`` says so)."""
        every = self.cfg.checkpoint.every
        self._last_progress = self.clock()
        while self.step < steps and not (stop is not None and stop()):
            if self.turn():
                if checkpoint is not None and every and self.step % every == 0:
                    checkpoint()  # the trainer is idle: the next step starts next turn
            elif self.training:
                self._last_progress = self.clock()
            elif self.clock() - self._last_progress > self.cfg.max_wait_s:
                raise CoordinatorError(
                    f"no training step for {self.cfg.max_wait_s:.0f}s (max_wait_s): "
                    f"generators {self.dispatcher.generators()}, open work "
                    f"{len(self.dispatcher.open)}, complete groups {len(self.intake.complete)}"
                )
        self.drain()  # a step started before a stop() is completed (logged, published)
        deadline = self.clock() + self.cfg.max_wait_s
        while self.evals is not None and self.evals.pending() and self.clock() < deadline:
            if stop is not None and stop():
                break
            self.serve(self.poll_s)  # the last eval round: served, not trained

    def counts(self) -> Mapping[str, Any]:
        return {
            "ledger": dict(self.ledger.counts),
            "gate": dict(self.gate.counts),
            "intake": dict(self.intake.counts),
            "refused_by_generator": {
                g: dict(c) for g, c in self.intake.refusals.by_generator.items()
            },
            "banned": dict(self.banned),
            "publisher": dict(self.publisher.counts),
            "transport": vars(self.endpoint.stats),
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.publications is not None:
            self.publications.close()
        self.publisher.close()
        if self.cfg.publish.transport == "shm":  # a generator still mapping one keeps its pages
            prune_shm(self.run_dir / "weights", 1 << 62, 0)  # every file of this run
        self.recorder.close()
        self.quarantine.close()
