"""The typed inputs of the objectives: `LossBatch` (what a caller hands `policy_loss`),
`Tokens` (what a kind's surrogate sees: validated, invalid tokens zeroed) and `ValueBatch`.

A caller builds a `LossBatch` (learner.step does, per micro-batch); a mapping with the same
keys is accepted too (`LossBatch.of`), unknown keys are refused in one line naming them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["LossBatch", "Tokens", "ValueBatch"]


@dataclass
class LossBatch:
    """One (micro-)batch of `policy_loss` inputs; token tensors are [B, T] (fp32 or castable),
    None = not provided."""

    mask: Tensor
    """float, > 0 on response tokens (a weight); required."""
    advantages: Tensor
    """[B, T], or [B] for grpo (broadcast over the tokens); required."""
    logp: Tensor | None = None
    """log pi_theta(token), differentiable: the current policy (or `logits` + `targets`)."""
    entropy: Tensor | None = None
    """Entropy of pi_theta, differentiable (entropy_coef > 0 without logits)."""
    behav_logp: Tensor | None = None
    """Log-prob under the behaviour policy (the generator), after temperature."""
    prox_logp: Tensor | None = None
    """Log-prob under the proximal policy (the learner's pre-update weights)."""
    ref_logp: Tensor | None = None
    """Log-prob under the frozen reference policy (kl_coef > 0)."""
    kl: Tensor | None = None
    """KL(pi_prox || pi_theta) over the full vocabulary (flow_dppo without logits)."""
    logits: Tensor | None = None
    """[B, T, V] current logits instead of logp: logp, entropy (and with `old_logits` prox_logp
    and kl) come from `learner.vocab_ops.token_stats` at the loss's temperature."""
    targets: Tensor | None = None
    """[B, T] int: the sampled tokens (with `logits`)."""
    old_logits: Tensor | None = None
    """[B, T, V] proximal logits (pre-update weights, recomputed); flow_dppo."""
    normalizer: float | Tensor | None = None
    """Replaces the aggregation denominator (`learner.losses.aggregate`): the update's global
    token or sequence count, so micro-batches and DP ranks add up to one mean."""
    loop_weight: Tensor | None = None
    """[B, T, K] per-loop credit weights (learner.objectives.loops.loop_weights); given, the
    objective's per-token term is applied at each loop k with the loop_* inputs and summed
    with these weights (docs/OBJECTIVES.md "Per-loop credit"). None: the exit loop only."""
    loop_logp: Tensor | None = None
    """[B, T, K] log-prob of the sampled token read out after loop k (differentiable)."""
    loop_entropy: Tensor | None = None
    """[B, T, K] entropy of that distribution (differentiable)."""
    loop_prox: Tensor | None = None
    """[B, T, >= K] the proximal pass's per-loop log-probs (the ratio base at each loop)."""
    loop_ref: Tensor | None = None
    """[B, T, >= K] the reference policy's per-loop log-probs (kl_coef > 0)."""
    exit_logp: Tensor | None = None
    """[B, T] log-prob of each token's sampled exit loop under the current weights
    (differentiable; objective.exit_coef, learner.objectives.exit_term)."""
    exit_prox: Tensor | None = None
    """[B, T] the same under the pre-update weights (the exit ratio's base when given)."""
    exit_behav: Tensor | None = None
    """[B, T] the generator's claim (Rollout.exit_logprobs)."""
    exit_entropy: Tensor | None = None
    """[B, T] the exit decisions' entropy along each token's path (differentiable)."""

    @classmethod
    def of(cls, batch: LossBatch | Mapping[str, Any]) -> LossBatch:
        """`batch` itself, or a LossBatch of a mapping's keys (ValueError naming unknown ones)."""
        if isinstance(batch, LossBatch):
            return batch
        return _of_mapping(cls, batch)


@dataclass
class ValueBatch:
    """One (micro-)batch of `value_loss` inputs, all [B, T]."""

    values: Tensor
    """The critic's values (differentiable)."""
    old_values: Tensor
    """The critic's values when the rollout was scored (the step's start)."""
    returns: Tensor
    """GAE returns (`learner.advantages.gae`)."""
    mask: Tensor
    """float, > 0 on response tokens."""
    normalizer: float | Tensor | None = None
    """As `LossBatch.normalizer`."""

    @classmethod
    def of(cls, batch: ValueBatch | Mapping[str, Any]) -> ValueBatch:
        if isinstance(batch, ValueBatch):
            return batch
        return _of_mapping(cls, batch)


def _of_mapping(cls: Any, batch: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(batch) - names)
    if unknown:
        raise ValueError(f"batch: unknown key(s) {unknown}; expected some of {sorted(names)}")
    for key in (f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING):
        if not isinstance(batch.get(key), Tensor):
            raise ValueError(f"batch[{key!r}]: required, a tensor")
    return cls(**batch)


@dataclass
class Tokens:
    """A micro-batch's token inputs after validation, as every kind and term sees them: [B, T]
    fp32, exactly 0 on invalid tokens (so no inf reaches a product whose backward could make
    0 * inf = NaN); None = not provided."""

    mask: Tensor
    """The caller's mask (a weight)."""
    live: Tensor
    """bool: mask > 0."""
    valid: Tensor
    """bool: live and every input the configured objective uses finite."""
    logp: Tensor
    """Current log-probs (differentiable)."""
    base: Tensor
    """The log-prob the ratio is measured against (the kind's `base`)."""
    advantages: Tensor
    """Detached fp32 advantages [B, T]."""
    log_ratio: Tensor
    """logp - base."""
    ratio: Tensor
    """exp(log_ratio) per token, or the GSPO sequence ratio (objective.ratio_level)."""
    behav: Tensor | None = None
    prox: Tensor | None = None
    ref: Tensor | None = None
    kl: Tensor | None = None
    entropy: Tensor | None = None
    """Differentiable."""

    def where_valid(self, x: Tensor) -> Tensor:
        """x on valid tokens, 0 elsewhere."""
        return torch.where(self.valid, x, 0.0)
