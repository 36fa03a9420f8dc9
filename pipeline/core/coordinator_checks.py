"""Verified rollouts (a mixin of pipeline.core.coordinator.Coordinator): every trained
rollout's claimed behaviour log-probs against the learner's, before the update where the
trainer can refuse a step (``_train``, ``_refuse_step``) and after it otherwise (``_verify``).
A lie is quarantined and counted toward its generator's budget; over budget the generator is
banned. The state it reads is the Coordinator's, built in its ``__init__``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pipeline.backends.trainer_api import Trainer
from pipeline.core.intake import Group, Intake
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import Refusal, check_logp, logp_bound
from proto import Rollout

log = logging.getLogger("pipeline.core.coordinator")


@dataclass
class _Refused:
    """A step the trainer refused before its update (verified rollouts): the liars (indices
    into the job's rollouts) and every rollout's measured mismatch."""

    liars: list[int]
    mismatch: list[float]


class VerifiedSteps:
    """Log-prob checks of trained rollouts (see the module docstring)."""

    trainer: Trainer
    intake: Intake
    gate: StalenessGate
    banned: dict[str, str]
    step: int
    _logp_base: float

    def ban(self, gid: str, why: str) -> None:  # (PeerHandling's)
        raise NotImplementedError

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

    def _refuse_step(
        self, rolls: list[Rollout], groups: list[Group], base: int, ref: _Refused
    ) -> None:
        """A step refused before its update: its liars are quarantined and counted toward
        their generators' budgets (as ``_verify``'s), their samples voided and dispatched again
        (to another generator where there is one); the rest of its groups go back to the
        buffer, untrained, and a later step takes them. Over budget: banned (which voids the
        generator's other accepted, untrained rollouts)."""
        bans: dict[str, str] = {}
        liars: set[str] = set()
        for i in ref.liars:
            r = rolls[i]
            x = ref.mismatch[i] if i < len(ref.mismatch) else float("nan")
            st = self.gate.staleness(base, r)
            why = check_logp(float(x), base=self._logp_base, staleness=st) or Refusal(
                "logp_mismatch", f"the trainer measured {x:.3g} nats (bound "
                f"{logp_bound(self._logp_base, st):.3g} at staleness {st})")  # fmt: skip
            liars.add(r.rollout_id)
            ban = self.intake.refuse_trained(r.generator_id, r, why)
            if ban is not None:
                bans.setdefault(r.generator_id, ban)
        who = sorted({rolls[i].generator_id for i in ref.liars})
        n = self.intake.take_back(groups, liars)
        self.intake.counts["steps_refused"] += 1
        log.warning("step %d refused before its update: %d rollouts of %s claim log-probs the "
                    "learner does not compute (quarantined; %d samples dispatched again, %d "
                    "groups back in the buffer)", self.step + 1, len(liars), who, n,
                    len(groups))  # fmt: skip
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
