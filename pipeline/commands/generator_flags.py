"""The generator a run asks for, as a ``GeneratorConfig`` and as ``looprl generator`` flags.

One mapping from the run config to a generator's settings, used by ``looprl run`` (the
processes it starts) and by the learner (the command it prints for generators started by
hand): the ``generators`` section's own keys, and the run-managed keys
(``pipeline.config.sections.RUN_MANAGED``) taken from the sections that own them. The flags are
derived from the config class (``config_argv``: every key that differs from the
``GeneratorConfig`` default, under the name ``looprl generator`` parses), so parsing them back
gives the same config (tests/configs/test_configs.py checks the round trip).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from generator.config import GeneratorConfig, exit_policy_arg
from models.errors import ConfigError
from pipeline.commands.generator_cli import flag_name
from pipeline.config.run import RunConfig
from pipeline.config.sections import RUN_MANAGED
from pipeline.net.security import generator_keys
from pipeline.net.transport.config import TransportConfig

ALWAYS = ("learner", "weights_endpoint", "model", "reward", "numerics", "dtype")
"""Keys written even at their default: what a reader of the command line looks for first."""


def generator_config(cfg: RunConfig, control: str, weights: str, model: Path,
                     index: int | None = None) -> GeneratorConfig:  # fmt: skip
    """Generator `index` of this run (gen0, gen1, ...: its id, seed and keypair), or with
    index None the generator a user starts by hand (its id, seed and keypair left to them;
    with several keypairs the key name is a NAME placeholder)."""

    g, e = cfg.generators, cfg.endpoints
    key_name = ""
    if e.keys:
        names = generator_keys(e.keys)
        if index is not None and len(names) < g.count:
            raise ConfigError(
                f"endpoints.keys {e.keys}: {len(names)} generator keypairs for generators.count="
                f"{g.count}; add some with `looprl keys {e.keys} --add -n {g.count - len(names)}`"
            )
        if index is not None:
            key_name = names[index]
        elif len(names) != 1:  # one keypair: the generator finds it itself
            key_name = "|".join(names) or "NAME"
    p = cfg.metrics.profile_steps  # the generator's batches, a batch a step (its own files)
    profile = f"{p[0]}:{p[1]}" if p and index is not None else ""
    profile_dir = str(Path(cfg.run_dir) / "profile" / f"gen{index}") if profile else ""
    managed: dict[str, Any] = {
        "learner": control,
        "weights_endpoint": weights,
        "model": str(model),
        "generator_id": f"gen{index}" if index is not None else "",
        "numerics": cfg.numerics,
        "seed": cfg.seed + index if index is not None else GeneratorConfig.seed,
        "reward": cfg.task.reward,
        "keys": e.keys,
        "key_name": key_name,
        "curve_on_loopback": bool(e.keys) and e.curve_on_loopback,
        "max_num_seqs": max(1, g.max_inflight * cfg.rollout.n),
        "peer_timeout_s": cfg.transport.peer_timeout_s,
        "exit_policy": cfg.rollout.parsed_policy,
        "transport": _transport_json(cfg.transport),
        "environment": cfg.task.environment,
        "max_turns": cfg.rollout.max_turns,
        "max_env_tokens": cfg.rollout.max_env_tokens,
        "template": cfg.task.template,
        "profile_batches": profile,
        "profile_dir": profile_dir,
    }
    if managed.keys() != RUN_MANAGED.keys():  # a new run-managed key needs its source here
        raise RuntimeError(f"generator_config sets {sorted(managed)}, RUN_MANAGED names "
                           f"{sorted(RUN_MANAGED)}")  # fmt: skip
    own = {k: v for k, v in g.generator_settings().items() if k != "dtype"}
    return GeneratorConfig(**own, dtype=_dtype(cfg), **managed)


def config_argv(gen: GeneratorConfig, always: tuple[str, ...] = ALWAYS) -> list[str]:
    """``looprl generator`` flags giving `gen`: each key that differs from the default (and
    the `always` ones), in the class's field order."""

    out: list[str] = []
    default = GeneratorConfig()
    for f in dataclasses.fields(GeneratorConfig):
        value = getattr(gen, f.name)
        if value == getattr(default, f.name) and f.name not in always:
            continue
        name = flag_name(f.name)
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name.removeprefix("--"))
        elif f.name == "exit_policy":  # the policy as the flag's text, parsed back at load
            out += [name, exit_policy_arg(value)]
        else:
            out += [name, str(value)]
    return out


def _transport_json(t: TransportConfig) -> str:
    """The transport settings a generator must share, as its --transport JSON: every one that
    differs from its default except peer_timeout_s (its own flag); "" when none does."""

    default = TransportConfig()
    extra = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)
             if f.name != "peer_timeout_s" and getattr(t, f.name) != getattr(default, f.name)}  # fmt: skip
    return json.dumps(extra, sort_keys=True) if extra else ""


def _dtype(cfg: RunConfig) -> str:
    """generators.dtype; auto follows the published weights (bfloat16 under learner.precision
    bf16; otherwise the generator's own auto rule)."""

    if cfg.generators.dtype != "auto":
        return cfg.generators.dtype
    return "bfloat16" if cfg.learner.precision == "bf16" and cfg.numerics == "fast" else "auto"
