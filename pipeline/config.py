"""``RunConfig``: the settings of one training run (learner, generators, launcher, replay).

Precedence: schema defaults < the YAML file (``--config FILE``) < ``key=value`` overrides
(dotted keys, e.g. ``rollout.n=4 objective.kind=ppo``). OmegaConf merges; the frozen
dataclasses (the sections in pipeline.config_sections, composed by ``RunConfig`` here) are the
schema and the only place defaults live. An unknown key, a value
of the wrong type or an out-of-range value is a :class:`ConfigError` naming the key.
The defaults ARE the quickstart (configs/quickstart.yaml repeats them; a test checks that).
Each component receives only its own section (``cfg.rollout``, ``cfg.staleness``, ...).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from models.contract import NUMERICS
from models.errors import ConfigError
from pipeline.config_sections import (  # noqa: F401  (the sections are part of this API)
    FSYNC,
    OBJECTIVES,
    POLICIES,
    TASKS,
    WEIGHT_TRANSPORTS,
    CheckpointSection,
    EndpointsSection,
    EvalSection,
    GeneratorsSection,
    IntakeSection,
    LearnerSection,
    MetricsSection,
    ModelSection,
    ObjectiveSection,
    OptimizerSection,
    PublishSection,
    RecordSection,
    RolloutSection,
    StalenessSection,
    TaskSection,
    _check,
)

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
    model: ModelSection = field(default_factory=ModelSection)
    """Starting checkpoint."""
    task: TaskSection = field(default_factory=TaskSection)
    """Prompts and reward."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Sampling settings."""
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    """Policy objective."""
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """Optimizer."""
    staleness: StalenessSection = field(default_factory=StalenessSection)
    """Staleness bound and policy."""
    intake: IntakeSection = field(default_factory=IntakeSection)
    """Rollout validation at the learner's door."""
    generators: GeneratorsSection = field(default_factory=GeneratorsSection)
    """Generator processes."""
    endpoints: EndpointsSection = field(default_factory=EndpointsSection)
    """Learner endpoints."""
    publish: PublishSection = field(default_factory=PublishSection)
    """Weight publication."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints."""
    record: RecordSection = field(default_factory=RecordSection)
    """Rollout stream and step log."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Metrics outputs."""
    learner: LearnerSection = field(default_factory=LearnerSection)
    """Learner precision, truncated depth backprop, micro-batching, recompute, compile."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Evaluation during training (dataset tasks)."""

    def schedule(self) -> Any:
        """The LR schedule both backends apply (learner.config.ScheduleConfig): updates are
        counted over the run (steps x epochs x minibatches)."""
        from learner.config import ScheduleConfig

        p, o = self.optimizer, self.objective
        total = p.decay_steps or self.steps * o.epochs * o.minibatches
        return ScheduleConfig(style=p.schedule, warmup_steps=p.warmup_steps,
                              total_steps=max(total, p.warmup_steps + 1), min_lr=p.min_lr)  # fmt: skip

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(self.backend in BACKENDS, "backend", self.backend, f"must be one of {BACKENDS}")
        _check(self.numerics in NUMERICS, "numerics", self.numerics, f"one of {NUMERICS}")
        _check(self.tp >= 1, "tp", self.tp, "must be >= 1")
        _check(self.max_wait_s > 0, "max_wait_s", self.max_wait_s, "must be > 0")
        _check(self.staleness.policy != "keep" or self.objective.is_cap is not None,
               "staleness.policy", self.staleness.policy,
               "keep trains stale rollouts, which needs an off-policy correction: set "
               "objective.is_cap (e.g. 2.0), applied by both backends")  # fmt: skip
        _check(self.rollout.top_p == 1.0 or self.tp == 1 or self.backend == "reference",
               "rollout.top_p", self.rollout.top_p,
               "< 1 needs the whole vocabulary on one rank: the megatron learner supports it "
               "at tp=1 only")  # fmt: skip
        _check(self.objective.overlong_buffer <= self.rollout.max_tokens,
               "objective.overlong_buffer", self.objective.overlong_buffer,
               f"must be <= rollout.max_tokens ({self.rollout.max_tokens})")  # fmt: skip
        _check(self.rollout.prompts_per_step % self.objective.minibatches == 0,
               "objective.minibatches", self.objective.minibatches,
               f"must divide rollout.prompts_per_step ({self.rollout.prompts_per_step}): a "
               "mini-batch holds whole groups")  # fmt: skip
        lr = self.learner
        if self.numerics == "exact":  # exact keeps its own rules: fp32, its own kernels
            _check(lr.precision == "fp32", "learner.precision", lr.precision,
                   "numerics=exact needs fp32")  # fmt: skip
            _check(not lr.compile, "learner.compile", lr.compile, "numerics=exact needs False")
        if self.backend == "reference":  # rule: every key honoured by every backend or refused
            for key, value, default in (
                ("precision", lr.precision, "fp32"), ("micro_batch_size", lr.micro_batch_size, 0),
                ("recompute", lr.recompute, False), ("compile", lr.compile, False),
            ):  # fmt: skip
                _check(value == default, f"learner.{key}", value,
                       f"backend=reference does not implement it (use {default!r} or megatron)")  # fmt: skip
            _check(lr.backprop_depth in (-1, 0), "learner.backprop_depth", lr.backprop_depth,
                   "backend=reference backpropagates through every iteration (use 0 or megatron)")  # fmt: skip
        _check(not self.eval.every or self.task.kind == "dataset", "eval.every", self.eval.every,
               "needs task.kind=dataset (an eval split)")  # fmt: skip


# -- loading ----------------------------------------------------------------------------------
def field_docs(cls: type = RunConfig, prefix: str = "") -> dict[str, str]:
    """{dotted key: its one-line docstring} for every field, nested sections included."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = str(b.value.value)
    out: dict[str, str] = {}
    for f in fields(cls):
        key = prefix + f.name
        out[key] = docs.get(f.name, "")
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(default):
            out.update(field_docs(type(default), key + "."))
    return out


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict (values parsed as YAML scalars / lists)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)))  # type: ignore[return-value]
    except Exception as e:
        raise ConfigError(f"bad override in {list(items)}: expected key=value ({e})") from None


def _writable(node: Any) -> Any:
    """Clear the read-only flag OmegaConf < 2.4 puts on every node of a frozen dataclass
    (merging a file or override into one then fails: "Cannot set value of read-only config
    node"); the dataclasses built at the end stay frozen."""
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node:
            child = node[key]
            if OmegaConf.is_config(child):
                _writable(child)
    return node


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
) -> RunConfig:
    """Defaults < YAML at ``path`` < ``overrides`` (``key=value`` strings or a nested dict)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    layers: list[Any] = [_writable(OmegaConf.structured(RunConfig))]
    where = "defaults"
    try:
        if path is not None:
            where = str(path)
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"run config file {p} not found")
            loaded = OmegaConf.load(p)
            if not OmegaConf.is_dict(loaded):
                raise ConfigError(f"{p}: expected a mapping of run settings at top level")
            layers.append(loaded)
        merged = OmegaConf.merge(*layers)
        if overrides:
            where = "overrides"
            given = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
            merged = OmegaConf.merge(merged, OmegaConf.create(dict(given)))
        obj = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        key = getattr(e, "full_key", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"{where}: unknown run config key {key!r} (see docs/PIPELINE.md for the keys)"
        ) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "")
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        msg = str(cause) if cause else str(e).splitlines()[0]
        raise ConfigError(f"{where}: run config {key}: {msg}") from None
    assert isinstance(obj, RunConfig)
    return obj


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML (written to RUN_DIR/config.yaml)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
