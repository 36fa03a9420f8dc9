"""The exit policy as a run-level setting (rollout.exit_policy): parsed and refused with a
message, passed by the launcher to the generators, checked on Welcome, bounding the door's
exit depths (deeper than the model's trained depth when the policy says so), and replayed by
the reference trainer in the policy's KV semantics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.errors import ConfigError
from models.exits import (
    KL,
    ExitPolicy,
    FixedDepth,
    LatentDiff,
    OuroGate,
    SampledGate,
    policy_from_dict,
    policy_to_dict,
)
from pipeline.config.run import load_config
from pipeline.core.validation import DoorRules, Expected, ModelLimits, check_rollout
from proto.records import Rollout, Welcome
from tests.pipeline.fakes import generated_rollouts

GATE = {"kind": "ouro_gate", "q": 0.8, "kv": "full"}


def test_run_config_key_parsed_and_refused_with_a_message(tmp_path: Path) -> None:
    assert load_config().rollout.parsed_policy is None  # default: full depth
    cfg = load_config(None, {"rollout": {"exit_policy": GATE}})
    assert cfg.rollout.parsed_policy == OuroGate(0.8, kv="full")
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  exit_policy: {kind: fixed, depth: 48, kv: last_exited}\n")
    assert load_config(path).rollout.parsed_policy == FixedDepth(48, kv="last_exited")
    for bad, why in (
        ({"kind": "nope"}, "needs 'kind' in"),
        ({"kind": "ouro_gate", "q": 0.8, "kv": "fulll"}, "kv must be one of"),
        ({"kind": "kl", "threshold": 0.1, "max_depth": 300}, r"max_depth must be an int in \[1, 255\]"),
        ({"kind": "fixed", "depth": 4, "q": 1}, "unknown fields"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"rollout.exit_policy .*{why}"):
            load_config(None, {"rollout": {"exit_policy": bad}})
    sampled = {"rollout": {"exit_policy": {"kind": "sampled_gate"}}}
    assert load_config(None, sampled).rollout.parsed_policy == SampledGate()
    with pytest.raises(ConfigError, match="sampled_gate cannot be combined with task.environment"):
        load_config(None, {**sampled, "task": {"environment": "generator.environments:Scripted"}})
    with pytest.raises(ConfigError, match="objective.exit_coef=0.5: trains a sampled exit"):
        load_config(None, {"objective": {"exit_coef": 0.5}})


def test_the_policy_is_one_typed_object_from_yaml_to_the_engine(tmp_path: Path) -> None:
    """rollout.exit_policy is parsed once, at load; at every hop after it (the run config, the
    GeneratorConfig `looprl run` builds, the flags it starts the generator with, the
    GeneratorConfig `looprl generator` loads from them, its engines) the policy is the same
    type and equal; the flag is the only text on the way (the process boundary)."""
    import argparse

    from generator.vllm_plugin.settings import (
        PluginSettings,
        settings_from_additional_config,
        settings_to_dict,
    )
    from models.random_init import init_checkpoint
    from pipeline.commands.generator_cli import add_parser, build_engines, config_from_args
    from pipeline.commands.generator_flags import generator_config
    from pipeline.commands.launcher import generator_command

    model = init_checkpoint("ouro", "tiny", tmp_path / "m")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("rollout:\n  exit_policy: {kind: ouro_gate, q: 0.8, kv: full}\n"
                        "generators:\n  engine: torch\n")  # fmt: skip
    cfg = load_config(run_yaml)
    want = OuroGate(0.8, kv="full")
    hops = {"run config": cfg.rollout.parsed_policy}
    ctrl, wts = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    meant = generator_config(cfg, ctrl, wts, model, index=0)
    hops["launcher's GeneratorConfig"] = meant.exit_policy
    cmd = generator_command(cfg, 0, ctrl, wts, model)
    flag = cmd[cmd.index("--exit-policy") + 1]
    assert policy_from_dict(json.loads(flag)) == want  # the process boundary: the mapping's JSON
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    loaded = config_from_args(parser.parse_args(cmd[cmd.index("generator") :]))
    assert loaded == meant
    hops["generator's GeneratorConfig"] = loaded.exit_policy
    engines = build_engines(loaded)
    try:
        hops["torch engine"] = engines.main.policy
        built = engines._engine(3)  # an eval depth: FixedDepth(3), the main policy untouched
        assert built.policy == FixedDepth(3) and engines.main.policy == want
    finally:
        engines.close()
    plugin = settings_from_additional_config(
        settings_to_dict(PluginSettings("fast", loaded.exit_policy))
    )  # what LoopedEngine hands vLLM (its config: a mapping) and each looped model reads back
    hops["vLLM plugin settings"] = plugin.exit_policy
    for hop, policy in hops.items():
        assert type(policy) is OuroGate and policy == want, hop
    assert hash(hops["vLLM plugin settings"]) == hash(want)  # frozen: hashable, by value
    plain = generator_command(load_config(), 0, ctrl, wts, model)
    assert "--exit-policy" not in plain  # full depth: no flag, None in every config
    assert load_config().rollout.parsed_policy is None
    assert (
        config_from_args(parser.parse_args(plain[plain.index("generator") :])).exit_policy is None
    )


def test_the_generator_reads_its_policy_once_from_a_flag_or_a_file(tmp_path: Path) -> None:
    """`looprl generator` takes the policy as JSON or YAML text (--exit-policy) or as a mapping
    in its --config file; a bad one is one line naming exit_policy; `looprl run` refuses it in
    the generators section (rollout.exit_policy sets it)."""
    import argparse

    from generator.config import load_config as load_generator_config
    from models.errors import ConfigError as GeneratorConfigError
    from pipeline.commands.generator_cli import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for text in ('{"kind": "kl", "threshold": 1e-3, "kv": "full"}',
                 "{kind: kl, threshold: 0.001, kv: full}"):  # fmt: skip
        got = config_from_args(parser.parse_args(["generator", "--exit-policy", text]))
        assert got.exit_policy == KL(0.001, kv="full")
    assert (
        config_from_args(parser.parse_args(["generator", "--exit-policy", ""])).exit_policy is None
    )
    gen_yaml = tmp_path / "gen.yaml"
    gen_yaml.write_text("exit_policy: {kind: fixed, depth: 5}\n")
    assert load_generator_config(gen_yaml).exit_policy == FixedDepth(5)
    gen_yaml.write_text('exit_policy: \'{"kind": "fixed", "depth": 5}\'\n')  # as before
    assert load_generator_config(gen_yaml).exit_policy == FixedDepth(5)
    for bad, why in (('{"kind": "nope"}', "needs 'kind' in"), ("[1, 2]", "must be a mapping"),
                     ('{"kind": "fixed", "depth": 4, "q": 1}', "unknown fields")):  # fmt: skip
        with pytest.raises(GeneratorConfigError, match=f"generator config exit_policy: .*{why}"):
            config_from_args(parser.parse_args(["generator", "--exit-policy", bad]))
    with pytest.raises(ConfigError, match="generators.exit_policy=.*rollout.exit_policy"):
        load_config(None, {"generators": {"exit_policy": GATE}})


def test_welcome_check_compares_policies_not_text() -> None:
    """The Welcome states the run's policy as a map (Welcome.exit_policy, models.exits.
    policy_to_dict's; {} = full depth) or, from learners before protocol 1.8, as its canonical
    JSON in settings["exit_policy"]; either passes the check of a generator that runs that
    policy, through the codec. Another policy, or full depth against a policy, is refused naming
    --exit-policy and rollout.exit_policy; a Welcome that states none is not checked."""
    from pipeline.commands.generator_cli import _check_welcome
    from proto.codec import Codec

    def welcome(policy_map: dict | None = None, **settings: object) -> Welcome:
        w = Welcome("run", "g", 0, 1.0, dict(settings), exit_policy=policy_map)
        return Codec().decode(Codec().encode(w))  # type: ignore[return-value]

    def legacy(policy: ExitPolicy | None) -> str:  # what learners sent before: canonical JSON
        return "" if policy is None else json.dumps(policy_to_dict(policy), sort_keys=True)

    def stated(policy: ExitPolicy | None) -> list[Welcome]:  # the 1.8 form and the older one
        return [welcome(policy_to_dict(policy) or {}), welcome(exit_policy=legacy(policy))]

    mine = OuroGate(0.8, kv="full")
    reordered = '{"q": 0.8, "kind": "ouro_gate", "kv": "full"}'  # other text, the same policy
    assert welcome(policy_to_dict(mine)).exit_policy == policy_to_dict(mine)  # a typed map
    for w in [*stated(mine), welcome(exit_policy=reordered), welcome(numerics="fast")]:
        _check_welcome("fast", mine)(w)  # the last states none: not checked
    for w in [*stated(None), welcome(exit_policy=None)]:  # full depth
        _check_welcome("fast", None)(w)
    other = OuroGate(0.8, kv="last_exited")
    _check_welcome("fast", mine)(
        welcome(policy_to_dict(mine), exit_policy=legacy(other))
    )  # 1.8 first
    for theirs, generator in ((other, mine), (mine, None), (None, mine)):
        for w in stated(theirs):
            with pytest.raises(ValueError, match=r"--exit-policy '.*', the run config's "
                               r"rollout.exit_policy"):  # fmt: skip
                _check_welcome("fast", generator)(w)
    for w in (welcome({"kind": "x"}), welcome(exit_policy='{"kind": "x"}')):
        with pytest.raises(ValueError, match="cannot read"):
            _check_welcome("fast", mine)(w)


def test_the_coordinators_welcome_states_the_run_policy(tmp_path: Path) -> None:
    """The coordinator's Welcome carries rollout.exit_policy as a typed map (no JSON text in its
    settings), through the in-memory transport's codec; a generator of that policy passes the
    check, one of another is refused."""
    from pipeline.commands.generator_cli import _check_welcome
    from tests.pipeline.fakes import FakeGenerator, make_coordinator

    for policy, run in ((OuroGate(0.8, kv="full"), [f"rollout.exit_policy={json.dumps(GATE)}"]),
                        (None, [])):  # fmt: skip
        c, net, _ = make_coordinator(tmp_path / str(policy is None), run)
        g = FakeGenerator(net, "g0")
        for _ in range(20):
            c.turn(0.0)
            g.step()
            if g.welcome is not None:
                break
        assert g.welcome is not None and "exit_policy" not in g.welcome.settings
        assert g.welcome.exit_policy == (policy_to_dict(policy) or {})
        _check_welcome(c.cfg.numerics, policy)(g.welcome)
        with pytest.raises(ValueError, match="--exit-policy"):
            _check_welcome(c.cfg.numerics, FixedDepth(2))(g.welcome)
        c.close()


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
    from models.random_init import init_checkpoint

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
    from models.random_init import init_checkpoint
    from models.reference import SamplingParams, behaviour_logprobs, generate
    from pipeline.backends.reference_trainer import ReferenceTrainer

    path = init_checkpoint("ouro", "tiny", tmp_path / "m")
    policy = OuroGate(0.8, kv=kv)
    model = load_model(path)[1]
    gens = generate(model, [[5, 9, 13, 17], [300, 4]], [1, 2],
                    SamplingParams(max_new_tokens=10), policy, "fast")  # fmt: skip
    assert len({d for g in gens for d in g.exit_depths}) >= 2, "adaptive exits vary"
    rolls = generated_rollouts(gens, 0, 1.0)

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
