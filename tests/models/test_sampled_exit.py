"""The sampled exit (models side): SampledGate draws each token's exit loop
from the model's own exit gate with the completion's latent seed (models.noise.exit_uniform),
records the exit's log-probability, and replay recomputes it from the recorded depths."""

from __future__ import annotations

import math

import pytest
import torch

from models.config import tiny_config
from models.exits import SampledGate, policy_from_dict, policy_to_dict
from models.noise import exit_uniform
from models.reference import ReplayItem, SamplingParams, build_model, generate, replay

PROMPT = [3, 1, 4, 1, 5]


def _ouro(bias: float = -0.8, seed: int = 0) -> torch.nn.Module:
    """A tiny Ouro (4 loops) whose gate exits with probability ~0.3 per loop."""
    m = build_model(tiny_config("ouro"), seed=seed)
    with torch.no_grad():
        m.model.early_exit_gate.bias.fill_(bias)
    return m


def _gate_distribution(m: torch.nn.Module, policy: SampledGate, mode: str) -> list[float]:
    """p(exit = d), d = 1..D, of token 0 by replaying it at every depth (exit_logprobs)."""
    depth = policy.max_depth or m.max_depth
    out = []
    for d in range(1, depth + 1):
        item = ReplayItem(PROMPT, [7], 5, [d], depth)
        r = replay(m, [item], numerics=mode, exit_policy=policy)[0]
        assert r.exit_logprobs is not None
        out.append(math.exp(float(r.exit_logprobs[0])))
    return out


def test_exit_uniform_is_a_function_of_seed_position_and_depth() -> None:
    seeds = torch.tensor([1, -5, 1 << 62, 7] * 2500, dtype=torch.int64)
    pos = torch.arange(10_000, dtype=torch.int64)
    u = exit_uniform(seeds, pos, 3)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    # the same (seed, position, depth) in another batch gives the same bits
    assert torch.equal(exit_uniform(seeds[17:18], pos[17:18], 3), u[17:18])
    assert not torch.equal(exit_uniform(seeds, pos, 4), u)
    assert not torch.equal(exit_uniform(seeds + 1, pos, 3), u)
    # depths are independent draws: correlation of u at depth 3 and 4 near 0
    c = torch.corrcoef(torch.stack([u, exit_uniform(seeds, pos, 4)]))[0, 1]
    assert abs(float(c)) < 0.05
    with pytest.raises(ValueError, match="depth must be >= 1"):
        exit_uniform(seeds, pos, 0)


@pytest.mark.parametrize("policy", [SampledGate(), SampledGate(min_depth=2, max_depth=3)])
def test_exit_distribution_sums_to_one_and_respects_min_depth(policy: SampledGate) -> None:
    m = _ouro()
    p = _gate_distribution(m, policy, "exact")
    assert abs(sum(p) - 1.0) < 1e-6, p
    assert all(x == 0.0 for x in p[: policy.min_depth - 1]), p  # never before min_depth
    assert all(x > 0.01 for x in p[policy.min_depth - 1 :]), p


def test_sampled_exits_follow_the_gate_distribution() -> None:
    """Token 0 of one prompt under 4,000 latent seeds (Ouro has no latent noise, so every
    seed sees the same gate): exit-depth frequencies match p(d) within 4 standard errors, and
    every recorded log-prob is log p(its depth)."""
    m, policy, n = _ouro(), SampledGate(), 4000
    p = _gate_distribution(m, policy, "exact")
    gens = generate(m, [PROMPT] * n, list(range(1000, 1000 + n)),
                    SamplingParams(max_new_tokens=1), policy, "exact")  # fmt: skip
    depths = torch.tensor([g.exit_depths[0] for g in gens])
    for d, pd in enumerate(p, start=1):
        freq = float((depths == d).float().mean())
        se = math.sqrt(pd * (1 - pd) / n)
        assert abs(freq - pd) < 4 * se + 1e-9, (d, freq, pd)
    for g in gens[:50]:
        assert g.exit_logprobs is not None
        assert abs(float(g.exit_logprobs[0]) - math.log(p[g.exit_depths[0] - 1])) < 1e-6


@pytest.mark.parametrize("kv", ["full", "last_exited"])
def test_replay_recomputes_exit_logprobs_bit_for_bit(kv: str) -> None:
    m, policy = _ouro(-0.3), SampledGate(kv=kv)
    prompts, seeds = [PROMPT, [2, 7], [9, 9, 9, 9]], [11, 12, 13]
    gens = generate(m, prompts, seeds, SamplingParams(max_new_tokens=10), policy, "exact")
    assert len({d for g in gens for d in g.exit_depths}) >= 3  # the exits vary
    items = [ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
             for g in gens]  # fmt: skip
    for g, r in zip(gens, replay(m, items, numerics="exact", exit_policy=policy)):
        assert g.exit_logprobs is not None and r.exit_logprobs is not None
        assert torch.equal(r.exit_logprobs, g.exit_logprobs)
        assert torch.equal(r.logprobs, g.logprobs)
        assert bool((g.exit_logprobs < 0).all())
    # fast numerics: generate and replay agree within 1e-6
    gens = generate(m, prompts, seeds, SamplingParams(max_new_tokens=10), policy, "fast")
    items = [ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
             for g in gens]  # fmt: skip
    for g, r in zip(gens, replay(m, items, numerics="fast", exit_policy=policy)):
        assert g.exit_logprobs is not None and r.exit_logprobs is not None
        assert float((r.exit_logprobs - g.exit_logprobs).abs().max()) <= 1e-6


def test_the_exit_log_prob_changes_with_the_depth_claimed() -> None:
    """A lie about the exit depth shows in the recomputed exit log-prob (what the door can
    check), and the seed decides the depth: the same seed gives the same exits."""
    m, policy = _ouro(-0.3), SampledGate()
    a = generate(m, [PROMPT], [5], SamplingParams(max_new_tokens=6), policy, "exact")[0]
    b = generate(m, [PROMPT], [5], SamplingParams(max_new_tokens=6), policy, "exact")[0]
    assert a.exit_depths == b.exit_depths and a.tokens == b.tokens
    assert a.exit_logprobs is not None and b.exit_logprobs is not None
    assert torch.equal(a.exit_logprobs, b.exit_logprobs)
    lie = list(a.exit_depths)
    lie[2] = 4 if lie[2] != 4 else 1
    r = replay(m, [ReplayItem(PROMPT, a.tokens, 5, lie, a.full_depth)], numerics="exact",
               exit_policy=policy)[0]  # fmt: skip
    assert r.exit_logprobs is not None
    assert float((r.exit_logprobs[2] - a.exit_logprobs[2]).abs()) > 1e-3


def test_sampled_gate_config_and_refusals() -> None:
    p = SampledGate(min_depth=2, max_depth=3, kv="full")
    assert policy_from_dict(policy_to_dict(p)) == p
    assert policy_to_dict(p) == {"kind": "sampled_gate", "min_depth": 2, "max_depth": 3,
                                 "kv": "full"}  # fmt: skip
    with pytest.raises(ValueError, match="min_depth must be >= 1"):
        SampledGate(min_depth=0)
    with pytest.raises(ValueError, match="max_depth must be >= min_depth"):
        SampledGate(min_depth=3, max_depth=2)
    with pytest.raises(ValueError, match="need a family with an exit gate"):
        generate(build_model(tiny_config("huginn")), [PROMPT], [1],
                 SamplingParams(max_new_tokens=2), SampledGate(), "exact")  # fmt: skip
