"""The sections of the run config (pipeline.config.RunConfig composes them): one frozen
dataclass per component, each field with its default and a one-line docstring, each section
validating its own values (a bad value is a models.errors.ConfigError naming the key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from generator.config import REWARD_MODES
from models.errors import ConfigError

OBJECTIVES = ("grpo", "ppo", "dppo", "flow_dppo", "divergence_ppo")
POLICIES = ("drop", "keep")
TASKS = ("synthetic", "jsonl", "dataset")
WEIGHT_TRANSPORTS = ("disk", "chunks")
FSYNC = ("always", "batch", "never")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"run config {key}={value!r}: {why}")


@dataclass(frozen=True)
class ModelSection:
    """Which checkpoint the run starts from."""

    family: str = "huginn"
    """Model family for a fresh checkpoint: huginn, ouro, nanbeige or llama."""
    size: str = "tiny"
    """Preset size for a fresh checkpoint (models.init): tiny or small."""
    path: str = ""
    """Existing HF-layout checkpoint directory; empty: create family/size in RUN_DIR/init."""
    init_seed: int = 0
    """Initialisation seed of a fresh checkpoint."""
    reference_path: str = ""
    """Frozen reference policy of objective.kl_coef (HF checkpoint); empty: the starting checkpoint."""

    def __post_init__(self) -> None:
        _check(self.family in ("huginn", "ouro", "nanbeige", "llama"), "model.family",
               self.family, "must be huginn, ouro, nanbeige or llama")  # fmt: skip
        _check(self.size in ("tiny", "small"), "model.size", self.size, "must be tiny or small")


@dataclass(frozen=True)
class TaskSection:
    """Where prompts come from (the generators score them with ``reward``); docs/TASKS.md."""

    kind: str = "synthetic"
    """synthetic (the count-on task, docs/REWARDS.md), jsonl (``path``) or dataset (``path``)."""
    path: str = ""
    """jsonl: {"prompt_tokens", "task"} lines; dataset: data file(s), glob or directory (TASKS.md)."""
    num_prompts: int = 64
    """synthetic: number of distinct prompts."""
    seed: int = 0
    """Prompt shuffle seed of every epoch (synthetic: also the prompt generation seed)."""
    max_step: int = 1
    """synthetic: largest count step (1: always count up by one)."""
    reward: str = "synthetic"
    """Reward function the generators run (built-in name or package.module:function)."""
    split: str = "train"
    """dataset: the split to train on (a single file or glob is split "train")."""
    prompt_column: str = "prompt"
    """dataset: column of the prompt, a string or chat messages [{role, content}]."""
    answer_column: str = "answer"
    """dataset: column of the ground truth, passed to the reward as task["answer"]; empty: none."""
    id_column: str = ""
    """dataset: column of a stable prompt id; empty: the row number in the split."""
    metadata_columns: list[str] = field(default_factory=list)
    """dataset: more columns passed to the reward in its task dict (lists/dicts as JSON text)."""
    reward_args: dict[str, Any] = field(default_factory=dict)
    """Scalars added to every prompt's task dict (e.g. format_weight of the math reward)."""
    template: str = "auto"
    """dataset: auto (the checkpoint's chat template if it has one), chat, or plain text."""
    system_prompt: str = ""
    """dataset: system message put before every prompt; empty: none."""
    instruction: str = ""
    """dataset: text appended to every prompt's (last) user message."""
    max_prompt_tokens: int = 0
    """dataset: longer rendered prompts are dropped and counted; 0: max_model_len - max_tokens."""
    epochs: int = 0
    """dataset: passes over the data; caps the steps at epochs x rows / prompts_per_step (0: no cap)."""
    stop_on_eos: bool = True
    """dataset: completions also stop at the checkpoint's EOS ids (generation_config.json)."""

    def __post_init__(self) -> None:
        _check(self.kind in TASKS, "task.kind", self.kind, f"must be one of {TASKS}")
        _check(self.kind not in ("jsonl", "dataset") or bool(self.path), "task.path", self.path,
               f"required with task.kind={self.kind}")  # fmt: skip
        _check(self.num_prompts >= 1, "task.num_prompts", self.num_prompts, "must be >= 1")
        _check(self.max_step >= 1, "task.max_step", self.max_step, "must be >= 1")
        _check(bool(self.split), "task.split", self.split, "must name a split")
        _check(bool(self.prompt_column), "task.prompt_column", self.prompt_column, "required")
        _check(self.template in ("auto", "chat", "plain"), "task.template", self.template,
               "must be auto, chat or plain")  # fmt: skip
        _check(self.max_prompt_tokens >= 0, "task.max_prompt_tokens", self.max_prompt_tokens,
               "must be >= 0")  # fmt: skip
        _check(self.epochs >= 0, "task.epochs", self.epochs, "must be >= 0")
        bad = {k: v for k, v in self.reward_args.items()
               if not (v is None or isinstance(v, bool | int | float | str))}  # fmt: skip
        _check(not bad, "task.reward_args", bad, "values must be scalars (str, number, bool, null)")


@dataclass(frozen=True)
class RolloutSection:
    """Sampling: how many completions of what length, and how many prompts per step."""

    n: int = 8
    """Group size: completions sampled per prompt (one GRPO group)."""
    max_tokens: int = 8
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the objective uses the same."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    prompts_per_step: int = 16
    """Complete groups per training step."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (kept in it)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (kept in it; the generators detokenize to find them)."""
    exit_policy: dict[str, Any] = field(default_factory=dict)
    """Exit policy, e.g. {kind: ouro_gate, q: 0.8, kv: full}: kinds fixed (depth), latent_diff /
    kl / entropy_diff (threshold), ouro_gate (q); min_depth, max_depth (up to 255, beyond the
    model's depth allowed); kv full | last_exited (null: the family's default, docs/MODELS.md).
    Empty: every token at the model's depth. The generators run it, the door bounds exit depths
    by its max depth, both backends replay in its kv."""

    def policy(self) -> Any:
        """`exit_policy` as a models.exits policy (None when empty)."""
        from models.exits import policy_from_dict

        return policy_from_dict(self.exit_policy) if self.exit_policy else None

    def __post_init__(self) -> None:
        try:
            self.policy()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"rollout.exit_policy {dict(self.exit_policy)!r}: {e}") from None
        _check(self.n >= 1, "rollout.n", self.n, "must be >= 1")
        _check(self.max_tokens >= 1, "rollout.max_tokens", self.max_tokens, "must be >= 1")
        _check(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _check(self.prompts_per_step >= 1, "rollout.prompts_per_step", self.prompts_per_step,
               "must be >= 1")  # fmt: skip


@dataclass(frozen=True)
class ObjectiveSection:
    """The policy objective (learner.objectives.ObjectiveConfig) plus advantages and critic."""

    kind: str = "grpo"
    """grpo, ppo (with a critic), dppo (decoupled PPO), flow_dppo or divergence_ppo."""
    epochs: int = 1
    """Passes over each step's rollouts (proximal log-probs and advantages from the step's start)."""
    minibatches: int = 1
    """Optimizer updates per pass: the step's groups split into this many mini-batches."""
    eps_low: float = 0.2
    """Lower clip: ratio clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: ratio clipped above at 1 + eps_high."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1; null disables."""
    is_cap: float | None = None
    """Cap on the behaviour importance weight; null: uncapped (only dppo applies it then)."""
    is_mode: str = "truncate"
    """Use of is_cap: truncate or mask."""
    kl_threshold: float = 0.05
    """flow_dppo trust region (KL old||new)."""
    divergence: str = "tv"
    """divergence_ppo: binary divergence of the sampled token, tv or kl."""
    divergence_threshold: float = 0.2
    """divergence_ppo: trust region (tokens beyond it that push further out are dropped)."""
    anchor: str = "behaviour"
    """divergence_ppo: the policy r = pi / mu is measured against: behaviour or proximal."""
    kl_coef: float = 0.0
    """KL(policy || reference) coefficient (> 0 loads a frozen reference policy: model.reference_path)."""
    kl_in_reward: bool = False
    """Apply the KL as a per-sequence reward penalty (sum over tokens) instead of a loss term."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    aggregation: str = "token_mean"
    """Loss reduction: token_mean, seq_mean or seq_mean_token_sum."""
    normalize_std: bool = True
    """grpo/dppo/flow_dppo: divide group advantages by the group std (False: Dr. GRPO)."""
    gamma: float = 1.0
    """ppo: GAE discount."""
    lam: float = 1.0
    """ppo: GAE lambda."""
    value_clip: float | None = 0.2
    """ppo: critic value clip; null for the plain squared error."""
    value_coef: float = 0.5
    """Weight of the critic loss (objectives with a critic)."""
    critic: bool | None = None
    """Train a critic and use GAE advantages: null = on for ppo only; true for dppo / flow_dppo
    too (actor/critic); grpo has group advantages and no critic."""
    whiten: bool = False
    """Whiten the advantages over the step's response tokens (mean 0, std 1)."""
    dynamic_sampling: bool = False
    """Drop complete groups whose rewards are all equal (no group signal); new prompts refill."""
    overlong_buffer: int = 0
    """Soft overlong penalty over the last this many tokens before rollout.max_tokens (0: off)."""
    overlong_penalty: float = 1.0
    """The penalty at rollout.max_tokens (linear from 0 at max_tokens - overlong_buffer)."""

    @property
    def uses_critic(self) -> bool:
        """A critic is trained (ppo, or objective.critic true)."""
        return self.kind == "ppo" if self.critic is None else bool(self.critic)

    def __post_init__(self) -> None:
        _check(self.kind in OBJECTIVES, "objective.kind", self.kind, f"must be one of {OBJECTIVES}")
        _check(self.epochs >= 1, "objective.epochs", self.epochs, "must be >= 1")
        _check(self.kl_coef >= 0.0, "objective.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.kl_estimator in ("k1", "k2", "k3"), "objective.kl_estimator",
               self.kl_estimator, "must be k1, k2 or k3")  # fmt: skip
        _check(self.value_coef > 0, "objective.value_coef", self.value_coef, "must be > 0")
        _check(self.divergence in ("tv", "kl"), "objective.divergence", self.divergence,
               "must be tv or kl")  # fmt: skip
        _check(self.divergence_threshold > 0, "objective.divergence_threshold",
               self.divergence_threshold, "must be > 0")  # fmt: skip
        _check(self.anchor in ("behaviour", "proximal"), "objective.anchor", self.anchor,
               "must be behaviour or proximal")  # fmt: skip
        _check(self.overlong_buffer >= 0, "objective.overlong_buffer", self.overlong_buffer,
               "must be >= 0")  # fmt: skip
        _check(self.overlong_penalty >= 0, "objective.overlong_penalty", self.overlong_penalty,
               "must be >= 0")  # fmt: skip
        _check(self.critic is not False or self.kind != "ppo", "objective.critic", self.critic,
               "ppo needs its critic (GAE values)")  # fmt: skip
        _check(not (self.critic and self.kind == "grpo"), "objective.critic", self.critic,
               "grpo uses group advantages, not a critic")  # fmt: skip
        _check(self.minibatches >= 1, "objective.minibatches", self.minibatches, "must be >= 1")


@dataclass(frozen=True)
class OptimizerSection:
    """Adam(W) settings."""

    lr: float = 3e-3
    """Learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    critic_lr: float | None = None
    """Learning rate of the critic (null: lr)."""
    schedule: str = "constant"
    """LR after the warmup: constant, linear or cosine decay to min_lr (learner.config.ScheduleConfig)."""
    warmup_steps: int = 0
    """Optimizer updates of linear warmup from 0 to lr."""
    decay_steps: int = 0
    """Update at which linear / cosine decay reaches min_lr; 0: the run's last update."""
    min_lr: float = 0.0
    """LR at the end of the decay."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        _check(self.grad_clip >= 0, "optimizer.grad_clip", self.grad_clip, "must be >= 0")
        _check(self.schedule in ("constant", "linear", "cosine"), "optimizer.schedule",
               self.schedule, "must be constant, linear or cosine")  # fmt: skip
        _check(self.warmup_steps >= 0 and self.decay_steps >= 0, "optimizer.warmup_steps",
               (self.warmup_steps, self.decay_steps), "warmup_steps and decay_steps >= 0")  # fmt: skip
        _check(0 <= self.min_lr <= self.lr, "optimizer.min_lr", self.min_lr, "must be in [0, lr]")
        _check(self.critic_lr is None or self.critic_lr > 0, "optimizer.critic_lr",
               self.critic_lr, "must be null or > 0")  # fmt: skip


@dataclass(frozen=True)
class StalenessSection:
    """Bounded staleness (pipeline.staleness.StalenessGate)."""

    max_staleness: int = 1
    """Most learner versions a rollout may lag when trained (0: synchronous on-policy)."""
    policy: str = "drop"
    """Staler rollouts: drop (and the learner waits) or keep (flagged for correction)."""

    def __post_init__(self) -> None:
        _check(self.max_staleness >= 0, "staleness.max_staleness", self.max_staleness,
               "must be >= 0")  # fmt: skip
        _check(self.policy in POLICIES, "staleness.policy", self.policy, f"one of {POLICIES}")


@dataclass(frozen=True)
class IntakeSection:
    """The learner's door (pipeline.validation): rollout checks and what refusals cost."""

    reward_bound: float = 1e4
    """Largest |reward| accepted; a finite reward beyond it is refused (NaN/inf: failed reward)."""
    max_refused: int = 8
    """Refused rollouts within ``window_s`` after which a generator is dropped for the run (0: never)."""
    window_s: float = 60.0
    """Sliding window of ``max_refused`` (s)."""
    work_timeout_s: float = 900.0
    """Work a generator holds this long without answering is dispatched again elsewhere (s; 0: never)."""

    def __post_init__(self) -> None:
        _check(self.reward_bound > 0, "intake.reward_bound", self.reward_bound, "must be > 0")
        _check(self.max_refused >= 0, "intake.max_refused", self.max_refused, "must be >= 0")
        _check(self.window_s > 0, "intake.window_s", self.window_s, "must be > 0")
        _check(self.work_timeout_s >= 0, "intake.work_timeout_s", self.work_timeout_s, ">= 0")


@dataclass(frozen=True)
class GeneratorsSection:
    """Generator processes: how many `looprl run` starts and how much work each gets."""

    count: int = 2
    """Generator processes `looprl run` starts (the learner accepts any number)."""
    max_inflight: int = 2
    """Work items each generator holds at once."""
    peer_timeout_s: float = 10.0
    """Silence after which a generator is declared dead and its work re-dispatched (s)."""
    heartbeat_interval_s: float = 1.0
    """Heartbeat period, both directions (s)."""
    reward_mode: str = "thread"
    """Where generators run rewards: process, thread or inline."""
    threads: int = 1
    """Torch threads per generator process (OMP_NUM_THREADS) under `looprl run`."""
    max_model_len: int = 128
    """vLLM context length (prompt + completion tokens) of the generators `looprl run` starts."""
    dtype: str = "auto"
    """vLLM dtype of the generators `looprl run` starts: auto (bfloat16 when learner.precision is
    bf16, else the generator's own rule: float32 on CPU), float32 or bfloat16."""
    extra_args: list[str] = field(default_factory=list)
    """More `looprl generator` flags, passed verbatim by `looprl run`."""

    def __post_init__(self) -> None:
        _check(self.count >= 0, "generators.count", self.count, "must be >= 0")
        _check(self.max_inflight >= 1, "generators.max_inflight", self.max_inflight, ">= 1")
        _check(self.reward_mode in REWARD_MODES, "generators.reward_mode", self.reward_mode,
               f"must be one of {REWARD_MODES}")  # fmt: skip
        _check(self.dtype in ("auto", "float32", "bfloat16"), "generators.dtype", self.dtype,
               "must be auto, float32 or bfloat16")  # fmt: skip
        _check(0 < self.heartbeat_interval_s < self.peer_timeout_s, "generators.peer_timeout_s",
               self.peer_timeout_s, "need 0 < heartbeat_interval_s < peer_timeout_s")  # fmt: skip


@dataclass(frozen=True)
class EndpointsSection:
    """Where the learner binds (generators connect to control; weights is control + 1)."""

    host: str = "127.0.0.1"
    """Bind address; non-loopback needs ``keys`` (CURVE) or ``insecure``."""
    port: int = 0
    """Control port; weights use port + 1; 0: pick a free pair."""
    keys: str = ""
    """CURVE key directory (`looprl keys DIR`); empty: no CURVE (loopback only)."""
    insecure: bool = False
    """Allow a non-loopback bind without CURVE."""
    curve_on_loopback: bool = False
    """Use CURVE (with ``keys``) on loopback too; `looprl run` tells its generators the same."""

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65535, "endpoints.port", self.port, "must be in [0, 65535)")
        _check(not self.curve_on_loopback or bool(self.keys), "endpoints.curve_on_loopback",
               self.curve_on_loopback, "needs endpoints.keys")  # fmt: skip


@dataclass(frozen=True)
class PublishSection:
    """Weight publication after training steps."""

    every: int = 1
    """Publish a new weight version every this many steps."""
    transport: str = "disk"
    """disk: announce RUN_DIR/weights/vN; chunks: also stream the blob over ZMQ."""
    chunk_bytes: int = 4 << 20
    """chunks: bytes per WeightChunk."""
    window: int = 4
    """chunks: uncredited chunks in flight per generator."""
    keep: int = 3
    """Published versions kept on disk (older ones deleted; 0 keeps all)."""

    def __post_init__(self) -> None:
        _check(self.every >= 1, "publish.every", self.every, "must be >= 1")
        _check(self.transport in WEIGHT_TRANSPORTS, "publish.transport", self.transport,
               f"must be one of {WEIGHT_TRANSPORTS}")  # fmt: skip
        _check(self.keep >= 0, "publish.keep", self.keep, "must be >= 0")


@dataclass(frozen=True)
class CheckpointSection:
    """Learner checkpoints (trainer state + pipeline state)."""

    every: int = 20
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep: int = 2
    """Checkpoints kept (0 keeps all)."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")


@dataclass(frozen=True)
class RecordSection:
    """The rollout stream (RUN_DIR/stream) and the step log replay follows."""

    enabled: bool = True
    """Record every accepted rollout (before it is acknowledged) and every step's batch."""
    fsync: str = "batch"
    """Stream durability: always, batch (fsync per intake) or never."""

    def __post_init__(self) -> None:
        _check(self.fsync in FSYNC, "record.fsync", self.fsync, f"must be one of {FSYNC}")


@dataclass(frozen=True)
class MetricsSection:
    """Where metrics go (RUN_DIR/metrics.jsonl always)."""

    tensorboard: bool = True
    """Also write TensorBoard events to RUN_DIR/tb (skipped with a warning if unavailable)."""
    plot: bool = True
    """Write RUN_DIR/metrics.png at the end (needs matplotlib)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    wandb: bool = False
    """Also log to Weights & Biases (imported only then; offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "looprl"
    """Weights & Biases project name."""


PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class LearnerSection:
    """The megatron learner's compute settings (backend megatron; reference refuses them)."""

    precision: str = "fp32"
    """fp32, or bf16: bf16 weights/activations, fp32 main weights, grads and Adam state."""
    backprop_depth: int = -1
    """Core iterations with gradient per token: -1 the checkpoint's mean_backprop_depth, 0 all."""
    micro_batch_size: int = 0
    """Sequences per forward/backward per rank; 0: the group size if it divides, at most 16."""
    recompute: bool = False
    """Activation recompute around every block call (less memory, one more forward)."""
    compile: bool = False
    """torch.compile every transformer block (numerics fast only)."""

    def __post_init__(self) -> None:
        _check(self.precision in PRECISIONS, "learner.precision", self.precision,
               f"must be one of {PRECISIONS}")  # fmt: skip
        _check(self.backprop_depth >= -1, "learner.backprop_depth", self.backprop_depth,
               "must be -1 (the checkpoint's), 0 (all) or a positive iteration count")  # fmt: skip
        _check(self.micro_batch_size >= 0, "learner.micro_batch_size", self.micro_batch_size,
               "must be >= 0 (0: automatic)")  # fmt: skip


@dataclass(frozen=True)
class EvalSection:
    """Evaluation during training on a dataset task's eval split (pipeline/evaluation.py)."""

    every: int = 0
    """Evaluate at step 1 and every this many steps after it, and at the last step; 0: never."""
    split: str = "test"
    """Split of task.path to evaluate on."""
    n: int = 1
    """Completions per prompt (eval/accuracy is pass@1; eval/mean@n the mean over all)."""
    temperature: float = 0.0
    """Sampling temperature of the eval; 0: greedy."""
    limit: int = 0
    """Evaluate the first this many prompts of the split; 0: all."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every", self.every, "must be >= 0")
        _check(self.n >= 1, "eval.n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, "must be >= 0")
        _check(self.limit >= 0, "eval.limit", self.limit, "must be >= 0")
