"""Every file in configs/ loads against the run schema; the quickstart equals the defaults;
every field has a docstring; bad keys and values are errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, field_docs, load_config

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
