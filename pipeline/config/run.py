"""``RunConfig``: the settings of one training run (learner, generators, launcher, replay).

Precedence: schema defaults < the YAML file (``--config FILE``) < ``key=value`` overrides
(dotted keys, e.g. ``rollout.n=4 objective.kind=ppo``). OmegaConf merges; the frozen
dataclasses (the sections in pipeline.config.sections, composed by ``RunConfig`` here) are the
schema and the only place defaults live. An unknown key, a value
of the wrong type or an out-of-range value is a :class:`ConfigError` naming the key.
The defaults ARE the quickstart (configs/quickstart.yaml repeats them; a test checks that).
Each component receives only its own section (``cfg.rollout``, ``cfg.staleness``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from learner.config import LearnerConfig, OptimConfig, ScheduleConfig
from learner.objective_config import ObjectiveConfig
from models import settings
from models.errors import ConfigError
from models.exits import is_sampled, policy_kind
from models.numerics import MODES
from models.settings import parse_overrides
from pipeline.config import device as device_defaults
from pipeline.config.outputs import (
    COLLECTIVE,
    CheckpointSection,
    MetricsSection,
    PublishSection,
    RecordSection,
)
from pipeline.config.sections import (
    ADAPTIVE_EXITS,
    SEED_LIMIT,
    EndpointsSection,
    EvalSection,
    GeneratorsSection,
    IntakeSection,
    ModelSection,
    RolloutSection,
    StalenessSection,
    TaskSection,
    TransportSection,
    WarmStartSection,
    _check,
)
from pipeline.net.transport.config import TransportConfig

BACKENDS = ("auto", "megatron", "reference")


@dataclass(frozen=True)
class RunConfig:
    """One training run; see docs/PIPELINE.md for the reference."""

    run_dir: str = "runs/quickstart"
    """Run directory: checkpoints, weights, stream, metrics, logs."""
    steps: int = 120
    """Training steps to run."""
    seed: int = 0
    """Run seed: latent seeds, prompt order, learner RNG."""
    backend: str = "auto"
    """Trainer: megatron (learner.trainer), reference (pure PyTorch), auto (megatron if present)."""
    tp: int = 1
    """Tensor-parallel size (megatron backend)."""
    numerics: str = "fast"
    """fast or exact (bit-exact generator/learner log-probs), shared with the generators."""
    max_wait_s: float = 600.0
    """Give up (error) when no training step happens for this long (s)."""
    min_generators: int = 1
    """The learner's first training step waits until this many generators have registered
    (their rollouts are buffered meanwhile; later steps train on whoever serves); up to
    max_wait_s, then an error naming who did. `looprl run` refuses more than generators.count."""
    model: ModelSection = field(default_factory=ModelSection)
    """Starting checkpoint."""
    task: TaskSection = field(default_factory=TaskSection)
    """Prompts and reward."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Sampling settings."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """Policy objective, advantages and critic (learner.config)."""
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer (learner.config)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule (learner.config)."""
    staleness: StalenessSection = field(default_factory=StalenessSection)
    """Staleness bound and policy."""
    intake: IntakeSection = field(default_factory=IntakeSection)
    """Rollout validation at the learner's door."""
    generators: GeneratorsSection = field(default_factory=GeneratorsSection)
    """Generator processes."""
    endpoints: EndpointsSection = field(default_factory=EndpointsSection)
    """Learner endpoints."""
    transport: TransportConfig = field(default_factory=TransportSection)
    """Both channels' settings (pipeline.net.transport.config), the same on the generators."""
    publish: PublishSection = field(default_factory=PublishSection)
    """Weight publication."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints."""
    record: RecordSection = field(default_factory=RecordSection)
    """Rollout stream and step log."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Metrics outputs."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Learner precision, truncated depth backprop, micro-batching, recompute, compile."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Evaluation during training (dataset tasks)."""
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    """Supervised warm start before RL (dataset tasks with an answer column)."""

    @property
    def device_choices(self) -> list[str]:
        """The auto keys this config resolved when it was built, one line each with why
        (pipeline.config.device); empty when none was auto (e.g. a recorded config)."""
        return list(getattr(self, "_device_choices", []))

    def work_timeout_s(self) -> float:
        """intake.work_timeout_s, or half of max_wait_s where it is unset (0: never)."""
        t = self.intake.work_timeout_s
        return self.max_wait_s / 2 if t is None else t

    def resolved_schedule(self) -> ScheduleConfig:
        """The LR schedule both backends apply: schedule.decay_steps 0 is the run's last
        update (updates are counted over the run: steps x epochs x minibatches)."""
        return self.schedule.resolved(
            self.steps * self.objective.epochs * self.objective.minibatches
        )

    def __post_init__(self) -> None:
        if type(self.transport) is not TransportConfig:  # TransportSection checked each key:
            plain = TransportConfig(**vars(self.transport))  # the plain class every end compares
            object.__setattr__(self, "transport", plain)
        _check(self.backend in BACKENDS, "backend", self.backend, f"must be one of {BACKENDS}")
        _check(self.numerics in MODES, "numerics", self.numerics, f"one of {MODES}")
        # the auto keys, chosen for this host before the checks below see them
        chosen, why = device_defaults.resolve(self)
        for section, values in chosen.items():
            object.__setattr__(self, section, replace(getattr(self, section), **values))
        if why:
            object.__setattr__(self, "_device_choices", why)
        for key in ("mps_percent", "learner_mps_percent"):
            _check(self.generators.mps is True or not getattr(self.generators, key),
                   f"generators.{key}", getattr(self.generators, key),
                   f"a share of the SMs under MPS; generators.mps is {str(self.generators.mps).lower()}")  # fmt: skip
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(0 <= self.seed < SEED_LIMIT, "seed", self.seed, "must be in [0, 2**32)")
        _check(self.tp >= 1, "tp", self.tp, "must be >= 1")
        _check(self.max_wait_s > 0, "max_wait_s", self.max_wait_s, "must be > 0")
        _check(self.min_generators >= 1, "min_generators", self.min_generators, "must be >= 1")
        _check(self.work_timeout_s() < self.max_wait_s, "intake.work_timeout_s",
               self.intake.work_timeout_s, f"must be < max_wait_s ({self.max_wait_s:g}): work a "
               "peer holds is re-issued before the run gives up waiting for a step")  # fmt: skip
        _check(self.publish.transport != COLLECTIVE
               or self.publish.collective_timeout_s < self.transport.peer_timeout_s,
               "publish.collective_timeout_s", self.publish.collective_timeout_s,
               f"must be < transport.peer_timeout_s ({self.transport.peer_timeout_s}): a "
               "generator's loop waits in the broadcast")  # fmt: skip
        _check(not self.publish.chunked
               or self.publish.chunk_bytes <= self.transport.weights_max_frame_bytes,
               "publish.chunk_bytes", self.publish.chunk_bytes,
               f"must be <= transport.weights_max_frame_bytes "
               f"({self.transport.weights_max_frame_bytes}): a generator refuses larger frames")  # fmt: skip
        _check(self.schedule.min_lr <= self.optimizer.lr, "schedule.min_lr", self.schedule.min_lr,
               f"must be <= optimizer.lr ({self.optimizer.lr})")  # fmt: skip
        _check(self.staleness.policy != "keep" or self.objective.is_cap is not None,
               "staleness.policy", self.staleness.policy,
               "keep trains stale rollouts, which needs an off-policy correction: set "
               "objective.is_cap (e.g. 2.0), applied by both backends")  # fmt: skip
        _check(self.rollout.top_p == 1.0 or self.tp == 1 or self.backend == "reference",
               "rollout.top_p", self.rollout.top_p,
               "< 1 needs the whole vocabulary on one rank: the megatron learner supports it "
               "at tp=1 only")  # fmt: skip
        _check(not self.objective.dynamic_sampling or self.rollout.n >= 2,
               "objective.dynamic_sampling", self.objective.dynamic_sampling,
               f"needs rollout.n >= 2 (got rollout.n={self.rollout.n}): it drops groups whose "
               "rewards are all equal, and a group of one sample always is, so no batch would "
               "ever form")  # fmt: skip
        _check(self.objective.overlong_buffer <= self.rollout.max_tokens,
               "objective.overlong_buffer", self.objective.overlong_buffer,
               f"must be <= rollout.max_tokens ({self.rollout.max_tokens})")  # fmt: skip
        _check(self.rollout.prompts_per_step % self.objective.minibatches == 0,
               "objective.minibatches", self.objective.minibatches,
               f"must divide rollout.prompts_per_step ({self.rollout.prompts_per_step}): a "
               "mini-batch holds whole groups")  # fmt: skip
        lr = self.learner
        per_update = self.rollout.prompts_per_step * self.rollout.n // self.objective.minibatches
        _check(not lr.micro_batch_size or per_update % lr.micro_batch_size == 0,
               "learner.micro_batch_size", lr.micro_batch_size,
               f"must divide the rollouts of an update ({per_update}: rollout.prompts_per_step x "
               "rollout.n / objective.minibatches)")  # fmt: skip
        if lr.max_tokens_per_micro:  # packed rows: micro-batches sized by tokens
            _check(not lr.micro_batch_size, "learner.max_tokens_per_micro",
                   lr.max_tokens_per_micro,
                   f"packed micro-batches are sized by tokens: leave learner.micro_batch_size "
                   f"0 (got {lr.micro_batch_size})")  # fmt: skip
        if self.numerics == "exact":  # exact keeps its own rules: fp32, its own kernels
            _check(lr.precision == "fp32", "learner.precision", lr.precision,
                   "numerics=exact needs fp32")  # fmt: skip
            _check(not lr.compile, "learner.compile", lr.compile, "numerics=exact needs False")
        if lr.lora.on:  # low-rank adapters (docs/LEARNER.md "LoRA")
            _check(not lr.lora.dropout, "learner.lora.dropout", lr.lora.dropout,
                   "both backends train through the merged weight W + (alpha / rank) B A, "
                   "where input dropout has no place: use 0")  # fmt: skip
            _check(self.tp == 1, "tp", self.tp,
                   "learner.lora: the megatron backend trains adapters at tp 1 only")  # fmt: skip
        _check(lr.lora.publish == "merged" or self.publish.transport not in ("zmq", COLLECTIVE),
               "publish.transport", self.publish.transport,
               "learner.lora.publish=adapters names the adapter set's directory: use shared_fs, "
               "shm or cuda_ipc (or learner.lora.publish=merged)")  # fmt: skip
        if self.publish.directories == "when_free":  # a version on the device only
            _check(self.publish.transport == "cuda_ipc", "publish.directories", "when_free",
                   f"needs publish.transport cuda_ipc (got {self.publish.transport}): only a "
                   "version on the learner's GPU can be announced without its directory")  # fmt: skip
            _check(self.backend != "reference", "publish.directories", "when_free",
                   "backend reference keeps its weights on the host: use every")  # fmt: skip
        if self.backend == "reference":  # rule: every key honoured by every backend or refused
            for key, value, default in (
                ("precision", lr.precision, "fp32"), ("recompute", lr.recompute, False),
                ("compile", lr.compile, False),
            ):  # fmt: skip
                _check(value == default, f"learner.{key}", value,
                       f"backend=reference does not implement it (use {default!r} or megatron)")  # fmt: skip
            _check(lr.backprop_depth in (-1, 0), "learner.backprop_depth", lr.backprop_depth,
                   "backend=reference backpropagates through every iteration (use 0 or megatron)")  # fmt: skip
        _check(not self.warm_start.segments or (self.task.kind == "dataset"
                                                  and bool(self.task.answer_column)),
               "warm_start.segments", self.warm_start.segments,
               "needs task.kind=dataset with task.answer_column (the reference answers)")  # fmt: skip
        _check(not self.warm_start.gate_steps or bool(self.model.path)
               or self.model.family == "ouro", "warm_start.gate_steps", self.warm_start.gate_steps,
               f"needs a family with an exit gate read on its state (ouro), not "
               f"model.family={self.model.family} (set 0)")  # fmt: skip
        _check(not self.eval.every or self.task.kind == "dataset", "eval.every", self.eval.every,
               "needs task.kind=dataset (an eval split)")  # fmt: skip
        policy = self.rollout.parsed_policy
        kind = policy_kind(policy) if policy is not None else None
        _check(not self.task.environment or not isinstance(policy, ADAPTIVE_EXITS),
               "rollout.exit_policy", dict(self.rollout.exit_policy),
               f"an adaptive exit ({kind}) cannot be combined with task.environment "
               f"({self.task.environment}): the next turn's prefill recomputes earlier model "
               "tokens at full depth, so one replay pass would not reproduce the sampled "
               "log-probs (docs/PROTOCOL.md); use kind fixed or no exit policy")  # fmt: skip
        for key in ("exit_coef", "exit_entropy_coef"):
            _check(getattr(self.objective, key) == 0 or is_sampled(policy),
                   f"objective.{key}", getattr(self.objective, key),
                   "trains a sampled exit: needs rollout.exit_policy kind sampled_gate")  # fmt: skip
        _check(not is_sampled(policy) or not self.task.environment, "rollout.exit_policy",
               dict(self.rollout.exit_policy),
               f"kind sampled_gate cannot be combined with task.environment "
               f"({self.task.environment}): a conversation's exits are not recorded per turn")  # fmt: skip


# -- loading (models.settings: the one loader of every component config) -------------------
def field_docs(cls: type = RunConfig, prefix: str = "") -> dict[str, str]:
    """{dotted key: its one-line docstring} for every field, nested sections included."""
    return settings.field_docs(cls, prefix)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file at ``path``; ConfigError (one line: file, line, column,
    what is wrong) when it is missing, not YAML, or not a mapping."""

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"run config file {p} not found")
    try:
        loaded = OmegaConf.load(p)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(e)}") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"{p}: expected a mapping of run config keys at top level")
    out: dict[str, Any] = OmegaConf.to_container(loaded)  # type: ignore[assignment]
    return out


def _yaml_problem(e: Exception) -> str:
    """A YAML parse error as one line: the problem, where, and the construct it was in."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    at = getattr(e, "problem_mark", None)
    out = problem + (f" (line {at.line + 1}, column {at.column + 1})" if at is not None else "")
    ctx, mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if ctx:
        out += f", {ctx}" + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark else "")
    return " ".join(out.split())


def parse_overrides_line(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings as a nested dict; ConfigError naming the first bad one."""

    for item in items:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value (e.g. rollout.n=4)")
        try:
            OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, ValueError) as e:
            why = _yaml_problem(e) if isinstance(e, yaml.YAMLError) else " ".join(str(e).split())
            raise ConfigError(f"override {item!r}: the value of {key} is not valid YAML ({why})"
                              ) from None  # fmt: skip
        except Exception as e:  # OmegaConf's own grammar errors
            raise ConfigError(f"override {item!r}: {' '.join(str(e).split())}") from None
    return parse_overrides(items)


def check_sections(layer: Mapping[str, Any], where: str, cls: type = RunConfig,
                   prefix: str = "") -> None:  # fmt: skip
    """ConfigError (naming the key) where ``layer`` gives a section (a nested dataclass of the
    schema) something other than a mapping, e.g. ``rollout: 5``."""
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in layer:
            continue
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if not is_dataclass(default):
            continue
        key, value = prefix + f.name, layer[f.name]
        if not isinstance(value, Mapping):
            first = fields(default)[0]  # type: ignore[arg-type]
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(
                f"{where}: {key}: got {shown} ({type(value).__name__}), but {key} is a section: "
                f"give it a mapping of its keys, e.g. `{key}: {{{first.name}: "
                f"{getattr(default, first.name)!r}}}` or {key}.{first.name}=... "
                "(docs/PIPELINE.md lists them)"
            )
        check_sections(value, where, type(default), key + ".")


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> RunConfig:
    """Defaults < YAML at ``path`` < ``overrides`` (``key=value`` strings or a nested dict).
    Every failure is one line (ConfigError) naming the file or override and the key."""
    if path is not None:
        check_sections(read_yaml(path), str(path))
    if overrides:
        given = overrides if isinstance(overrides, Mapping) else parse_overrides_line(overrides)
        check_sections(given, "overrides")
        overrides = given
    return settings.load(RunConfig, path, overrides, what="run config",
                         keys_hint="see docs/PIPELINE.md for the keys")  # fmt: skip


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML (written to RUN_DIR/config.yaml)."""
    return settings.to_yaml(cfg)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return settings.to_dict(cfg)
