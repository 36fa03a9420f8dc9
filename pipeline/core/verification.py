"""Verified rollouts: every trained rollout's claimed behaviour log-probs against the learner's,
within a bound per rollout (docs/PIPELINE.md, "Verified rollouts"). Before the update, where the
trainer refuses a step holding a rollout over its bound (``refuse_step``), and after it
otherwise (``verify``). A lie is quarantined and counted toward its generator's budget; over
budget the generator is banned."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pipeline.config.run import RunConfig
from pipeline.core.intake import Group, Intake
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import ModelLimits, Refusal, check_logp, logp_base, logp_bound
from proto.records import Rollout

log = logging.getLogger("pipeline.core.coordinator")  # the coordinator's lines, one logger name


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
    ) -> None:
        """``base``: the bound at staleness 0 (``behaviour_logp_base``); ``every``:
        publish.every (optimizer steps per version); ``gate``: measures a rollout's staleness;
        ``intake``: quarantines, counts and takes groups back; ``ban``: drops a generator for
        the run (a no-op for one banned already)."""
        self.base, self.every, self.gate, self.intake, self.ban = base, every, gate, intake, ban

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
        liars: set[str] = set()
        for i in refused:
            r = rolls[i]
            x = mismatch[i] if i < len(mismatch) else float("nan")
            why = check_logp(float(x), bounds[i]) or Refusal(
                "logp_mismatch", f"the trainer measured {x:.3g} nats (bound {bounds[i]:.3g})"
            )
            liars.add(r.rollout_id)
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        who = sorted({rolls[i].generator_id for i in refused})
        n = self.intake.take_back(groups, liars)
        self.intake.counts["steps_refused"] += 1
        log.warning("step %d refused before its update: %d rollouts of %s claim log-probs the "
                    "learner does not compute (quarantined; %d samples dispatched again, %d "
                    "groups back in the buffer)", step, len(liars), who, n,
                    len(groups))  # fmt: skip
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
        for x, r, b in zip(mismatch, rolls, bounds, strict=True):
            why = check_logp(float(x), b)
            if why is None:
                continue
            log.warning("generator %s: rollout %s trained with %s", r.generator_id,
                        r.rollout_id, why)  # fmt: skip
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        for gid, reason in bans.items():
            self.ban(gid, reason)
