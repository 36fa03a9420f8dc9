"""Every file in configs/ loads against the run schema; the quickstart equals the defaults;
every field has a docstring; bad keys and values are errors naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.config.run import RunConfig, field_docs, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"quickstart", "grpo", "ppo", "dppo", "flow_dppo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_starts_with_its_command(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# looprl ") and path.name in first


def test_quickstart_is_the_schema_defaults() -> None:
    assert load_config(CONFIGS[[p.stem for p in CONFIGS].index("quickstart")]) == RunConfig()


def test_objective_configs_pick_their_objective() -> None:
    for p in CONFIGS:
        if p.stem in ("grpo", "ppo", "dppo", "flow_dppo"):
            assert load_config(p).objective.kind == p.stem


def test_every_field_documented() -> None:
    docs = field_docs()
    assert len(docs) > 60
    assert not [k for k, v in docs.items() if not v.strip()]


def test_unknown_keys_and_bad_values_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: 8\n")
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(bad)
    with pytest.raises(ConfigError, match="staleness.polcy"):
        load_config(None, ["staleness.polcy=keep"])
    with pytest.raises(ConfigError, match="objective.kind"):
        load_config(None, ["objective.kind=sac"])
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, ["rollout.n=many"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_layer_on_the_file(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("steps: 7\nrollout:\n  n: 4\n")
    cfg = load_config(f, ["rollout.n=2", "objective.is_cap=1.5"])
    assert (cfg.steps, cfg.rollout.n, cfg.objective.is_cap) == (7, 2, 1.5)
    assert cfg.rollout.max_tokens == RunConfig().rollout.max_tokens


def test_reference_tables_in_the_docs_are_generated_from_the_schemas() -> None:
    """docs/PIPELINE.md and docs/GENERATOR.md hold models.settings.reference_table of the run
    and generator configs verbatim (`python scripts/config_docs.py` regenerates them)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "scripts" / "config_docs.py"), "--check"],
                         capture_output=True, text=True, cwd=root)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = (root / "docs" / "PIPELINE.md").read_text()
    for key in ("objective.epochs", "optimizer.grad_clip", "schedule.decay_steps",
                "generators.kv_cache_mb", "learner.precision"):  # fmt: skip
        assert f"| `{key}` |" in text


def test_each_default_is_stated_once_by_its_component() -> None:
    """The run config composes the components' own classes: its defaults are theirs."""
    from generator.config import GeneratorConfig, for_this_host
    from learner.config import LearnerConfig, OptimConfig, ScheduleConfig
    from learner.objective_config import ObjectiveConfig
    from models.sampling import Sampling

    cfg = RunConfig()
    assert type(cfg.objective) is ObjectiveConfig and type(cfg.optimizer) is OptimConfig
    assert type(cfg.schedule) is ScheduleConfig and type(cfg.learner) is LearnerConfig
    assert isinstance(cfg.rollout, Sampling) and isinstance(cfg.generators, GeneratorConfig)
    # the auto keys as both resolve them on this (CPU) host
    gen, _ = for_this_host(GeneratorConfig())
    for key in ("max_inflight", "reward_mode", "max_model_len", "peer_timeout_s", "dtype"):
        assert getattr(cfg.generators, key) == getattr(gen, key)


def test_generators_section_reaches_the_generators_or_is_refused(tmp_path: Path) -> None:
    """Every generator key of the run config reaches the generators `looprl run` starts (as
    flags of their command line); the keys the run sets itself are refused, naming the run
    key that sets them."""
    import argparse

    from pipeline.commands.generator_cli import add_parser, config_from_args
    from pipeline.commands.launcher import generator_command

    cfg = load_config(None, ["generators.kv_cache_mb=96", "generators.reward_timeout_s=3.5",
                             "generators.max_inflight=3", "generators.inflight_updates=true",
                             "generators.reward_mode=process", "transport.peer_timeout_s=7",
                             "transport.weights_max_frame_bytes=134217728"])  # fmt: skip
    cmd = generator_command(cfg, 1, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", tmp_path / "m")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    gen = config_from_args(parser.parse_args(cmd[cmd.index("generator") :]))
    got = (gen.kv_cache_mb, gen.reward_timeout_s, gen.max_inflight, gen.inflight_updates)
    assert got == (96, 3.5, 3, True) and gen.reward_mode == "process"
    assert gen.max_num_seqs == 3 * cfg.rollout.n and gen.seed == cfg.seed + 1
    from pipeline.commands.generator_cli import transport_config

    assert transport_config(gen) == cfg.transport  # both ends, the same transport settings
    from pipeline.commands.generator_flags import generator_config

    # the flags are derived from the config class: parsed back, the very config the run meant,
    # for the processes `looprl run` starts and for the command the learner prints
    meant = generator_config(cfg, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", tmp_path / "m", 1)
    assert gen == meant and meant.generator_id == "gen1" and meant.transport
    from pipeline.commands.learner_main import generator_hint

    hint = generator_hint(cfg, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", tmp_path / "m")
    import shlex

    printed = shlex.split(hint.splitlines()[1])
    assert printed[:2] == ["looprl", "generator"]
    by_hand = config_from_args(parser.parse_args(printed[1:]))
    assert by_hand == dataclasses.replace(meant, generator_id="", seed=0)
    assert cfg.transport.peer_timeout_s == 7 and cfg.transport.weights_max_frame_bytes == 1 << 27
    with pytest.raises(ConfigError, match="generators.peer_timeout_s=5.0: set by looprl run"):
        load_config(None, ["generators.peer_timeout_s=5"])
    with pytest.raises(ConfigError, match="heartbeat_interval_s < peer_timeout_s"):
        load_config(None, ["transport.heartbeat_interval_s=20"])
    with pytest.raises(
        ConfigError, match="generators.seed=7: set by looprl run from the run's seed"
    ):
        load_config(None, ["generators.seed=7"])
    with pytest.raises(ConfigError, match="generators.reward=.*task.reward"):
        load_config(None, ["generators.reward=math"])


def test_publish_transport_is_one_of_the_named_transports() -> None:
    """publish.transport: a Literal of the transports in the schema, its values named once
    (pipeline.config.outputs) and compared by name; the former names map to theirs; a bad one
    is refused naming the key; the YAML value stays a string."""
    import typing

    from pipeline.config.outputs import (
        COLLECTIVE,
        CUDA_IPC,
        SHARED_FS,
        SHM,
        WEIGHT_TRANSPORTS,
        ZMQ,
        WeightTransport,
    )
    from pipeline.config.run import to_yaml

    assert (
        WEIGHT_TRANSPORTS
        == typing.get_args(WeightTransport)
        == (SHARED_FS, SHM, ZMQ, COLLECTIVE, CUDA_IPC)
    )
    for given, named, chunked in (("shared_fs", SHARED_FS, False), ("disk", SHARED_FS, False),
                                  ("shm", SHM, False), ("zmq", ZMQ, True), ("chunks", ZMQ, True),
                                  ("collective", COLLECTIVE, True),
                                  ("cuda_ipc", CUDA_IPC, False)):  # fmt: skip
        cfg = load_config(None, [f"publish.transport={given}"])
        assert cfg.publish.transport == named and cfg.publish.chunked is chunked
        assert f"\n  transport: {named}\n" in to_yaml(cfg)
    with pytest.raises(ConfigError, match=r"publish.transport='nfs': must be one of \('shared_fs'"):
        load_config(None, ["publish.transport=nfs"])
