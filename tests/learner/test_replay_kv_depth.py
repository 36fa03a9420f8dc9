"""Megatron replay in both exit KV semantics (docs/CONTRACTS.md 3) and deeper than the model's
trained depth, against `models.reference` (TP=1, gloo).

test_replay_parity.py covers each family's default kv; here: Huginn with kv='full', Ouro with
kv='last_exited', and Huginn from a mean_recurrence-4 config under a policy whose max depth is
48 (adaptive exits in both semantics). Exact mode must reproduce the reference's behaviour
log-probs, entropies and hidden states bit for bit, fast mode within 1e-5; the kv comes from
`MegatronOptions.kv` (the run's exit policy) and replaying under the other semantics differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from models.config import tiny_config
from models.exits import KL, ExitPolicy, LatentDiff, OuroGate
from models.reference import ReplayItem, SamplingParams, build_model, generate
from models.reference import replay as reference_replay
from tests.learner.dist_utils import run_distributed

pytestmark = pytest.mark.megatron

CASES: dict[str, tuple[str, ExitPolicy, int | None]] = {  # family, policy, mean_recurrence
    "huginn-full": ("huginn", KL(0.1, kv="full"), None),
    "ouro-last_exited": ("ouro", OuroGate(0.8, kv="last_exited"), None),
    "huginn48-full": ("huginn", LatentDiff(0.1, max_depth=48, kv="full"), 4),
    "huginn48-last_exited": ("huginn", LatentDiff(0.1, max_depth=48, kv="last_exited"), 4),
}
SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=10)


def make_cases() -> dict[str, dict[str, Any]]:
    cases = {}
    gen = torch.Generator().manual_seed(11)
    for i, (name, (family, policy, depth)) in enumerate(CASES.items()):
        cfg = tiny_config(family)
        if depth is not None:
            cfg = dataclasses.replace(cfg, mean_recurrence=depth)
        ref = build_model(cfg, seed=i)
        # three prompts: with two, the sampled tokens of 2026-12-04's sampler (models.sampling)
        # left every ouro exit at depth 3 (the depths must vary for the case to test anything)
        prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 9, 6)]
        seeds = [17 + i, 2**64 - 5 - i, 99 + i]
        gens = generate(ref, prompts, seeds, SAMPLING, policy, "exact")
        items = [
            ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
            for g in gens
        ]
        rep = reference_replay(ref, items, temperature=0.9, numerics="exact", kv=policy.kv)
        assert all(torch.equal(g.logprobs, r.logprobs) for g, r in zip(gens, rep))
        cases[name] = dict(
            config=cfg,
            kv=policy.kv,
            state={k: v.clone() for k, v in ref.state_dict().items()},
            items=items,
            logprobs=[g.logprobs for g in gens],
            entropies=[r.entropies for r in rep],
            hidden=[r.hidden for r in rep],
            depths=sorted({d for g in gens for d in g.exit_depths}),
            trained=ref.max_depth,
        )
    return cases


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def kv_worker(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import replay

    init_distributed(1)
    out: dict[str, Any] = {}
    for name, case in cases.items():
        model = build_policy(case["config"], MegatronOptions(kv=case["kv"]), case["state"])
        for mode in ("exact", "fast"):
            res = replay(model, case["items"], temperature=0.9, numerics=mode)
            out[f"{name}/{mode}"] = dict(
                logprob=_max_diff([r.logprobs for r in res], case["logprobs"]),
                entropy=_max_diff([r.entropies for r in res], case["entropies"]),
                hidden=_max_diff([r.hidden for r in res], case["hidden"]),
            )
        other = "full" if case["kv"] == "last_exited" else "last_exited"
        res = replay(model, case["items"], temperature=0.9, numerics="exact", kv=other)
        out[f"{name}/other"] = _max_diff([r.logprobs for r in res], case["logprobs"])
    destroy_distributed()
    return out


def test_megatron_replay_matches_reference_in_both_kv_and_deeper() -> None:
    cases = make_cases()
    for name, case in cases.items():
        assert len(case["depths"]) > 1, f"{name}: adaptive exits should vary the depth"
        if name.startswith("huginn48"):
            assert case["trained"] == 4 and case["depths"][-1] == 48
            assert any(4 < d < 48 for d in case["depths"]), "generated tokens think deeper"
    (results,) = run_distributed(kv_worker, 1, cases, timeout_s=400)
    for name in CASES:
        exact, fast = results[f"{name}/exact"], results[f"{name}/fast"]
        print(f"\n{name}: exact {exact}, fast {fast}, other kv {results[f'{name}/other']:.3f}")
        assert exact == dict(logprob=0.0, entropy=0.0, hidden=0.0), (name, exact)
        assert fast["logprob"] <= 1e-5, (name, fast)
        assert results[f"{name}/other"] > 1e-4, name  # the kv setting is honoured


def adapter_body(items: list[ReplayItem], logprobs: list[torch.Tensor]) -> dict[str, Any]:
    """build_learner_trainer (the `looprl learner` path) maps rollout.exit_policy's kv onto
    MegatronOptions.kv: replay with the trainer's policy model, kv left to the options."""
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import replay, unwrap
    from pipeline.backends.megatron_adapter import build_learner_trainer
    from pipeline.config.run import load_config

    init_distributed(tp=1, seed=0)
    cfg_ouro = tiny_config("ouro")
    state = build_model(cfg_ouro, seed=0).state_dict()
    out: dict[str, Any] = {}
    for name, policy in (("default", {}), ("full", {"kind": "ouro_gate", "q": 0.8, "kv": "full"}),
                         ("last_exited", {**{"kind": "ouro_gate", "q": 0.8}, "kv": "last_exited"})):  # fmt: skip
        over = {"rollout": {"n": 4, "prompts_per_step": 2, "exit_policy": policy}}
        trainer = build_learner_trainer(load_config(None, over), cfg_ouro, state)
        model = trainer.policy_model
        res = replay(model, items, numerics="exact")
        out[name] = (unwrap(model).options.kv, _max_diff([r.logprobs for r in res], logprobs))
    destroy_distributed()
    return out


def test_run_exit_policy_sets_the_megatron_trainers_kv() -> None:
    model = build_model(tiny_config("ouro"), seed=0)
    gens = generate(model, [[5, 9, 13, 17], [300, 4]], [1, 2], SamplingParams(max_new_tokens=8),
                    OuroGate(0.8, kv="full"), "exact")  # fmt: skip
    assert len({d for g in gens for d in g.exit_depths}) > 1
    items = [
        ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
        for g in gens
    ]
    logprobs = [g.logprobs for g in gens]
    out = run_distributed(adapter_body, 1, items, logprobs, torchrun_env=False, timeout_s=300)[0]
    print(f"\n{out}")
    assert out["full"] == ("full", 0.0)
    assert out["default"] == ("full", 0.0)  # Ouro's default: its official semantics
    assert out["last_exited"][0] == "last_exited" and out["last_exited"][1] > 1e-4
