"""Verified rollouts: every trained rollout's claimed behaviour log-probs against the learner's,
within a bound per rollout (docs/PIPELINE.md, "Verified rollouts"). Before the update, where the
trainer refuses a step holding a rollout over its bound (``refuse_step``), and after it
otherwise (``verify``). A lie is quarantined and counted toward its generator's budget; over
budget the generator is banned.

A stale rollout over its bound is judged at the weights that sampled it (``audit``,
pipeline.backends.audit): the trainer's measurement holds the updates since, whose effect has no
bound for every learning rate. Within the numerics' base there it drifted honestly: voided
(reason logp_drift) and dispatched again, never counted toward its generator; beyond it, a lie.
Unverifiable (its weights gone): voided (logp_unverified), not counted. A fresh rollout's
measurement is at the weights that sampled it already: over its bound, a lie."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pipeline.config.run import RunConfig
from pipeline.core.intake import Group, Intake
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import ModelLimits, Refusal, check_logp, logp_base, logp_bound
from proto.records import Rollout

log = logging.getLogger("pipeline.core.coordinator")  # the coordinator's lines, one logger name

Audit = Callable[[Sequence[Rollout]], Sequence[float | None]]
"""Per rollout: max |log-prob at the weights that sampled it - claim|, or None (unverifiable)."""


def behaviour_logp_base(cfg: RunConfig, limits: ModelLimits) -> float:
    """The log-prob check's bound at staleness 0 (validation.logp_base): tight only when both
    sides compute in float32 (generators: float32, or auto on a float32 checkpoint; the
    launcher's auto is bfloat16 under a bf16 learner in fast numerics)."""
    gd = cfg.generators.dtype
    gen32 = gd == "float32" or (gd == "auto" and limits.weights_dtype == "float32"
                                and not (cfg.learner.precision == "bf16"))  # fmt: skip
    return logp_base(cfg.numerics, float32=gen32 and cfg.learner.precision == "fp32")


class LogpVerifier:
    """Each rollout's log-prob bound, and what is done with a rollout over it.

    Loop (per training step): the coordinator asks ``bounds`` before the step (its rollouts'
    staleness against the trainer's weights, and the steps the trainer took since its newest
    version was taken); the trainer measures every rollout against them. A step the trainer
    refused goes to ``refuse_step``; a step that trained goes to ``verify`` with the trainer's
    measurements (a trainer that does not check before its update is checked here).

    Invariant: a rollout's bound is ``validation.logp_bound(base, u)``, u = ``every`` x its
    staleness at the trainer's version + the steps since that version was taken: it grows with
    the optimizer updates between the weights that sampled it and the trainer's, and with
    nothing else. With a trainer that checks before its update (both backends) no rollout over
    its bound is trained (the step holding it is refused whole); every rollout over its bound
    is quarantined and counted toward its own generator's budget."""

    def __init__(
        self,
        *,
        base: float,
        every: int,
        gate: StalenessGate,
        intake: Intake,
        ban: Callable[[str, str], None],
        audit: Audit | None = None,
    ) -> None:
        """``base``: the bound at staleness 0 (``behaviour_logp_base``); ``every``:
        publish.every (optimizer steps per version); ``gate``: measures a rollout's staleness;
        ``intake``: quarantines, counts and takes groups back; ``ban``: drops a generator for
        the run (a no-op for one banned already); ``audit``: a stale rollout's mismatch at the
        weights that sampled it (pipeline.backends.audit.BehaviourAudit; None per unverifiable
        rollout; no audit: the trainer's measurement is the verdict, the drift allowance
        trusted, as before the audit)."""
        self.base, self.every, self.gate, self.intake, self.ban = base, every, gate, intake, ban
        self.audit = audit

    def judge(self, rolls: Sequence[Rollout], mismatch: Sequence[float],
              bounds: Sequence[float]) -> list[Refusal | str]:  # fmt: skip
        """The verdict on each rollout over its bound (``mismatch`` as the trainer measured):
        a Refusal (a lie: counted toward its generator), or "logp_drift" (a stale rollout
        within the base at the weights that sampled it: honest) or "logp_unverified" (a stale
        rollout whose weights are gone: not judged). Fresh rollouts (bound == base: measured
        at the weights that sampled them) are judged on ``mismatch`` alone."""
        out: list[Refusal | str] = []
        stale = [i for i, b in enumerate(bounds) if b > self.base and self.audit is not None]
        audited: dict[int, float | None] = {}
        if stale:
            assert self.audit is not None
            try:
                got = list(self.audit([rolls[i] for i in stale]))
            except Exception:  # noqa: BLE001 - an audit that fails proves nothing: unverifiable
                log.exception("behaviour audit failed: %d stale rollouts unverifiable", len(stale))
                got = [None] * len(stale)
            audited = {i: got[k] for k, i in enumerate(stale)}
        for i, (r, x, b) in enumerate(zip(rolls, mismatch, bounds, strict=True)):
            why = check_logp(float(x), b) or Refusal(
                "logp_mismatch", f"the trainer measured {x:.3g} nats (bound {b:.3g})"
            )
            if i not in audited:
                out.append(why)
                continue
            a = audited[i]
            if a is None:
                log.warning("generator %s: rollout %s v%d, %s; its weights are gone: "
                            "unverifiable, voided and not counted", r.generator_id,
                            r.rollout_id, r.weight_version, why.detail)  # fmt: skip
                out.append("logp_unverified")
            elif check_logp(a, self.base) is None:
                log.info("rollout %s of %s drifted honestly: %s; %.3g nats at the weights that "
                         "sampled it (v%d, base %.3g)", r.rollout_id, r.generator_id,
                         why.detail, a, r.weight_version, self.base)  # fmt: skip
                out.append("logp_drift")
            else:
                out.append(Refusal("logp_mismatch", f"claimed log-probs {a:.3g} nats from the "
                                   f"weights that sampled them (v{r.weight_version}, bound "
                                   f"{self.base:.3g}); {why.detail}"))  # fmt: skip
        return out

    def bounds(self, rolls: Sequence[Rollout], version: int, since: int) -> list[float]:
        """Each rollout's log-prob bound (validation.logp_bound: the numerics' base plus the
        drift of the optimizer steps between the weights that sampled it and the trainer's).
        Those steps are ``publish.every`` a version of staleness at ``version`` (the trainer's
        newest version, written or being written), plus ``since``, the steps taken since that
        version was taken (with publish.every > 1 the trainer is ahead of it)."""
        return [logp_bound(self.base, self.updates(version, r, since)) for r in rolls]

    def updates(self, version: int, r: Rollout, since: int) -> int:
        """The optimizer updates between the weights that sampled ``r`` and the trainer's."""
        return max(self.gate.staleness(version, r), 0) * self.every + max(since, 0)

    def refuse_step(
        self,
        step: int,
        rolls: list[Rollout],
        groups: list[Group],
        bounds: list[float],
        refused: list[int],
        mismatch: list[float],
    ) -> None:
        """Step ``step``, refused before its update (``refused``: indices into ``rolls``,
        ``mismatch`` per rollout as the trainer measured): its liars are quarantined and
        counted toward their generators' budgets (as ``verify``'s), their samples voided and
        dispatched again (to another generator where there is one); the rest of its groups go
        back to the buffer, untrained, and a later step takes them. Over budget: banned (which
        voids the generator's other accepted, untrained rollouts)."""
        bans: dict[str, str] = {}
        out: dict[str, str] = {}  # rollout id -> why it leaves the step
        over = [rolls[i] for i in refused]
        xs = [mismatch[i] if i < len(mismatch) else float("nan") for i in refused]
        for r, why in zip(over, self.judge(over, xs, [bounds[i] for i in refused]), strict=True):
            if isinstance(why, str):  # honest drift, or unverifiable: not counted
                out[r.rollout_id] = why
                self.intake.counts[f"audited_{why}"] += 1
                continue
            out[r.rollout_id] = why.reason
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        liars = sorted({r.generator_id for r in over if out[r.rollout_id] == "logp_mismatch"})
        lies = sum(v == "logp_mismatch" for v in out.values())
        n = self.intake.take_back(groups, out)
        self.intake.counts["steps_refused"] += 1
        log.warning("step %d refused before its update: %d rollouts of %s claim log-probs the "
                    "learner does not compute (quarantined), %d stale ones drifted beyond their "
                    "bound (not counted); %d samples dispatched again, %d groups back in the "
                    "buffer", step, lies, liars, len(out) - lies, n, len(groups))  # fmt: skip
        for gid, reason in bans.items():
            self.ban(gid, reason)

    def verify(self, rolls: list[Rollout], mismatch: list[float], bounds: list[float]) -> None:
        """Verified rollouts after the step, for a trainer that cannot refuse a step before its
        update (the real ones do: ``refuse_step``): each trained rollout's claimed log-probs
        against the learner's, within its bound (``bounds``). A lie is quarantined and counted
        toward its generator's budget (intake.max_refused within intake.window_s); over budget,
        the generator is banned and its accepted, untrained rollouts are voided and their
        samples dispatched again. ``mismatch`` not one per rollout: nothing was measured."""
        if len(mismatch) != len(rolls):
            return
        bans: dict[str, str] = {}
        over = [i for i, (x, b) in enumerate(zip(mismatch, bounds, strict=True))
                if check_logp(float(x), b) is not None]  # fmt: skip
        pick = [rolls[i] for i in over]
        verdicts = self.judge(pick, [mismatch[i] for i in over], [bounds[i] for i in over])
        for r, why in zip(pick, verdicts, strict=True):
            if isinstance(why, str):  # trained already; honest drift or unverifiable
                self.intake.counts[f"audited_{why}"] += 1
                continue
            log.warning("generator %s: rollout %s trained with %s", r.generator_id,
                        r.rollout_id, why)  # fmt: skip
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        for gid, reason in bans.items():
            self.ban(gid, reason)
