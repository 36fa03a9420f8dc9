"""The sections of the run config (pipeline.config.run.RunConfig composes them): one frozen
dataclass per component, each field with its default and a one-line docstring, each section
validating its own values (a bad value is a models.errors.ConfigError naming the key)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, get_args

from generator.config import GeneratorConfig
from models.errors import ConfigError
from models.exits import KL, EntropyDiff, ExitPolicy, LatentDiff, OuroGate, parse_policy
from models.random_init import GPU_SIZES, SIZES
from models.sampling import Sampling
from models.settings import AUTO, check
from pipeline.net.transport.config import TransportConfig
from proto.records import MAX_DEPTH

ENVIRONMENT_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""task.environment: package.module:Class."""
ADAPTIVE_EXITS = (LatentDiff, KL, EntropyDiff, OuroGate)
"""Exit policies whose depth varies per token (refused with task.environment)."""
POLICIES = ("drop", "keep")
TASKS = ("synthetic", "jsonl", "dataset")
SEED_LIMIT = (
    1 << 32
)  # seeds are in [0, 2**32): every consumer (torch, the latent-seed hash) takes them


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    check(ok, key, value, why, what="run config")


@dataclass(frozen=True)
class ModelSection:
    """Which checkpoint the run starts from."""

    family: str = "huginn"
    """Model family for a fresh checkpoint: huginn, ouro, nanbeige or llama."""
    size: str = "tiny"
    """Preset size for a fresh checkpoint (models.random_init): tiny, small, or the GPU shapes 1b and 0125
    (Huginn only: the ~1B and Huginn-0125 shapes, random init) and 400m (Ouro only: 413 M, vocab 512)."""
    path: str = ""
    """Existing HF-layout checkpoint directory; empty: create family/size in RUN_DIR/init."""
    init_seed: int = 0
    """Initialisation seed of a fresh checkpoint."""
    reference_path: str = ""
    """Frozen reference policy of objective.kl_coef (HF checkpoint); empty: the starting checkpoint."""

    def __post_init__(self) -> None:
        _check(self.family in ("huginn", "ouro", "nanbeige", "llama"), "model.family",
               self.family, "must be huginn, ouro, nanbeige or llama")  # fmt: skip
        _check(self.size in SIZES, "model.size", self.size,
               f"must be one of {', '.join(SIZES)} (1b, 0125: family huginn only; 400m: ouro only)")  # fmt: skip
        owner = GPU_SIZES.get(self.size, self.family)
        _check(owner == self.family, "model.size", self.size,
               f"is a{'n' if owner == 'ouro' else ''} {owner.capitalize()} shape; model.family is "
               f"{self.family}")  # fmt: skip
        _check(0 <= self.init_seed < SEED_LIMIT, "model.init_seed", self.init_seed,
               "must be in [0, 2**32)")  # fmt: skip


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
    environment: str = ""
    """Multi-turn environment (package.module:Class, docs/TASKS.md): the generators alternate model
    turns and its observations in one rollout (Rollout.token_mask); empty: single-turn."""

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
        _check(0 <= self.seed < SEED_LIMIT, "task.seed", self.seed, "must be in [0, 2**32)")
        _check(not self.environment or ENVIRONMENT_SPEC.fullmatch(self.environment) is not None,
               "task.environment", self.environment,
               "must be package.module:Class (an importable class) or empty")  # fmt: skip
        _check(not self.environment or self.reward == TaskSection.reward, "task.reward",
               self.reward, f"task.environment ({self.environment}) scores the conversations and "
               "the reward function is never called: set one of task.reward and "
               "task.environment, not both")  # fmt: skip
        bad = {k: v for k, v in self.reward_args.items()
               if not (v is None or isinstance(v, bool | int | float | str))}  # fmt: skip
        _check(not bad, "task.reward_args", bad, "values must be scalars (str, number, bool, null)")


@dataclass(frozen=True)
class RolloutSection(Sampling):
    """Sampling (temperature and top_p: models.sampling.Sampling, which the learner gets too):
    how many completions of what length, and how many prompts per step."""

    n: int = 8
    """Group size: completions sampled per prompt (one GRPO group)."""
    max_tokens: int = 8
    """Longest completion, in tokens."""
    prompts_per_step: int = 16
    """Complete groups per training step."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (kept in it)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (kept in it; the generators detokenize to find them)."""
    exit_policy: dict[str, Any] = field(default_factory=dict)
    """Exit policy, e.g. {kind: ouro_gate, q: 0.8, kv: full}: kinds fixed (depth), latent_diff /
    kl / entropy_diff (threshold), ouro_gate (q), sampled_gate (the exit drawn from the gate,
    its log-prob claimed and trained: objective.exit_coef); min_depth, max_depth (up to 255, beyond the
    model's depth allowed); kv full | last_exited (null: the family's default, docs/MODELS.md).
    Empty: every token at the model's depth. The generators run it, the door bounds exit depths
    by its max depth, both backends replay in its kv."""
    max_turns: int = 8
    """task.environment: most model turns in one conversation (single-turn runs always have 1);
    the door refuses a rollout with more."""
    max_env_tokens: int = 512
    """task.environment: most environment (observation) tokens in one conversation, all turns
    together; the whole conversation stays within max_model_len."""

    @cached_property
    def parsed_policy(self) -> ExitPolicy | None:
        """`exit_policy` as a models.exits policy (None when empty), parsed once at load."""
        return parse_policy(dict(self.exit_policy))

    @property
    def sampling(self) -> Sampling:
        """The temperature and top_p alone (what the learner's log-probs use)."""
        return Sampling(temperature=self.temperature, top_p=self.top_p)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.parsed_policy  # noqa: B018  (parsed here, once: a bad mapping fails the load)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"rollout.exit_policy {dict(self.exit_policy)!r}: {e}") from None
        _check(self.n >= 1, "rollout.n", self.n, "must be >= 1")
        _check(self.max_tokens >= 1, "rollout.max_tokens", self.max_tokens, "must be >= 1")
        _check(self.prompts_per_step >= 1, "rollout.prompts_per_step", self.prompts_per_step,
               "must be >= 1")  # fmt: skip
        _check(self.max_turns >= 1, "rollout.max_turns", self.max_turns, "must be >= 1")
        _check(self.max_env_tokens >= 1, "rollout.max_env_tokens", self.max_env_tokens,
               "must be >= 1")  # fmt: skip


@dataclass(frozen=True)
class StalenessSection:
    """Bounded staleness (pipeline.core.staleness.StalenessGate)."""

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
    """The learner's door (pipeline.core.validation): rollout checks and what refusals cost."""

    reward_bound: float = 1e4
    """Largest |reward| accepted; a finite reward beyond it is refused (NaN/inf: failed reward)."""
    max_refused: int = 8
    """Refused rollouts within ``window_s`` after which a generator is dropped for the run (0: never)."""
    window_s: float = 60.0
    """Sliding window of ``max_refused`` (s)."""
    work_timeout_s: float | None = None
    """Work a generator holds this long without answering is dispatched again elsewhere (s; 0: never; unset: half of max_wait_s); below max_wait_s, so held work is re-issued before the run gives up."""
    share_ratio: float = 4.0
    """Fair share: of recent new work, a generator gets at most this many times (count + 1) of each other that answered (0: off)."""

    def __post_init__(self) -> None:
        _check(self.reward_bound > 0, "intake.reward_bound", self.reward_bound, "must be > 0")
        _check(self.max_refused >= 0, "intake.max_refused", self.max_refused, "must be >= 0")
        _check(self.window_s > 0, "intake.window_s", self.window_s, "must be > 0")
        _check(self.work_timeout_s is None or self.work_timeout_s >= 0, "intake.work_timeout_s",
               self.work_timeout_s, ">= 0")  # fmt: skip
        _check(self.share_ratio == 0 or self.share_ratio >= 1, "intake.share_ratio",
               self.share_ratio, "must be 0 (off) or >= 1")  # fmt: skip


# GeneratorConfig fields `looprl run` sets itself for every generator: (what sets them).
RUN_MANAGED = {
    "learner": "endpoints.host / endpoints.port",
    "weights_endpoint": "endpoints.host / endpoints.port",
    "model": "model.path (or the fresh checkpoint)",
    "generator_id": "the launcher (gen0, gen1, ...)",
    "numerics": "the run's numerics",
    "seed": "the run's seed (+ the generator's index)",
    "reward": "task.reward",
    "keys": "endpoints.keys",
    "key_name": "endpoints.keys (one keypair per generator)",
    "curve_on_loopback": "endpoints.curve_on_loopback",
    "max_num_seqs": "generators.max_inflight x rollout.n",
    "peer_timeout_s": "transport.peer_timeout_s",
    "exit_policy": "rollout.exit_policy",
    "transport": "the transport section",
    "environment": "task.environment",
    "max_turns": "rollout.max_turns",
    "max_env_tokens": "rollout.max_env_tokens",
    "template": "task.template",
    "profile_batches": "metrics.profile_steps",
    "profile_dir": "metrics.profile_steps (RUN_DIR/profile/gen<i>)",
}


@dataclass(frozen=True)
class GeneratorsSection(GeneratorConfig):
    """The generators `looprl run` starts: how many, and their settings (every
    generator.config.GeneratorConfig key with its default there, except those the run sets
    itself: RUN_MANAGED)."""

    count: int = 1
    """Generator processes `looprl run` starts (the learner accepts any number). One by default:
    on a small host every vLLM process costs its own import and engine start (~20 CPU-s on the
    2-core host) and its own per-batch overhead."""
    threads: int = 1
    """Torch threads per generator process (OMP_NUM_THREADS) under `looprl run`."""
    extra_args: list[str] = field(default_factory=list)
    """More `looprl generator` flags, passed verbatim by `looprl run`."""
    placement: str = "process"
    """Where `looprl run` runs each generator: ``process`` (its own `looprl generator`
    process) or ``thread`` (a thread of the learner's process, the torch engine only: on a GPU
    its device work on a stream of its own at high priority, so decode and training kernels
    run at once on one card, where two processes take turns; weights over cuda_ipc are taken
    from the learner's buffer in the same process; its log lines also in logs/gen<i>.log).
    pipeline.commands.generator_threads."""
    carveout_sms: int = 0
    """With ``placement=thread`` on CUDA: streaming multiprocessors the process's cuBLAS
    matmuls leave free (torch's experimental SM carveout, process-wide), so a generator
    thread's decode kernels find SMs while the learner's persistent GEMMs run; 0: none (a
    cuBLAS GEMM then holds every SM until it ends and the decode waits for it)."""
    mps: bool | str = AUTO
    """true: `looprl run` starts a CUDA MPS control daemon of its own (pipe directory under
    /tmp, its log in RUN_DIR/logs/mps.log) before the learner touches the card, so the learner
    and its generator processes run kernels at once on one GPU instead of taking turns (the
    driver time-slices separate processes). It is used once a CUDA process has joined it (else
    stopped: refused under true, time-sliced under auto) and asked to quit at the end (it exits
    after the run's last process; a SIGKILLed run leaves it: ``echo quit |
    CUDA_MPS_PIPE_DIRECTORY=/tmp/looprl-mps-XXXX nvidia-cuda-mps-control``). A host's MPS
    daemon that already serves the run is used as it is. auto: true for generator processes
    beside a GPU learner where ``nvidia-cuda-mps-control`` is on PATH; false: time-sliced.
    `looprl learner` and `looprl generator` started by hand join a daemon the user runs.
    pipeline.commands.mps."""
    mps_percent: int = 0
    """Under MPS: the share of the GPU's SMs each generator process may use
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1-100); 0: no limit."""
    learner_mps_percent: int = 0
    """Under MPS: the share of the GPU's SMs the learner may use (1-100); 0: no limit."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ConfigError as e:  # generator.config names the bare field: name the run's key
            msg = str(e).removeprefix("generator config ")
            raise ConfigError(f"run config generators.{msg}") from None
        defaults = GeneratorConfig()
        for key, owner in RUN_MANAGED.items():
            _check(getattr(self, key) == getattr(defaults, key), f"generators.{key}",
                   getattr(self, key), f"set by looprl run from {owner}; leave it unset")  # fmt: skip
        _check(self.count >= 0, "generators.count", self.count, "must be >= 0")
        _check(self.threads >= 1, "generators.threads", self.threads, "must be >= 1")
        _check(self.placement in ("process", "thread"), "generators.placement", self.placement,
               "expected process or thread")  # fmt: skip
        _check(self.placement == "process" or not self.extra_args, "generators.extra_args",
               self.extra_args, "flags of a generator process; generators.placement=thread "
               "starts none (set the keys in the generators section)")  # fmt: skip
        _check(self.placement == "process" or self.threads == 1, "generators.threads",
               self.threads, "torch threads of a generator process; a generator thread shares "
               "the learner's (learner.threads)")  # fmt: skip
        _check(self.carveout_sms >= 0, "generators.carveout_sms", self.carveout_sms,
               "must be >= 0")  # fmt: skip
        _check(self.placement == "thread" or not self.carveout_sms, "generators.carveout_sms",
               self.carveout_sms, "needs generators.placement=thread (generator processes "
               "do not share the learner's SMs: the driver time-slices processes)")  # fmt: skip
        _check(self.mps in (AUTO, True, False), "generators.mps", self.mps,
               "expected auto, true or false")  # fmt: skip
        for key in ("mps_percent", "learner_mps_percent"):
            _check(0 <= getattr(self, key) <= 100, f"generators.{key}", getattr(self, key),
                   "expected 1-100 (a share of the SMs, in percent) or 0 (no limit)")  # fmt: skip
        _check(self.placement == "process" or self.mps in (AUTO, False), "generators.mps",
               self.mps, "MPS shares a GPU between processes; generators.placement=thread "
               "runs the generators in the learner's process")  # fmt: skip
        _check(self.placement == "process" or self.engine in ("torch", AUTO), "generators.engine",
               self.engine, "generators.placement=thread runs the torch engine only (vLLM "
               "starts engine processes of its own)")  # fmt: skip

    def generator_settings(self) -> dict[str, Any]:
        """The GeneratorConfig keys this section sets (the file `looprl run` hands to each
        generator with --config), the run-managed ones left out."""

        return {f.name: getattr(self, f.name) for f in fields(GeneratorConfig)
                if f.name not in RUN_MANAGED}  # fmt: skip


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
class TransportSection(TransportConfig):
    """pipeline.net.transport.config.TransportConfig as the run config's ``transport``
    section: the same keys, each bad value refused naming its ``transport.`` key (the base
    class's own checks stay as the backstop)."""

    def __post_init__(self) -> None:
        t = "transport."
        for key in ("max_frame_bytes", "weights_max_frame_bytes"):
            _check(getattr(self, key) >= 1024, t + key, getattr(self, key), "must be >= 1024")
        _check(self.oversize_grace_bytes >= 0, t + "oversize_grace_bytes",
               self.oversize_grace_bytes, "must be >= 0")  # fmt: skip
        _check(self.peer_timeout_s > 0, t + "peer_timeout_s", self.peer_timeout_s, "must be > 0")
        _check(0 < self.heartbeat_interval_s < self.peer_timeout_s, t + "heartbeat_interval_s",
               self.heartbeat_interval_s,
               f"needs 0 < heartbeat_interval_s < peer_timeout_s (transport.peer_timeout_s="
               f"{self.peer_timeout_s})")  # fmt: skip
        _check(self.hello_retry_max_s > 0, t + "hello_retry_max_s", self.hello_retry_max_s,
               "must be > 0")  # fmt: skip
        _check(0 < self.hello_retry_s <= self.hello_retry_max_s, t + "hello_retry_s",
               self.hello_retry_s,
               f"needs 0 < hello_retry_s <= hello_retry_max_s (transport.hello_retry_max_s="
               f"{self.hello_retry_max_s})")  # fmt: skip
        _check(self.reconnect_ivl_max_ms > 0, t + "reconnect_ivl_max_ms",
               self.reconnect_ivl_max_ms, "must be > 0")  # fmt: skip
        _check(0 < self.reconnect_ivl_ms <= self.reconnect_ivl_max_ms, t + "reconnect_ivl_ms",
               self.reconnect_ivl_ms,
               f"needs 0 < reconnect_ivl_ms <= reconnect_ivl_max_ms "
               f"(transport.reconnect_ivl_max_ms={self.reconnect_ivl_max_ms})")  # fmt: skip
        _check(self.hwm >= 1, t + "hwm", self.hwm, "must be >= 1")
        _check(0 <= self.compression_level <= 22, t + "compression_level",
               self.compression_level, "must be a zstd level in 0..22 (0: uncompressed)")  # fmt: skip
        _check(self.linger_ms >= 0, t + "linger_ms", self.linger_ms, "must be >= 0")
        _check(self.log_interval_s >= 0, t + "log_interval_s", self.log_interval_s,
               "must be >= 0")  # fmt: skip
        biggest = max(self.max_frame_bytes, self.weights_max_frame_bytes)
        need = 2 * (biggest + self.oversize_grace_bytes)
        _check(self.recv_budget_bytes >= need, t + "recv_budget_bytes", self.recv_budget_bytes,
               f"must hold two of the largest frames: >= {need} (2 x (the larger frame limit "
               f"{biggest} + transport.oversize_grace_bytes {self.oversize_grace_bytes}))")  # fmt: skip
        super().__post_init__()


@dataclass(frozen=True)
class EvalSection:
    """Evaluation during training on a dataset task's eval split (pipeline/commands/evaluation.py)."""

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
    depths: list[int] = field(default_factory=list)
    """Also evaluate each round at each of these fixed depths (a FixedDepth exit policy for
    those items, 1..255: deeper than the model's max_depth thinks longer), logged as
    eval/accuracy@d and eval/mean_depth@d beside the run's own policy (also `looprl eval`'s
    default --depths); empty: only that."""

    def __post_init__(self) -> None:
        d = self.depths
        _check(
            all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_DEPTH for x in d)
            and len(set(d)) == len(d), "eval.depths", d,
            f"must be distinct ints in [1, {MAX_DEPTH}] (fixed depths to evaluate at)",
        )  # fmt: skip
        _check(self.every >= 0, "eval.every", self.every, "must be >= 0")
        _check(self.n >= 1, "eval.n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, "must be >= 0")
        _check(self.limit >= 0, "eval.limit", self.limit, "must be >= 0")


GateObjective = Literal["entropy", "adaptive"]
"""The warm start's exit-gate stage (WarmStartSection.gate_objective)."""
GATE_OBJECTIVES: tuple[GateObjective, ...] = get_args(GateObjective)
WarmStartRows = Literal["passes", "random"]
"""How a warm-start step's rows are drawn (WarmStartSection.rows)."""
WARM_START_ROWS: tuple[WarmStartRows, ...] = get_args(WarmStartRows)
if TYPE_CHECKING:
    _GateObjectiveSetting = GateObjective
    _RowsSetting = WarmStartRows
else:  # OmegaConf 2.3 refuses a Literal annotation: a str, checked once in __post_init__
    _GateObjectiveSetting = _RowsSetting = str


@dataclass(frozen=True)
class WarmStartSection:
    """A supervised warm start before RL (`looprl sft`'s steps, run by `looprl learner` into
    RUN_DIR/init before the first step; docs/TASKS.md)."""

    segments: list[int] = field(default_factory=list)
    """Optimizer steps of each segment on the task's reference answers, from the starting
    checkpoint; each segment a fresh AdamW and a data order seeded by the steps before it
    (`looprl sft --steps S --seed <steps so far>` chained); empty: no warm start."""
    lr: float = 3e-3
    """Learning rate of the warm start's AdamW."""
    batch: int = 32
    """Examples per warm-start step (the segments' and the gate stage's)."""
    rows: _RowsSetting = "passes"
    """How a segment step's rows are drawn: passes (one shuffled pass over the train rows
    after another) or random (each step its own random draw, benchmarks/loop_credit.py's)."""
    embed_std: float = 0.0
    """Before the first segment, the starting checkpoint's input embedding scaled to this
    standard deviation (0: kept); for a fresh checkpoint of a family with an untied
    embedding (ouro, nanbeige, llama): the tiny presets' 0.02 leaves the token at ~1/6 of each
    normed block's output and the tiny Ouro learns no mixed-depth answer (docs/TASKS.md)."""
    gate_steps: int = 0
    """After the segments, AdamW steps of Ouro's exit-gate stage (pipeline.commands.exit_stages;
    Ouro only): every loop's readout trained on the reference answers; 0: none."""
    gate_objective: _GateObjectiveSetting = "entropy"
    """The gate stage's loss: entropy (Ouro's stage I: every parameter on the exit
    distribution's expected per-loop loss minus gate_beta times its entropy) or adaptive
    (stage II: the gate alone, taught whether the next loop still lowers the loss)."""
    gate_lr: float = 3e-3
    """Learning rate of the gate stage's AdamW."""
    gate_beta: float = 0.05
    """entropy: the weight of the exit distribution's entropy."""
    gate_slope: float = 50.0
    """adaptive: k of the ideal continue probability sigmoid(k (gain - gate_margin))."""
    gate_margin: float = 0.005
    """adaptive: gamma, the loss gain below which the next loop is not worth it."""
    device: str = AUTO
    """Where the warm start trains (its segments and the gate stage, in the learner's rank-0
    process before the first step): cpu, cuda or cuda:N (fp32 weights and AdamW, matmuls in
    TF32); auto: cuda on a CUDA host, cpu otherwise (pipeline.config.device)."""

    def __post_init__(self) -> None:
        _check(all(s >= 1 for s in self.segments), "warm_start.segments", self.segments,
               "every segment needs >= 1 step")  # fmt: skip
        _check(self.lr > 0, "warm_start.lr", self.lr, "must be > 0")
        _check(self.batch >= 1, "warm_start.batch", self.batch, "must be >= 1")
        _check(self.embed_std >= 0, "warm_start.embed_std", self.embed_std, "must be >= 0")
        _check(self.gate_steps >= 0, "warm_start.gate_steps", self.gate_steps, "must be >= 0")
        _check(self.rows in WARM_START_ROWS, "warm_start.rows", self.rows,
               f"must be one of {', '.join(WARM_START_ROWS)}")  # fmt: skip
        _check(self.gate_objective in GATE_OBJECTIVES, "warm_start.gate_objective",
               self.gate_objective, f"must be one of {', '.join(GATE_OBJECTIVES)}")  # fmt: skip
        _check(self.gate_lr > 0, "warm_start.gate_lr", self.gate_lr, "must be > 0")
        _check(self.gate_beta >= 0, "warm_start.gate_beta", self.gate_beta, "must be >= 0")
        _check(self.gate_slope > 0, "warm_start.gate_slope", self.gate_slope, "must be > 0")
        _check(math.isfinite(self.gate_margin) and self.gate_margin >= 0, "warm_start.gate_margin",
               self.gate_margin, "must be a finite number >= 0")  # fmt: skip
        _check(self.device in (AUTO, "cpu", "cuda") or bool(re.fullmatch(r"cuda:\d+", self.device)),
               "warm_start.device", self.device, "must be auto, cpu, cuda or cuda:N")  # fmt: skip
        _check(not (self.embed_std or self.gate_steps) or bool(self.segments),
               "warm_start.segments", self.segments,
               "embed_std and gate_steps are parts of a warm start: give it >= 1 segment")  # fmt: skip
