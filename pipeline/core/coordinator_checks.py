"""Verified rollouts (a mixin of pipeline.core.coordinator.Coordinator): every trained
rollout's claimed behaviour log-probs against the learner's, before the update where the
trainer can refuse a step (``_train``, ``_refuse_step``) and after it otherwise (``_verify``).
A lie is quarantined and counted toward its generator's budget; over budget the generator is
banned. The state it reads is the Coordinator's, built in its ``__init__``."""

from __future__ import annotations

import logging

from pipeline.backends.trainer_api import StepResult, Trainer
from pipeline.config import RunConfig
from pipeline.core.intake import Group, Intake
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import Refusal, check_logp, logp_bound
from proto import Rollout

log = logging.getLogger("pipeline.core.coordinator")


class VerifiedSteps:
    """Log-prob checks of trained rollouts (see the module docstring)."""

    cfg: RunConfig
    trainer: Trainer
    intake: Intake
    gate: StalenessGate
    banned: dict[str, str]
    step: int
    version_step: int
    _logp_base: float

    def ban(self, gid: str, why: str) -> None:  # (PeerHandling's)
        raise NotImplementedError

    def _bounds(self, rolls: list[Rollout], base: int) -> list[float]:
        """Each rollout's log-prob bound (validation.logp_bound: the numerics' base plus the
        drift of the optimizer steps between the weights that sampled it and the trainer's).
        Those steps are ``publish.every`` a version of staleness at ``base`` (the trainer's
        newest version, written or being written), plus the steps taken since that version
        was taken (``version_step``: with publish.every > 1 the trainer is ahead of it)."""
        every, since = self.cfg.publish.every, self.step - self.version_step
        return [logp_bound(self._logp_base, self._updates(base, r, every, since)) for r in rolls]

    def _updates(self, base: int, r: Rollout, every: int, since: int) -> int:
        return max(self.gate.staleness(base, r), 0) * every + max(since, 0)

    def _refuse_step(
        self, rolls: list[Rollout], groups: list[Group], bounds: list[float], ref: StepResult
    ) -> None:
        """A step refused before its update: its liars are quarantined and counted toward
        their generators' budgets (as ``_verify``'s), their samples voided and dispatched again
        (to another generator where there is one); the rest of its groups go back to the
        buffer, untrained, and a later step takes them. Over budget: banned (which voids the
        generator's other accepted, untrained rollouts)."""
        bans: dict[str, str] = {}
        liars: set[str] = set()
        for i in ref.refused:
            r = rolls[i]
            x = ref.mismatch[i] if i < len(ref.mismatch) else float("nan")
            why = check_logp(float(x), bounds[i]) or Refusal(
                "logp_mismatch", f"the trainer measured {x:.3g} nats (bound {bounds[i]:.3g})"
            )
            liars.add(r.rollout_id)
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        who = sorted({rolls[i].generator_id for i in ref.refused})
        n = self.intake.take_back(groups, liars)
        self.intake.counts["steps_refused"] += 1
        log.warning("step %d refused before its update: %d rollouts of %s claim log-probs the "
                    "learner does not compute (quarantined; %d samples dispatched again, %d "
                    "groups back in the buffer)", self.step + 1, len(liars), who, n,
                    len(groups))  # fmt: skip
        for gid, reason in bans.items():
            if gid not in self.banned:
                self.ban(gid, reason)

    def _verify(self, rolls: list[Rollout], per: list[float], bounds: list[float]) -> None:
        """Verified rollouts after the step, for a trainer that cannot refuse a step before its
        update (the real ones do: ``StepResult.refused``): each trained rollout's claimed log-probs against
        the learner's, within its bound (``_bounds``). A lie is quarantined and counted toward
        its generator's budget (intake.max_refused within intake.window_s); over budget, the
        generator is banned and its accepted, untrained rollouts are voided and their samples
        dispatched again."""
        bans: dict[str, str] = {}
        for x, r, b in zip(per, rolls, bounds, strict=True):
            why = check_logp(float(x), b)
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
