"""What a kind and a term are: the two things `policy_loss` composes (learner/objectives)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from learner.objective_config import ObjectiveConfig
from learner.objectives.batch import Tokens

__all__ = ["Kind", "Metrics", "Term"]

Metrics = dict[str, Tensor]
"""0-d tensors by name (mask-weighted token means; fractions of mask tokens)."""


@dataclass(frozen=True)
class Kind:
    """One objective kind: its per-token policy-gradient loss and the inputs it needs."""

    surrogate: Callable[[ObjectiveConfig, Tokens, Metrics], Tensor]
    """Per-token loss [B, T] (before the behaviour weight), adding its own metrics."""
    needs: tuple[str, ...] = ()
    """LossBatch inputs required whatever the config (a non-finite one invalidates a token)."""
    always_weighted: bool = False
    """The behaviour weight exp(prox_logp - behav_logp) applies even without objective.is_cap."""
    base: Callable[[ObjectiveConfig], str] | None = None
    """The input the ratio is measured against (required); None: prox_logp when given, else
    behav_logp."""


@dataclass(frozen=True)
class Term:
    """A loss term added to every kind's weighted surrogate, in registry order."""

    add: Callable[[ObjectiveConfig, Tokens, Metrics], Tensor | None]
    """The per-token addition [B, T] (None: nothing this config), adding its metrics."""
    needs: Callable[[ObjectiveConfig], dict[str, str]] = lambda cfg: {}
    """Inputs required under cfg -> why (for the error message)."""
    validates: Callable[[ObjectiveConfig], tuple[str, ...]] = lambda cfg: ()
    """Inputs whose non-finite value makes a token invalid under cfg."""
