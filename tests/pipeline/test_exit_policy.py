"""The exit policy as a run-level setting (rollout.exit_policy): parsed and refused with a
message, passed by the launcher to the generators, checked on Welcome, bounding the door's
exit depths (deeper than the model's trained depth when the policy says so), and replayed by
the reference trainer in the policy's KV semantics."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.exits import (
    FixedDepth,
    LatentDiff,
    OuroGate,
    SampledGate,
    policy_from_dict,
    policy_json,
)
from pipeline.config import ConfigError, load_config
from pipeline.core.validation import DoorRules, Expected, ModelLimits, check_rollout
from proto import Rollout

GATE = {"kind": "ouro_gate", "q": 0.8, "kv": "full"}


def test_run_config_key_parsed_and_refused_with_a_message(tmp_path: Path) -> None:
    assert load_config().rollout.policy() is None  # default: full depth
    cfg = load_config(None, {"rollout": {"exit_policy": GATE}})
    assert cfg.rollout.policy() == OuroGate(0.8, kv="full")
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  exit_policy: {kind: fixed, depth: 48, kv: last_exited}\n")
    assert load_config(path).rollout.policy() == FixedDepth(48, kv="last_exited")
    for bad, why in (
        ({"kind": "nope"}, "needs 'kind' in"),
        ({"kind": "ouro_gate", "q": 0.8, "kv": "fulll"}, "kv must be one of"),
        ({"kind": "kl", "threshold": 0.1, "max_depth": 300}, r"max_depth must be an int in \[1, 255\]"),
        ({"kind": "fixed", "depth": 4, "q": 1}, "unknown fields"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"rollout.exit_policy .*{why}"):
            load_config(None, {"rollout": {"exit_policy": bad}})
    sampled = {"rollout": {"exit_policy": {"kind": "sampled_gate"}}}
    assert load_config(None, sampled).rollout.policy() == SampledGate()
    with pytest.raises(ConfigError, match="sampled_gate cannot be combined with task.environment"):
        load_config(None, {**sampled, "task": {"environment": "generator.environments:Scripted"}})
    with pytest.raises(ConfigError, match="objective.exit_coef=0.5: trains a sampled exit"):
        load_config(None, {"objective": {"exit_coef": 0.5}})


def test_launcher_and_welcome_carry_the_run_policy() -> None:
    from pipeline.commands.generator_cli import _check_welcome
    from pipeline.commands.launcher import generator_command
    from pipeline.core.coordinator import Coordinator

    cfg = load_config(None, {"rollout": {"exit_policy": GATE}})
    cmd = generator_command(cfg, 0, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", Path("m"))
    sent = json.loads(cmd[cmd.index("--exit-policy") + 1])
    assert policy_from_dict(sent) == OuroGate(0.8, kv="full")
    plain = generator_command(load_config(), 0, "tcp://a:1", "tcp://a:2", Path("m"))
    assert "--exit-policy" not in plain
    from pipeline.commands.learner_main import generator_hint

    hint = generator_hint(cfg, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", Path("m"))
    assert f"--exit-policy '{policy_json(OuroGate(0.8, kv='full'))}'" in hint
    assert "--exit-policy" not in generator_hint(load_config(), "tcp://a:1", "tcp://a:2", Path("m"))
    settings = Coordinator._welcome_settings(SimpleNamespace(cfg=cfg))  # type: ignore[arg-type]
    assert settings == {"numerics": "fast", "exit_policy": policy_json(OuroGate(0.8, kv="full"))}
    welcome = SimpleNamespace(settings=settings)
    _check_welcome("fast", policy_json(OuroGate(0.8, kv="full")))(welcome)
    for mine in ("", policy_json(OuroGate(0.8, kv="last_exited"))):
        with pytest.raises(ValueError, match="rollout.exit_policy"):
            _check_welcome("fast", mine)(welcome)


def _rollout(depths: list[int]) -> tuple[Rollout, Expected]:
    n = len(depths)
    r = Rollout(
        rollout_id="w0/0", work_id="w0", prompt_id="p0", sample_index=0, generator_id="g0",
        latent_seed=5, prompt_tokens=np.array([1, 2, 3], np.int32),
        tokens=np.arange(5, 5 + n, dtype=np.int32), logprobs=np.full(n, -1.0, np.float32),
        exit_depths=np.array(depths, np.uint8), weight_version=0, reward=1.0,
    )  # fmt: skip
    exp = Expected(prompt_id="p0", prompt_tokens=[1, 2, 3], latent_seed=5, max_tokens=8,
                   min_version=0, max_version=0)  # fmt: skip
    return r, exp


def test_door_bounds_exit_depths_by_the_run_policy(tmp_path: Path) -> None:
    from models.init import init_checkpoint

    path = init_checkpoint("huginn", "tiny", tmp_path / "m")  # mean_recurrence 6
    model_only = ModelLimits.from_checkpoint(path)
    deep = ModelLimits.from_checkpoint(path, LatentDiff(0.1, max_depth=48))
    assert model_only.max_depth == 6 and deep.max_depth == 48
    assert ModelLimits.from_checkpoint(path, FixedDepth(48)).max_depth == 48
    assert ModelLimits.from_checkpoint(path, OuroGate(0.5)).max_depth == 6
    rules = DoorRules()
    r, exp = _rollout([48, 30, 5])
    assert check_rollout(r, expect=exp, limits=deep, rules=rules) is None
    why = check_rollout(r, expect=exp, limits=model_only, rules=rules)
    assert why is not None and why.reason == "exit_depth" and "[1, 6]" in why.detail
    r, exp = _rollout([49, 30, 5])
    why = check_rollout(r, expect=exp, limits=deep, rules=rules)
    assert why is not None and why.reason == "exit_depth" and "[1, 48]" in why.detail


@pytest.mark.parametrize("kv", ["full", "last_exited"])
def test_reference_trainer_replays_in_the_runs_kv(tmp_path: Path, kv: str) -> None:
    from learner.batching import build_batch
    from models.checkpoint import load_model
    from models.init import init_checkpoint
    from models.reference import SamplingParams, behaviour_logprobs, generate
    from pipeline.backends.reference_trainer import ReferenceTrainer

    path = init_checkpoint("ouro", "tiny", tmp_path / "m")
    policy = OuroGate(0.8, kv=kv)
    model = load_model(path)[1]
    gens = generate(model, [[5, 9, 13, 17], [300, 4]], [1, 2],
                    SamplingParams(max_new_tokens=10), policy, "fast")  # fmt: skip
    assert len({d for g in gens for d in g.exit_depths}) >= 2, "adaptive exits vary"
    rolls = [
        Rollout(
            rollout_id=f"w{i}/0",
            work_id=f"w{i}",
            prompt_id=f"p{i}",
            sample_index=0,
            generator_id="g0",
            latent_seed=g.latent_seed,
            prompt_tokens=np.array(g.prompt_tokens, np.int32),
            tokens=np.array(g.tokens, np.int32),
            logprobs=g.logprobs.numpy(),
            exit_depths=np.array(g.exit_depths, np.uint8),
            full_depth=g.full_depth,
            weight_version=0,
            reward=1.0,
        )  # fmt: skip
        for i, g in enumerate(gens)
    ]

    def diff(run_kv: str) -> float:
        over = {"backend": "reference", "rollout": {"exit_policy": {**GATE, "kv": run_kv}}}
        trainer = ReferenceTrainer(load_config(None, over), path)
        with torch.no_grad():
            logits = trainer.policy.forward(trainer.model, build_batch(rolls))[0]  # every position
        out = 0.0
        for b, g in enumerate(gens):
            at = slice(len(g.prompt_tokens) - 1, len(g.prompt_tokens) - 1 + len(g.tokens))
            smp = trainer.run_cfg.rollout
            lp = behaviour_logprobs(logits[b, at], logits.shape[-1], smp.temperature, smp.top_p)
            got = lp.gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
            out = max(out, float((got - g.logprobs).abs().max()))
        return out

    other = "full" if kv == "last_exited" else "last_exited"
    assert diff(kv) <= 1e-5
    assert diff(other) > 1e-3
