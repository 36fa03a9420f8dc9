"""Replay parity: megatron replay (TP=1, TP=2) vs `models.reference.generate` (exact mode).

The parent generates completions with the reference engine (adaptive exits for Huginn and
Ouro) for every family; two spawned runs (one rank at TP=1, two ranks at TP=2) load the same HF
weights through `learner.hf_convert` and replay them: exact mode must reproduce the behaviour
log-probs, entropies and hidden states bit for bit, fast mode within 1e-4.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from models.config import LlamaConfig, ModelConfig, tiny_config
from models.exits import KL, ExitPolicy, FixedDepth, OuroGate
from models.reference import ReplayItem, SamplingParams, build_model, generate
from models.reference import replay as reference_replay
from tests.learner.dist_utils import run_distributed

pytestmark = pytest.mark.megatron

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
POLICIES: dict[str, ExitPolicy] = {
    "huginn": KL(0.1),
    "ouro": OuroGate(0.8),
    "nanbeige": FixedDepth(3),
    "llama": FixedDepth(1),
}
SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12)


def tp2_config(family: str) -> ModelConfig:
    """tiny_config, with 4 query / 2 key-value heads for the Llama-like families (GQA that TP=2
    can split)."""
    cfg = tiny_config(family)
    if family == "huginn":
        return cfg
    assert isinstance(cfg, LlamaConfig)
    return dataclasses.replace(cfg, num_attention_heads=4, num_key_value_heads=2)


def make_cases() -> dict[str, dict[str, Any]]:
    """Per family: config, HF state, replay items, and the reference's values."""
    cases = {}
    gen = torch.Generator().manual_seed(7)
    for i, family in enumerate(FAMILIES):
        cfg = tp2_config(family)
        ref = build_model(cfg, seed=i)
        prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 9, 5)]
        seeds = [int(torch.randint(0, 2**62, (1,), generator=gen)) * 3 for _ in prompts]
        gens = generate(ref, prompts, seeds, SAMPLING, POLICIES[family], "exact")
        items = [
            ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
            for g in gens
        ]
        rep = reference_replay(ref, items, temperature=0.9, top_p=0.95, numerics="exact")
        cases[family] = dict(
            config=cfg,
            state={k: v.clone() for k, v in ref.state_dict().items()},
            items=items,
            logprobs=[g.logprobs for g in gens],
            entropies=[r.entropies for r in rep],
            hidden=[r.hidden for r in rep],
            depths=sorted({d for g in gens for d in g.exit_depths}),
        )
    return cases


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def parity_worker(tp: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Replay every family at TP=tp in both modes; max |diff| against the reference values."""
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import replay

    init_distributed(tp)
    out: dict[str, Any] = {}
    for family, case in cases.items():
        model = build_policy(case["config"], MegatronOptions(), hf_state=case["state"])
        for mode in ("exact", "fast"):
            res = replay(model, case["items"], temperature=0.9, top_p=0.95, numerics=mode)
            out[f"{family}/{mode}"] = dict(
                logprob=_max_diff([r.logprobs for r in res], case["logprobs"]),
                entropy=_max_diff([r.entropies for r in res], case["entropies"]),
                hidden=_max_diff([r.hidden for r in res], case["hidden"]),
            )
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, Any]]:
    return make_cases()


def test_reference_cases_use_adaptive_exits(cases: dict[str, dict[str, Any]]) -> None:
    assert len(cases["huginn"]["depths"]) > 1, "Huginn KL exits should vary the depth"
    assert len(cases["ouro"]["depths"]) > 1, "Ouro gate exits should vary the depth"
    assert cases["nanbeige"]["depths"] == [3] and cases["llama"]["depths"] == [1]


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_replay_matches_reference(tp: int, cases: dict[str, dict[str, Any]]) -> None:
    results = run_distributed(parity_worker, tp, tp, cases, timeout_s=240)
    assert results[0] == results[-1], "TP ranks disagree"
    for family in FAMILIES:
        exact, fast = results[0][f"{family}/exact"], results[0][f"{family}/fast"]
        assert exact == dict(logprob=0.0, entropy=0.0, hidden=0.0), (family, exact)
        assert fast["logprob"] <= 1e-4, (family, fast)
