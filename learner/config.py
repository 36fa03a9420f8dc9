"""Typed configs of the learner's training step: optimizer, LR schedule, training loop.

Each is a frozen dataclass validated on construction; a bad value raises
`ValueError("<field>: expected <range>, got <value>")`. Defaults live here only.
`learner.trainer.Trainer` receives them; docs/LEARNER.md explains how they interact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from learner.objectives import ObjectiveConfig, ValueLossConfig

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimConfig", "ScheduleConfig", "TrainConfig"]

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "linear", "cosine")


def _fail(name: str, expected: str, got: Any) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer of one network (policy or critic), built by megatron's get_megatron_optimizer."""

    name: str = "adam"
    """'adam' (torch AdamW: decoupled weight decay) or 'sgd'."""
    lr: float = 1e-6
    """Peak learning rate, > 0 (the schedule scales it)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    clip_grad: float = 1.0
    """Global gradient-norm clip, > 0; 0 disables clipping."""
    sgd_momentum: float = 0.0
    """SGD momentum in [0, 1)."""
    distributed: bool = True
    """Adam only: shard the optimizer state over data-parallel ranks (DistributedOptimizer)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            _fail("name", f"one of {OPTIMIZERS}", self.name)
        if not self.lr > 0.0:
            _fail("lr", "a value > 0", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail("betas", "two values in [0, 1)", self.betas)
        if not self.eps > 0.0:
            _fail("eps", "a value > 0", self.eps)
        if not self.weight_decay >= 0.0:
            _fail("weight_decay", "a value >= 0", self.weight_decay)
        if not self.clip_grad >= 0.0:
            _fail("clip_grad", "a value >= 0 (0 disables)", self.clip_grad)
        if not 0.0 <= self.sgd_momentum < 1.0:
            _fail("sgd_momentum", "a value in [0, 1)", self.sgd_momentum)
        if self.name == "sgd" and self.distributed:
            _fail("distributed", "False for sgd (megatron shards Adam state only)", True)


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule (megatron's OptimizerParamScheduler).

    Update n (1-based: the n-th optimizer update) uses, with peak = OptimConfig.lr,
    W = warmup_steps, N = total_steps:
        n <= W:        peak * n / W                               (linear warmup from 0)
        constant:      peak
        n > N:         min_lr
        linear:        min_lr + (peak - min_lr) * (1 - (n - W) / (N - W))
        cosine:        min_lr + (peak - min_lr) * 0.5 * (1 + cos(pi * (n - W) / (N - W)))
    """

    style: str = "constant"
    """'constant', 'linear' or 'cosine' decay after the warmup."""
    warmup_steps: int = 0
    """Updates of linear warmup from 0 to the peak LR, >= 0."""
    total_steps: int = 1
    """Update at which the decay reaches min_lr, >= 1; > warmup_steps unless constant."""
    min_lr: float = 0.0
    """LR at and after total_steps, in [0, peak lr]."""

    def __post_init__(self) -> None:
        if self.style not in SCHEDULES:
            _fail("style", f"one of {SCHEDULES}", self.style)
        if self.warmup_steps < 0:
            _fail("warmup_steps", "an integer >= 0", self.warmup_steps)
        if self.total_steps < 1:
            _fail("total_steps", "an integer >= 1", self.total_steps)
        if self.style != "constant" and self.total_steps <= self.warmup_steps:
            _fail("total_steps", f"> warmup_steps ({self.warmup_steps})", self.total_steps)
        if not self.min_lr >= 0.0:
            _fail("min_lr", "a value >= 0", self.min_lr)

    def lr_at(self, peak: float, n: int) -> float:
        """The LR of the n-th update (1-based), as the formula in the class docstring."""
        import math

        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return peak * n / self.warmup_steps
        if self.style == "constant":
            return peak
        if n > self.total_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        return self.min_lr + coeff * (peak - self.min_lr)


@dataclass(frozen=True)
class TrainConfig:
    """One training step: batch shape, advantages, objective, critic, determinism."""

    global_batch_size: int = 64
    """Sequences (completions) per optimizer update, summed over data-parallel ranks, >= 1."""
    epochs: int = 1
    """Passes over a step's rollouts (each pass: one update per global batch, in a shuffled
    order after the first pass); advantages and proximal log-probs come from the step's
    starting weights, >= 1."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank, >= 1; global_batch_size must be a
    multiple of micro_batch_size x data-parallel size (the quotient is grad_accum_steps)."""
    pad_to_multiple: int = 1
    """Pad each micro-batch's sequence length up to a multiple of this, >= 1."""
    recompute: bool = False
    """Activation recompute (megatron 'full' / 'uniform', one layer per unit)."""
    seed: int = 1234
    """Seed of megatron's RNG tracker and torch/numpy/python RNGs, >= 0."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """Policy objective (learner.objectives.ObjectiveConfig)."""
    critic: bool = False
    """Train a critic and use GAE advantages (required for ppo, not allowed for grpo)."""
    value: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Critic loss (used when critic is on)."""
    gamma: float = 1.0
    """GAE discount in [0, 1]."""
    lam: float = 1.0
    """GAE lambda in [0, 1]."""
    group_normalize_std: bool = True
    """Group advantages: divide by the group's std (GRPO) or not (Dr. GRPO)."""
    kl_in_reward: bool = False
    """objective.kl_coef x the sampled tokens' KL estimate (summed per sequence) is subtracted
    from each rollout's reward before the advantages, instead of being a loss term."""
    whiten_advantages: bool = False
    """Whiten advantages over the step's tokens (all data-parallel ranks)."""
    fused_token_stats: bool = True
    """CUDA logits go through the fused Triton token-stats kernel (learner.triton_token_stats;
    the PyTorch path elsewhere); False: always the PyTorch path (exact numerics)."""
    recompute_prox: bool | None = None
    """Recompute proximal log-probs with the pre-update weights: None = when the objective
    needs them (dppo, flow_dppo, is_cap set); True = always (the ratio base of ppo/grpo
    becomes the learner's own log-prob instead of the behaviour one); False = never."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            _fail("global_batch_size", "an integer >= 1", self.global_batch_size)
        if self.micro_batch_size < 1:
            _fail("micro_batch_size", "an integer >= 1", self.micro_batch_size)
        if self.epochs < 1:
            _fail("epochs", "an integer >= 1", self.epochs)
        if self.global_batch_size % self.micro_batch_size:
            _fail(
                "global_batch_size",
                f"a multiple of micro_batch_size ({self.micro_batch_size})",
                self.global_batch_size,
            )
        if self.pad_to_multiple < 1:
            _fail("pad_to_multiple", "an integer >= 1", self.pad_to_multiple)
        if self.seed < 0:
            _fail("seed", "an integer >= 0", self.seed)
        if not isinstance(self.objective, ObjectiveConfig):
            _fail("objective", "an ObjectiveConfig", type(self.objective).__name__)
        if not isinstance(self.value, ValueLossConfig):
            _fail("value", "a ValueLossConfig", type(self.value).__name__)
        if self.objective.kind == "ppo" and not self.critic:
            _fail("critic", "True for objective kind 'ppo' (GAE needs values)", self.critic)
        if self.objective.kind == "grpo" and self.critic:
            _fail("critic", "False for objective kind 'grpo' (group advantages)", self.critic)
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                _fail(name, "a value in [0, 1]", getattr(self, name))
        if self.recompute_prox is False and self.needs_prox_default:
            _fail("recompute_prox", f"None or True for kind {self.objective.kind!r}", False)

    @property
    def needs_prox_default(self) -> bool:
        """The objective cannot run without proximal log-probs (or old logits)."""
        o = self.objective
        return (o.kind in ("dppo", "flow_dppo") or o.is_cap is not None
                or (o.kind == "divergence_ppo" and o.anchor == "proximal"))  # fmt: skip

    @property
    def use_prox(self) -> bool:
        """Whether the trainer runs the proximal pass."""
        return self.needs_prox_default if self.recompute_prox is None else self.recompute_prox

    def grad_accum_steps(self, dp_size: int) -> int:
        """Micro-batches per rank per update; ValueError unless the batch divides evenly."""
        per_update = self.micro_batch_size * dp_size
        if dp_size < 1 or self.global_batch_size % per_update:
            _fail(
                "global_batch_size",
                f"a multiple of micro_batch_size x dp_size ({per_update})",
                self.global_batch_size,
            )
        return self.global_batch_size // per_update
