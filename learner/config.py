"""The learner's configs: the objective (learner.objective_config, re-exported here), the optimizer, the LR schedule and the learner's
compute settings (each a section of the run config, which composes them as they are), and
``TrainConfig``, the per-step record a Trainer receives.

Each is a frozen dataclass validated on construction (models.settings): a bad value raises
``models.errors.ConfigError("<section>.<field>=<value>: <what is expected>")``. Defaults live
here only; they are the quickstart's (a tiny model on CPU): real models want e.g. lr 1e-6.
docs/LEARNER.md explains how they interact; docs/OBJECTIVES.md gives the formulas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from learner.objective_config import (
    ObjectiveConfig,
)
from models.numerics import MODES
from models.sampling import Sampling
from models.settings import AUTO, check, checker

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULES",
    "LearnerConfig",
    "LoraConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
]

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "bf16")
DEFAULT_VOCAB_CHUNK = 4096
"""Vocabulary slice width of the token statistics: 256 tokens x 4096 columns x 4 B = 4 MiB."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer of the policy (and, with critic_lr, of the critic), built by megatron's
    get_megatron_optimizer (backend megatron) or torch.optim (backend reference)."""

    name: str = "adam"
    """adam (torch AdamW: decoupled weight decay) or sgd."""
    lr: float = 3e-3
    """Peak learning rate, > 0 (the schedule scales it); the tiny quickstart's: real models
    want much less (e.g. 1e-6)."""
    beta1: float = 0.9
    """Adam beta1 in [0, 1)."""
    beta2: float = 0.999
    """Adam beta2 in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    grad_clip: float = 1.0
    """Global gradient-norm clip, >= 0; 0 disables clipping."""
    critic_lr: float | None = None
    """Learning rate of the critic (null: lr)."""
    sgd_momentum: float = 0.0
    """sgd: momentum in [0, 1)."""
    distributed: bool = True
    """adam: shard the optimizer state over data-parallel ranks (DistributedOptimizer)."""

    def __post_init__(self) -> None:
        need = checker(self, "optimizer")

        need(self.name in OPTIMIZERS, "name", f"must be one of {OPTIMIZERS}")
        need(self.lr > 0.0, "lr", "must be > 0")
        need(0.0 <= self.beta1 < 1.0, "beta1", "must be in [0, 1)")
        need(0.0 <= self.beta2 < 1.0, "beta2", "must be in [0, 1)")
        need(self.eps > 0.0, "eps", "must be > 0")
        need(self.weight_decay >= 0.0, "weight_decay", "must be >= 0")
        need(self.grad_clip >= 0.0, "grad_clip", "must be >= 0 (0 disables)")
        need(self.critic_lr is None or self.critic_lr > 0, "critic_lr", "must be null or > 0")
        need(0.0 <= self.sgd_momentum < 1.0, "sgd_momentum", "must be in [0, 1)")
        need(self.name != "sgd" or not self.distributed, "distributed",
             "must be false for sgd (megatron shards Adam state only)")  # fmt: skip

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def for_critic(self) -> OptimConfig:
        """The critic's optimizer: this one at ``critic_lr`` (when set)."""
        return dataclasses.replace(self, lr=self.critic_lr) if self.critic_lr else self


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule (megatron's OptimizerParamScheduler; the reference backend
    computes the same ``lr_at``).

    Update n (1-based: the n-th optimizer update) uses, with peak = optimizer.lr,
    W = warmup_steps, N = decay_steps:
        n <= W:        peak * n / W                               (linear warmup from 0)
        constant:      peak
        n > N:         min_lr
        linear:        min_lr + (peak - min_lr) * (1 - (n - W) / (N - W))
        cosine:        min_lr + (peak - min_lr) * 0.5 * (1 + cos(pi * (n - W) / (N - W)))
    """

    style: str = "constant"
    """LR after the warmup: constant, or linear / cosine decay to min_lr."""
    warmup_steps: int = 0
    """Optimizer updates of linear warmup from 0 to the peak LR, >= 0."""
    decay_steps: int = 0
    """Update at which linear / cosine decay reaches min_lr; 0: the run's last update."""
    min_lr: float = 0.0
    """LR at and after decay_steps, in [0, optimizer.lr]."""

    def __post_init__(self) -> None:
        need = checker(self, "schedule")

        need(self.style in SCHEDULES, "style", f"must be one of {SCHEDULES}")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(self.decay_steps >= 0, "decay_steps", "must be >= 0 (0: the run's last update)")
        need(self.style == "constant" or not self.decay_steps
             or self.decay_steps > self.warmup_steps, "decay_steps",
             f"must be 0 (the run's last update) or > warmup_steps ({self.warmup_steps})")  # fmt: skip
        need(self.min_lr >= 0.0, "min_lr", "must be >= 0")

    def resolved(self, total_updates: int) -> ScheduleConfig:
        """decay_steps 0 made the run's update count (at least warmup_steps + 1)."""
        if self.decay_steps:
            return self
        return dataclasses.replace(self, decay_steps=max(total_updates, self.warmup_steps + 1))

    def lr_at(self, peak: float, n: int) -> float:
        """The LR of the n-th update (1-based), as the formula in the class docstring."""
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return peak * n / self.warmup_steps
        if self.style == "constant":
            return peak
        if not self.decay_steps:
            raise ValueError("schedule.decay_steps=0: resolve it first (ScheduleConfig.resolved)")
        if n > self.decay_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        return self.min_lr + coeff * (peak - self.min_lr)


DEFAULT_LORA_TARGETS = ("*attn.*", "*mlp.*")
"""The attention and MLP projections of every block (prelude, core and coda; docs/LEARNER.md
"LoRA")."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (docs/LEARNER.md "LoRA"): each targeted linear W [out, in] trains
    A [rank, in] and B [out, rank] (B starts at 0), runs as W + (alpha / rank) B A
    (models.lora); every other base weight (the norms' unless train_norms) is frozen and left
    out of the optimizer."""

    rank: int = 0
    """Adapter rank r, >= 0; 0: off (every weight trained, the default)."""
    alpha: float = 16.0
    """Scale numerator, > 0: the adapter adds (alpha / rank) B A to its weight."""
    dropout: float = 0.0
    """Dropout on the adapter's input in [0, 1); the backends merge B A into the weight, so they
    take 0 only and refuse the rest."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Linear modules to adapt: fnmatch patterns over the Hugging Face module names (e.g.
    transformer.core_block.*.attn.Wqkv, model.layers.*.mlp.down_proj, lm_head); each must match
    at least one linear of the model."""

    train_norms: bool = True
    """Also train every RMSNorm weight in full (a few hidden-size vectors; the final norm holds
    the logit scale of a frozen tied head); false: the adapters only."""

    train_embeddings: bool | str = "auto"
    """Also train the token embedding in full (PEFT's modules_to_save; a tied head is the same
    tensor, so it trains too): the weight a frozen tied head leaves no adapter for. auto: true
    when the run initializes its model itself (model.path empty: a random embedding, which
    adapters alone cannot move: the quickstart's LoRA stops at 0.16 of reward with it frozen,
    0.71 with it trained, docs/LEARNER.md "LoRA"), false for a given checkpoint (a pretrained
    embedding, PEFT's default); the learner process chooses at start and records the choice in
    RUN_DIR/config.yaml (pipeline.commands.learner_main.with_embeddings_choice); a trainer
    built from an unresolved config takes auto as false."""

    publish: Literal["merged", "adapters"] = "merged"
    """What a version carries to the generators: merged, the full merged set W + s B A;
    adapters, the first version of a learner process the full set, each later one its adapter
    set (the factors and the trained norms, a few MB) on that base, merged by the generator
    and checked against the merged digest (weights.adapters; publish.transport shared_fs, shm
    or cuda_ipc)."""

    @property
    def on(self) -> bool:
        """Adapters are trained (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank (rank > 0)."""
        return self.alpha / self.rank

    def __post_init__(self) -> None:
        need = checker(self, "learner.lora")

        r = self.rank
        need(isinstance(r, int) and not isinstance(r, bool) and r >= 0, "rank",
             "must be an integer >= 0 (0: off)")  # fmt: skip
        need(math.isfinite(self.alpha) and self.alpha > 0, "alpha", "must be a finite number > 0")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        t = self.targets
        need(len(t) > 0 and all(isinstance(x, str) and x.strip() == x and x for x in t),
             "targets", "must be a non-empty list of module-name patterns (no blanks)")  # fmt: skip
        need(len(set(t)) == len(t), "targets", "must not repeat a pattern")
        need(isinstance(self.train_norms, bool), "train_norms", "must be true or false")
        te = self.train_embeddings
        need(isinstance(te, bool) or (isinstance(te, str) and te == "auto"), "train_embeddings",
             "must be true, false or auto")  # fmt: skip
        need(self.publish in ("merged", "adapters"), "publish", "must be merged or adapters")
        need(self.publish == "merged" or r > 0, "publish",
             "adapters needs learner.lora.rank > 0 (without adapters every version is full)")  # fmt: skip


def _chosen(value: Any, key: str) -> Any:
    if value == AUTO:
        raise ValueError(f"{key}=auto was not resolved (pipeline.config.device does it when "
                         "a run config is built)")  # fmt: skip
    return value


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's compute settings (backend reference honours micro_batch_size and
    backprop_depth 0 / -1 without truncation, and refuses the others' non-defaults)."""

    precision: str = "auto"
    """fp32, or bf16: bf16 weights/activations, fp32 main weights, grads and Adam state; auto:
    bf16 for a megatron learner on a CUDA host with numerics fast, else fp32
    (pipeline.config.device, resolved once and recorded for replay)."""
    backprop_depth: int = -1
    """Core iterations with gradient per token: -1 the checkpoint's mean_backprop_depth, 0 all."""
    micro_batch_size: int = 0
    """Sequences per forward/backward per rank; 0: automatic, at most 16384 tokens (docs/LEARNER.md)."""
    recompute: bool = False
    """Activation recompute around every block call (less memory, one more forward)."""
    compile: bool | str = "auto"
    """torch.compile every transformer block (numerics fast only); auto: on for a megatron
    learner on a CUDA host with numerics fast, else off."""
    max_tokens_per_micro: int | str = "auto"
    """Packed rows: rollouts end to end, at most this many tokens per forward/backward; 0: padded
    rows; auto: on a CUDA host a budget from the card's free memory where the forward packs
    (megatron, micro_batch_size 0), else 0."""
    threads: int | str = "auto"
    """Torch intra-op threads of each learner process, >= 1, or auto (CPU: the cores minus the local generators' threads; CUDA: torch's count), resolved once and recorded for replay."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters in place of full fine-tuning (rank 0: off)."""

    @property
    def packed_tokens(self) -> int:
        """max_tokens_per_micro once chosen (a run config resolves auto when it is built)."""
        return int(_chosen(self.max_tokens_per_micro, "learner.max_tokens_per_micro"))

    @property
    def compiled(self) -> bool:
        """compile once chosen (a run config resolves auto when it is built)."""
        return bool(_chosen(self.compile, "learner.compile"))

    def __post_init__(self) -> None:
        need = checker(self, "learner")

        need(self.precision in (*PRECISIONS, AUTO), "precision",
             f"must be one of {(*PRECISIONS, AUTO)}")  # fmt: skip
        need(self.compile == AUTO or isinstance(self.compile, bool), "compile",
             "must be true, false or auto")  # fmt: skip
        need(self.backprop_depth >= -1, "backprop_depth",
             "must be -1 (the checkpoint's), 0 (all) or a positive iteration count")  # fmt: skip
        need(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0 (0: automatic)")
        m = self.max_tokens_per_micro
        need(m == AUTO or (isinstance(m, int) and not isinstance(m, bool) and m >= 0),
             "max_tokens_per_micro", "must be >= 0 (0: padded rows of micro_batch_size) or auto")  # fmt: skip
        t = self.threads
        need(t == "auto" or (isinstance(t, int) and not isinstance(t, bool) and t >= 1),
             "threads", "must be an integer >= 1 or auto")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """What one Trainer step runs with: built by pipeline's build_learner_trainer from the run
    config's sections (tests and benchmarks build it directly). Not a run-config section."""

    global_batch_size: int = 64
    """Sequences (completions) per optimizer update, summed over data-parallel ranks, >= 1."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank, >= 1 (learner.micro_batch_size resolved);
    global_batch_size must be a multiple of micro_batch_size x data-parallel size."""
    pad_to_multiple: int = 1
    """Pad each micro-batch's sequence length up to a multiple of this, >= 1."""
    max_tokens_per_micro: int = 0
    """Packed micro-batches (learner.max_tokens_per_micro): consecutive rows of a rank's share
    of an update, at most this many positions (sum of seq_lens) each, marked packed; the
    data-parallel shares balanced by tokens. 0: micro_batch_size rows each (padded)."""
    max_tokens: int = 0
    """rollout.max_tokens: where the overlong penalty ends (learner.shaping); >= the
    objective's overlong_buffer when that is on."""
    recompute: bool = False
    """Activation recompute (learner.recompute: megatron 'full' / 'uniform', one layer per unit)."""
    seed: int = 1234
    """Seed of megatron's RNG tracker and torch/numpy/python RNGs, >= 0."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The objective (its epochs, critic, advantages and loss terms)."""
    sampling: Sampling = field(default_factory=Sampling)
    """The generator's temperature and top_p (the run's rollout section)."""
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK
    """Vocabulary columns per slice of the token statistics, >= 1."""
    numerics: str = "fast"
    """The run's numerics: exact computes the token statistics as the contract defines them
    (models.reference.behaviour_logprobs in exact mode), the reference backend's operations."""
    fused_token_stats: bool = True
    """CUDA logits go through the fused Triton token-stats kernel (learner.kernels.token_stats;
    the PyTorch path elsewhere); False: always the PyTorch path (exact numerics)."""
    exit_min_depth: int | None = None
    """A sampled exit (models.exits.SampledGate): its min_depth, so the policy's forwards also
    give each token's exit log-prob and exit entropy ("exit_logp", "exit_entropy"); None: the
    exits were decided, not sampled."""
    recompute_prox: bool | None = None
    """Recompute proximal log-probs with the pre-update weights: None = when the objective
    needs them (dppo, flow_dppo, is_cap set); True = always (the ratio base of ppo/grpo
    becomes the learner's own log-prob instead of the behaviour one); False = never."""

    def __post_init__(self) -> None:
        need = checker(self, "train")

        need(self.global_batch_size >= 1, "global_batch_size", "must be >= 1")
        need(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        need(self.global_batch_size % self.micro_batch_size == 0, "global_batch_size",
             f"must be a multiple of micro_batch_size ({self.micro_batch_size})")  # fmt: skip
        need(self.pad_to_multiple >= 1, "pad_to_multiple", "must be >= 1")
        need(self.max_tokens_per_micro >= 0, "max_tokens_per_micro", "must be >= 0")
        need(self.seed >= 0, "seed", "must be >= 0")
        need(self.vocab_chunk >= 1, "vocab_chunk", "must be >= 1")
        need(self.numerics in MODES, "numerics", f"must be one of {MODES}")
        need(self.exit_min_depth is None or self.exit_min_depth >= 1, "exit_min_depth",
             "must be None or >= 1")  # fmt: skip
        need(self.exit_min_depth is not None or not (self.objective.exit_coef > 0
                                                     or self.objective.exit_entropy_coef > 0),
             "exit_min_depth", "objective.exit_coef / exit_entropy_coef train a sampled exit: "
             "set the run's exit policy (rollout.exit_policy kind sampled_gate)")  # fmt: skip
        need(self.recompute_prox is not False or not self.needs_prox_default, "recompute_prox",
             f"must be None or True for objective kind {self.objective.kind!r}")  # fmt: skip

    @property
    def needs_prox_default(self) -> bool:
        """The objective cannot run without proximal log-probs (or old logits)."""
        o = self.objective
        return (o.kind in ("dppo", "flow_dppo") or o.is_cap is not None
                or (o.kind == "divergence_ppo" and o.anchor == "proximal")
                or o.loop_weighting != "last")  # fmt: skip

    @property
    def use_prox(self) -> bool:
        """Whether the trainer runs the proximal pass."""
        return self.needs_prox_default if self.recompute_prox is None else self.recompute_prox

    def grad_accum_steps(self, dp_size: int) -> int:
        """Micro-batches per rank per update; ConfigError unless the batch divides evenly."""
        per_update = self.micro_batch_size * dp_size
        check(dp_size >= 1 and self.global_batch_size % per_update == 0,
              "train.global_batch_size", self.global_batch_size,
              f"must be a multiple of micro_batch_size x dp_size ({per_update})")  # fmt: skip
        return self.global_batch_size // per_update
