"""Multi-turn conversations at the door and their run-config keys
(task.environment, rollout.max_turns, rollout.max_env_tokens; docs/PROTOCOL.md 1.6)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from models.errors import ConfigError
from pipeline.config.run import load_config
from pipeline.core.validation import (
    REASONS,
    DoorRules,
    Expected,
    ModelLimits,
    check_rollout,
    door_rules,
    model_turns,
)
from proto.records import Rollout


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


# -- the door -----------------------------------------------------------------------------
LIMITS = ModelLimits(vocab_size=256, max_depth=8)
RULES = DoorRules(reward_bound=10.0, environment=True, max_turns=3, max_env_tokens=4)
D = 8  # the conversation's full depth


def conversation() -> tuple[Rollout, Expected]:
    """Two model turns (3 + 2 tokens) around 3 environment tokens: mask 11100011."""
    mask = np.array([1, 1, 1, 0, 0, 0, 1, 1], np.uint8)
    r = Rollout(
        rollout_id="w0/1", work_id="w0", prompt_id="p0", sample_index=1, generator_id="g0",
        latent_seed=77, prompt_tokens=np.array([1, 2, 3], np.int32),
        tokens=np.array([5, 6, 7, 9, 10, 11, 12, 13], np.int32),
        logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        exit_depths=np.where(mask == 1, 3, D).astype(np.uint8), full_depth=D,
        weight_version=3, reward=1.0, token_mask=mask,
    )  # fmt: skip
    exp = Expected(prompt_id="p0", prompt_tokens=[1, 2, 3], latent_seed=77, max_tokens=5,
                   min_version=2, max_version=4, sender="g0")  # fmt: skip
    return r, exp


def _with(r: Rollout, **kw: Any) -> Rollout:
    return dataclasses.replace(r, **kw)


def test_a_good_conversation_passes() -> None:
    r, exp = conversation()
    assert check_rollout(r, expect=exp, limits=LIMITS, rules=RULES) is None
    assert model_turns(r.token_mask) == 2
    # a single-turn rollout (no mask) on the same run passes too, counted as before
    single = _with(r, tokens=r.tokens[:3], logprobs=r.logprobs[:3], exit_depths=r.exit_depths[:3],
                   token_mask=None)  # fmt: skip
    assert check_rollout(single, expect=exp, limits=LIMITS, rules=RULES) is None


def _bad_cases() -> dict[str, tuple[str, str, Rollout, DoorRules]]:
    r, _ = conversation()
    m = r.token_mask
    assert m is not None
    lp = r.logprobs.copy()
    lp[4] = -0.25
    ed = r.exit_depths.copy()
    ed[5] = 3
    three = np.array([1, 0, 1, 0, 1, 0, 1, 1], np.uint8)  # 4 model turns, 3 env tokens
    return {
        "no_environment": (
            "token_mask",
            "without task.environment",
            r,
            dataclasses.replace(RULES, environment=False),
        ),
        "length": (
            "token_mask",
            "token_mask has 7 entries for 8 tokens",
            _with(r, token_mask=m[:7]),
            RULES,
        ),
        "value": (
            "token_mask",
            "token_mask value 2",
            _with(r, token_mask=np.where(m == 0, 2, 1).astype(np.uint8)),
            RULES,
        ),
        "first": (
            "token_mask",
            "first token is an environment token",
            _with(r, token_mask=np.array([0, 1, 1, 0, 0, 0, 1, 1], np.uint8)),
            RULES,
        ),
        "env_logprob": (
            "env_token",
            "environment token 4 has log-prob -0.25",
            _with(r, logprobs=lp),
            RULES,
        ),
        "env_depth": (
            "env_token",
            "environment token 5 ran 3 iterations, expected the full depth 8",
            _with(r, exit_depths=ed),
            RULES,
        ),
        "env_budget": (
            "env_budget",
            "3 environment tokens > rollout.max_env_tokens 2",
            r,
            dataclasses.replace(RULES, max_env_tokens=2),
        ),
        "turns": (
            "too_many_turns",
            "4 model turns > rollout.max_turns 3",
            _with(
                r,
                token_mask=three,
                logprobs=np.where(three == 1, -0.5, 0.0).astype(np.float32),
                exit_depths=np.where(three == 1, 3, D).astype(np.uint8),
            ),
            RULES,
        ),
        "model_tokens": (
            "too_long",
            "6 model tokens > max_tokens 5",
            _with(
                r,
                token_mask=np.array([1, 1, 1, 0, 1, 1, 1, 0], np.uint8),
                logprobs=np.array([-0.5] * 3 + [0] + [-0.5] * 3 + [0], np.float32),
                exit_depths=np.array([3] * 3 + [D] + [3] * 3 + [D], np.uint8),
            ),
            RULES,
        ),
        "vocab": (
            "token_out_of_vocab",
            "token id 300 outside the vocabulary",
            _with(r, tokens=np.where(m == 0, 300, r.tokens).astype(np.int32)),
            RULES,
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_each_broken_conversation_rule_is_refused_by_name(case: str) -> None:
    reason, detail, bad, rules = _bad_cases()[case]
    _, exp = conversation()
    got = check_rollout(bad, expect=exp, limits=LIMITS, rules=rules)
    assert got is not None and got.reason == reason and got.reason in REASONS, (case, got)
    assert detail in got.detail, (case, got.detail)
    assert "\n" not in str(got)


def test_the_run_config_reaches_the_door() -> None:
    rules = door_rules(load_config(overrides=["task.environment=my_pkg.games:Guess",
                                              "rollout.max_turns=3", "rollout.max_env_tokens=40"]))  # fmt: skip
    assert (rules.environment, rules.max_turns, rules.max_env_tokens) == (True, 3, 40)
    assert door_rules(load_config()).environment is False
