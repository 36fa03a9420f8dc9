"""The coordinator (learner rank 0): dispatch, intake, staleness, training, publication.

One thread runs ``Coordinator.run()``, calling the components it owns (built in ``__init__``;
each states its own loop and invariant) in this order (docs/PIPELINE.md, "The coordinator
loop")::

    loop until `steps` training steps are done:
        peers.poll: recv (<= poll_s; the endpoint's heartbeats ride on it), for each record:
            Hello       -> Welcome(run_id, version); dispatcher/publisher learn the generator
            Heartbeat   -> its served version (dispatcher, publisher), a claim checked
            RolloutBatch-> intake: ledger.receive; accepted -> stream (flushed) -> Ack
            WorkReturn  -> re-dispatch those samples;  Goodbye -> generator gone
            Ack/Nack on weights -> publisher
          expired peers (silent > peer_timeout_s) -> generator gone: ledger re-dispatch;
          work held past work_timeout_s -> issued again elsewhere; bans
        announcer.announce_ready()  versions written beside training, announced in order
        dispatcher.pump(v)      new / re-dispatched work within capacity, cap, staleness gate;
                                v = trained_version (announced + being written): work issued
                                against an older announced version while v is written would
                                expire a step early (generated again as stale)
        publisher.pump()        weight transfers within credit windows
            (both again right after a step completes or a version is announced; ``turn``)
        groups = intake.select(v, prompts_per_step); if groups and gate.can_train(v):
            bounds = verifier.bounds(rollouts): each rollout's log-prob bound
            trainer.step(rollouts, flags, bounds) -> StepResult (on the trainer thread)
                refused (a claimed log-prob over its bound, checked before the update): the
                step is refused whole, its liars quarantined and dispatched again elsewhere,
                its other groups back in the buffer (``verifier.refuse_step``)
            step log -> ledger.settle -> metrics; verifier.verify(the step's measurements)
            every publish.every steps: announcer.prepare(N) on the trainer thread (the
            weights taken, hashed and written beside the next step: weights.pending;
            publish.max_pending 0: written before the next step), announcer.hand_over when the
            step completes; announced when ready: v = N
            every checkpoint.every steps: trainer.save(ckpt, pipeline_state)

Invariants: exactly-once (pipeline.core.ledger; nothing acknowledged before it is recorded),
staleness (pipeline.core.staleness: nothing staler than max_staleness is trained except flagged
under policy "keep"), and versions strictly increase, also across a resume (the restored
weights are published as a new version). Checkpoint / resume: pipeline.core.resume.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.backends.results import StepResult
from pipeline.backends.trainer_api import Trainer
from pipeline.config.run import RunConfig
from pipeline.core import faults
from pipeline.core.announcing import WeightAnnouncer, Written
from pipeline.core.coordinator_errors import CoordinatorError
from pipeline.core.dispatch import Dispatcher, PromptSource
from pipeline.core.efficiency import Efficiency
from pipeline.core.eval_rounds import EvalRounds
from pipeline.core.intake import Group, Intake
from pipeline.core.ledger import InFlightLedger
from pipeline.core.peers import Peers
from pipeline.core.quarantine import Quarantine
from pipeline.core.recorder import Recorder, StepRecord
from pipeline.core.staleness import StalenessGate
from pipeline.core.step_row import step_row
from pipeline.core.timeline import StepTimeline
from pipeline.core.validation import ModelLimits, door_rules
from pipeline.core.verification import LogpVerifier, behaviour_logp_base
from proto.records import Rollout, WorkItem
from weights.deliveries import DeliveryLog
from weights.pending import PublicationQueue, Snapshot
from weights.publisher import WeightPublisher
from weights.transports import open_publisher

log = logging.getLogger(__name__)
VOIDED_NAME = "voided.jsonl"
StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class _Job:
    """One training step in flight: its batch and the trainer thread's future
    (the StepResult, train seconds, the version it made or None)."""

    groups: list[Group]
    rolls: list[Rollout]
    flags: list[bool]
    failed: int
    publish: bool
    base: int
    """The version of the weights the step updates (``Coordinator.trained_version``)."""
    version: int
    """The version the step publishes (when ``publish``)."""
    bounds: list[float]
    """Each rollout's log-prob bound (``LogpVerifier.bounds``: its updates behind the trainer)."""
    future: Future[tuple[StepResult, float, Snapshot | Written | None]]


class Coordinator:
    """See the module docstring. ``endpoint`` is a pipeline.net.transport.session.LearnerEndpoint.

    Its components, built in ``__init__`` (the run's state lives in them; the coordinator
    keeps the loop's counters, ``step`` and ``version_step``, and the step in flight)."""

    ledger: InFlightLedger
    """Exactly-once accounting of every sample dispatched (pipeline.core.ledger)."""
    gate: StalenessGate
    """The staleness bound: what may be dispatched and trained at a version."""
    dispatcher: Dispatcher
    """Work items to generators within capacity, cap, fair share and the staleness budget."""
    recorder: Recorder
    """RUN_DIR/stream (every accepted rollout, before its Ack) and steps.jsonl."""
    quarantine: Quarantine
    """Refused rollouts (RUN_DIR/quarantine)."""
    intake: Intake
    """The door, the ledger's receipts, record-before-ack, group assembly and selection."""
    timeline: StepTimeline
    """The time/* keys of each step's metrics row."""
    deliveries: DeliveryLog
    """Versions announced to each generator: the truth its claims are checked against."""
    publisher: WeightPublisher
    """The weight transfers to the generators (publish.transport: weights.transports)."""
    announcer: WeightAnnouncer
    """Versions written and announced in order (digests.jsonl first)."""
    peers: Peers
    """Generators' records in, claims, bans, departures (``poll``)."""
    verifier: LogpVerifier
    """Each rollout's log-prob bound; refused and verified steps."""
    evals: EvalRounds | None
    """Evaluation rounds on the generators (eval.every > 0)."""

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
        efficiency: Efficiency | None = None,
    ) -> None:
        self.cfg, self.endpoint, self.trainer, self.run_dir = cfg, endpoint, trainer, run_dir
        self.on_step, self.clock, self.poll_s = on_step, clock, poll_s
        self.run_id = uuid.uuid4().hex[:12]
        self.step = 0
        self.version_step = 0  # the step whose weights the newest version (trained_version) is
        self.limits = limits
        self.evals = evals
        self.efficiency = efficiency  # the rows' perf/* keys (None: left out)
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
        door = cfg.intake
        self.intake = Intake(
            ledger=self.ledger, gate=self.gate, dispatcher=self.dispatcher,
            record=self.recorder.record, n=r.n, limits=limits,
            rules=door_rules(cfg), quarantine=self.quarantine,
            version=lambda: self.version, max_refused=door.max_refused,
            window_s=door.window_s, clock=clock, void=self.void,
            dynamic_sampling=cfg.objective.dynamic_sampling,
        )  # fmt: skip
        self.timeline = StepTimeline()
        self.deliveries = DeliveryLog()
        self.publisher = open_publisher(cfg.publish.transport, self.deliveries.endpoint(endpoint),
                                        cfg.publish, run_dir)  # fmt: skip
        self._last_progress = clock()
        self._job: _Job | None = None
        self._hurry = False  # a step just completed: the next turn does not wait in poll
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer") if background else None
        self._t0 = time.time()
        self._last_step_t = time.time()
        # the trainer and publishing threads wake the loop's recv when a step or a version is
        # done (when the endpoint offers a waker): completed, announced and new work sent at
        # once, not at the next poll_s
        waker = getattr(endpoint, "waker", None)
        self._wake: Callable[[], None] | None = waker() if background and callable(waker) else None
        mp = cfg.publish.max_pending  # versions hashed and written beside the next steps
        self.announcer = WeightAnnouncer(
            cfg.publish, run_dir, trainer=trainer, publisher=self.publisher,
            pending=PublicationQueue(mp, on_done=self._wake) if mp and background else None,
            timeline=self.timeline,
            set_status=lambda v: self.endpoint.set_status(v, self.dispatcher.inflight()),
        )  # fmt: skip
        self.peers = Peers(
            endpoint, dispatcher=self.dispatcher, publisher=self.publisher, intake=self.intake,
            deliveries=self.deliveries, timeline=self.timeline, evals=evals,
            run_id=lambda: self.run_id, version=lambda: self.version,
            welcome_settings={"numerics": cfg.numerics}, exit_policy=cfg.rollout.parsed_policy,
            work_timeout_s=cfg.work_timeout_s(), clock=clock,
        )  # fmt: skip
        self.verifier = LogpVerifier(
            base=behaviour_logp_base(cfg, limits), every=cfg.publish.every, gate=self.gate,
            intake=self.intake, ban=self.peers.ban, audit=getattr(trainer, "audit", None),
        )  # fmt: skip

    # -- what the components hold --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest version announced to the generators (``announcer``)."""
        return self.announcer.version

    @property
    def last_digest(self) -> str:
        return self.announcer.last_digest

    @property
    def banned(self) -> Mapping[str, str]:
        """Generator id -> why it was dropped for the run (``peers``)."""
        return self.peers.banned

    # -- incoming ----------------------------------------------------------------------------------
    def handle(self, channel: str, peer: str, rec: Any) -> None:
        """One record from a generator, as the endpoint delivers it (``Peers.handle``)."""
        self.peers.handle(channel, peer, rec)

    def poll(self, timeout_s: float) -> int:
        """Receive and handle what arrives within ``timeout_s`` (``Peers.poll``)."""
        return self.peers.poll(timeout_s)

    def void(self, entries: list[dict[str, Any]]) -> None:
        """Recorded rollouts whose samples are generated again (a resume voided them):
        RUN_DIR/voided.jsonl; replay takes the last recorded copy of a rollout id."""
        with (self.run_dir / VOIDED_NAME).open("a", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps({**e, "step": self.step}) + "\n")

    def _send_work(self, gid: str, item: WorkItem) -> bool:
        return bool(self.endpoint.send(gid, item))

    def _expected_version(self, gid: str) -> int:
        """The version ``gid`` will serve once the weights being sent to it are loaded."""
        return self.publisher.target(gid) if gid in self.publisher.generators() else -1

    # -- weights -----------------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish the trainer's current weights as version + 1 (on disk, and sent if set).
        Only while no step runs (resume, tests); steps publish through their job."""
        assert self._job is None, "publish() while a step is running"
        self.announcer.publish(self.step + 1)
        self.version_step = self.step

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
        if not self.gate.can_train(tv) or not self.fleet_ready():
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

    def fleet_ready(self) -> bool:
        """Past this process's first step, or min_generators have registered (config)."""
        return self.step > 0 or len(self.dispatcher.generators()) >= self.cfg.min_generators

    @property
    def trained_version(self) -> int:
        """The version of the trainer's weights: the newest announced plus those still being
        hashed and written (publish.max_pending). Staleness is measured from it, so a bound
        means the same with publication overlapped as without; generators only ever get
        announced versions."""
        return self.version + self.announcer.writing

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
        self.announcer.announce_ready(wait=True)
        return job is not None

    def _start(self, groups: list[Group]) -> _Job:
        """Everything that touches the trainer (step, then the publication's files when one
        is due) as one job: on the trainer thread in background mode, else run here."""
        rolls = [r for g in groups for r in g.rollouts]  # raw rewards: the step shapes them
        failed = sum(r.reward is None for r in rolls)
        flags = [f for g in groups for f in g.needs_correction]
        n = self.step + 1
        publish = n % self.cfg.publish.every == 0
        base = self.trained_version
        v = base + 1  # after those still pending
        # before the step: the steps taken so far since the newest version was taken
        bounds = self.verifier.bounds(rolls, base, self.step - self.version_step)
        trainer, announcer = self.trainer, self.announcer

        def work() -> tuple[StepResult, float, Snapshot | Written | None]:
            t0 = time.time()
            res = trainer.step(rolls, flags, bounds)
            train_s = time.time() - t0
            if res.refused:  # nothing applied: no step, nothing to publish
                return res, train_s, None
            faults.kill_at("step", n)  # the crash tests' kill -9 mid-step
            return res, train_s, announcer.prepare(v, n) if publish else None

        if self._pool is None:
            fut: Future[tuple[StepResult, float, Snapshot | Written | None]] = Future()
            try:
                fut.set_result(work())
            except BaseException as e:  # raised again by _complete, on this thread
                fut.set_exception(e)
        else:
            fut = self._pool.submit(work)
            if self._wake is not None:
                wake = self._wake
                fut.add_done_callback(lambda _f: wake())
        return _Job(groups, rolls, flags, failed, publish, base, v, bounds, fut)

    def _complete(self, job: _Job) -> bool:
        """The step's bookkeeping on the coordinator thread; False if the trainer refused it
        (verified rollouts: ``LogpVerifier.refuse_step``)."""
        res, train_s, made = job.future.result()
        if res.refused:
            self.verifier.refuse_step(self.step + 1, job.rolls, job.groups, job.bounds,
                                      res.refused, res.mismatch)  # fmt: skip
            self.timeline.step_done()
            return False
        groups, rolls, flags = job.groups, job.rolls, job.flags
        self.step += 1
        if job.publish:
            self.version_step = self.step
        self.recorder.log_step(
            StepRecord(self.step, job.base, [r.rollout_id for r in rolls], flags,
                       job.version if job.publish else None)
        )  # fmt: skip
        self.intake.settle(groups)
        now = time.time()
        m = step_row(
            self.step, job.base, groups, rolls, flags, res.metrics, res.mismatch,
            fresh=[self.gate.oldest(r) == job.base for r in rolls],
            counts={**self.intake.counts, "released": self.ledger.counts["released"]},
            failed=job.failed, train_s=train_s, step_s=now - self._last_step_t,
            elapsed_s=now - self._t0, generators=len(self.dispatcher.generators()),
        )  # fmt: skip
        self.verifier.verify(rolls, res.mismatch, job.bounds)
        self._last_step_t = now
        stages, announce_s = self.announcer.hand_over(made)
        m.update(self.timeline.row(rolls, train_s=train_s, publish=stages, announce_s=announce_s))
        if self.efficiency is not None:
            m.update(self.efficiency.row(
                rolls, train_s=train_s, step_s=m["step_s"],
                delivery_s=m.get("time/weight_delivery"),
                version_bytes=self.announcer.announced_bytes,
            ))  # fmt: skip
        self.timeline.step_done()
        if self.on_step is not None:
            self.on_step(m)
        if self.evals is not None and self.evals.due(self.step):
            self.evals.start(self.step, self.version)
        return True

    # -- the loop ------------------------------------------------------------------------------------
    def turn(self, timeout_s: float | None = None) -> bool:
        """One loop turn; True if a training step happened.

        What another thread finished is acted on in the same turn, not after the next wait in
        ``poll``: a version whose hash and write ended while the loop waited (the publishing
        thread woke it) is announced and sent at once; a completed step's settled groups free
        room for new work, which is sent at once, and the next turn does not wait in ``poll``
        before it starts the next step (rollouts for it may be buffered already)."""
        self.announcer.announce_ready()
        wait = self.poll_s if timeout_s is None else timeout_s
        self.peers.poll(0.0 if self._hurry else wait)
        self._hurry = False
        self.announcer.announce_ready()  # what the publishing thread finished while poll waited
        self._pump()
        trained = self.try_train()
        if trained:
            self._last_progress = self.clock()
            self.announcer.announce_ready()  # versions whose write ended during the step
            self._pump()
            self._hurry = True
        return trained

    def serve(self, timeout_s: float) -> None:
        """A turn that trains nothing (after the last step: the last eval round is served)."""
        self.announcer.announce_ready()
        self.peers.poll(timeout_s)
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
                short = "" if self.fleet_ready() else (
                    f" (min_generators={self.cfg.min_generators}: the first step waits for "
                    f"them)")  # fmt: skip
                raise CoordinatorError(
                    f"no training step for {self.cfg.max_wait_s:.0f}s (max_wait_s): "
                    f"generators {self.dispatcher.generators()}{short}, open work "
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
        self.announcer.close()
        self.publisher.close()
        self.recorder.close()
        self.quarantine.close()
