"""Multi-turn conversations at the door (issue 26 item 4) and their run-config keys
(task.environment, rollout.max_turns, rollout.max_env_tokens; docs/PROTOCOL.md 1.6)."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config


# -- the run-config keys ------------------------------------------------------------------
def test_multiturn_keys_defaults_and_bounds() -> None:
    cfg = load_config()
    assert (cfg.task.environment, cfg.rollout.max_turns, cfg.rollout.max_env_tokens) == ("", 8, 512)
    cfg = load_config(overrides=["task.environment=my_pkg.games:Guess", "rollout.max_turns=3",
                                 "rollout.max_env_tokens=40"])  # fmt: skip
    assert (cfg.task.environment, cfg.rollout.max_turns, cfg.rollout.max_env_tokens) == (
        "my_pkg.games:Guess", 3, 40)  # fmt: skip
    for bad, key in (("task.environment=my_pkg.games", "task.environment"),
                     ("task.environment=a b:C", "task.environment"),
                     ("task.environment=pkg:", "task.environment"),
                     ("rollout.max_turns=0", "rollout.max_turns"),
                     ("rollout.max_env_tokens=0", "rollout.max_env_tokens")):  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_config(overrides=[bad])
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["ouro_gate", "kl", "latent_diff", "entropy_diff"])
def test_environment_with_an_adaptive_exit_is_refused_naming_both_keys(kind: str) -> None:
    arg = "q: 0.8" if kind == "ouro_gate" else "threshold: 0.01"
    policy = f"rollout.exit_policy={{kind: {kind}, {arg}}}"
    load_config(overrides=[policy])  # fine single-turn
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[policy, "task.environment=my_pkg.games:Guess"])
    msg = str(e.value)
    assert "rollout.exit_policy" in msg and "task.environment" in msg and kind in msg
    assert "\n" not in msg
    fixed = load_config(overrides=["rollout.exit_policy={kind: fixed, depth: 2}",
                                   "task.environment=my_pkg.games:Guess"])  # fmt: skip
    assert fixed.rollout.exit_policy["kind"] == "fixed"
