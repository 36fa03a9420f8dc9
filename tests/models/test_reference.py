"""Reference engine: generate vs replay parity, the last-exited KV rule, batching, sampling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from models import numerics as nx
from models.base import LoopedLM
from models.config import tiny_config
from models.exits import KL, ExitPolicy, FixedDepth, LatentDiff, OuroGate
from models.layers import Block
from models.reference import (
    Generation,
    ReplayItem,
    SamplingParams,
    behaviour_logprobs,
    build_model,
    generate,
    replay,
)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [300, 4], [7, 7, 7, 8, 9]]
SEEDS = [11, 2**64 - 3, 12345]
CASES: list[tuple[str, ExitPolicy | None]] = [
    ("huginn", LatentDiff(0.45)),
    ("huginn", KL(0.1)),
    ("ouro", OuroGate(0.8)),
    ("nanbeige", FixedDepth(3)),
    ("llama", None),
]
_MODELS: dict[str, LoopedLM] = {}


def model_of(family: str) -> LoopedLM:
    if family not in _MODELS:
        _MODELS[family] = build_model(tiny_config(family), seed=0)
    return _MODELS[family]


def items_of(gens: list[Generation]) -> list[ReplayItem]:
    return [
        ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
        for g in gens
    ]


@pytest.mark.parametrize("family,policy", CASES)
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_generate_replay_parity(family: str, policy: ExitPolicy | None, mode: str) -> None:
    model = model_of(family)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=14)
    gens = generate(model, PROMPTS, SEEDS, sampling, policy, mode)
    full = {"nanbeige": 3}.get(family, model.max_depth)
    for g in gens:
        assert len(g.tokens) == len(g.logprobs) == len(g.exit_depths) == 14
        assert g.full_depth == full  # contract 2: the prompt's depth, recorded
        if family != "ouro":  # Ouro's token 0 follows the gate (tests/models/test_token0_exit.py)
            assert g.exit_depths[0] == full
        assert all(1 <= d <= full for d in g.exit_depths)
        assert torch.isfinite(g.logprobs).all() and (g.logprobs <= 0).all()
    if family in ("huginn", "ouro"):
        depths = {d for g in gens for d in g.exit_depths[1:]}
        assert len(depths) >= 2, f"adaptive exits gave one depth only: {depths}"
    results = replay(model, items_of(gens), temperature=0.8, top_p=0.9, numerics=mode)
    diff = max(float((g.logprobs - r.logprobs).abs().max()) for g, r in zip(gens, results))
    if mode == "exact":
        assert diff <= 1e-6
    else:
        assert diff <= 1e-3
    for r in results:
        assert r.hidden.shape == (14, 64)
        assert torch.isfinite(r.entropies).all() and (r.entropies >= 0).all()


def test_replay_mixed_batch_equals_alone() -> None:
    model = model_of("huginn")
    gens = generate(model, PROMPTS, SEEDS, SamplingParams(max_new_tokens=10), LatentDiff(0.45))
    gens[1].tokens, gens[1].exit_depths = gens[1].tokens[:4], gens[1].exit_depths[:4]
    items = items_of(gens)
    together = replay(model, items, numerics="exact")
    for item, res in zip(items, together):
        (alone,) = replay(model, [item], numerics="exact")
        assert torch.equal(alone.logprobs, res.logprobs)
        assert torch.equal(alone.entropies, res.entropies)
        assert torch.equal(alone.hidden, res.hidden)


@pytest.mark.parametrize("family,policy", [CASES[0], CASES[2]])
def test_generation_batch_equals_alone(family: str, policy: ExitPolicy) -> None:
    model = model_of(family)
    sampling = SamplingParams(max_new_tokens=8)
    batch = generate(model, PROMPTS, SEEDS, sampling, policy, "exact")
    for b in range(len(PROMPTS)):
        (alone,) = generate(model, [PROMPTS[b]], [SEEDS[b]], sampling, policy, "exact")
        assert alone.tokens == batch[b].tokens
        assert alone.exit_depths == batch[b].exit_depths
        assert torch.equal(alone.logprobs, batch[b].logprobs)


def test_greedy_deterministic_and_sampling_seeded() -> None:
    model = model_of("huginn")
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    a = generate(model, PROMPTS, SEEDS, greedy, LatentDiff(0.45))
    b = generate(model, PROMPTS, SEEDS, greedy, LatentDiff(0.45))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    lp = behaviour_logprobs(torch.zeros(1, 512), 512, 1.0, 1.0)
    assert float(lp[0, 0]) == pytest.approx(-6.2383246)  # log(1/512)
    sampled = SamplingParams(max_new_tokens=8)
    c = generate(model, PROMPTS[:1], [5], sampled)
    d = generate(model, PROMPTS[:1], [5], sampled)
    e = generate(model, PROMPTS[:1], [6], sampled)
    assert c[0].tokens == d[0].tokens and c[0].tokens != e[0].tokens


def test_top_p_outside_nucleus_is_minus_inf_and_stop_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.0]])
    lp = behaviour_logprobs(logits, 5, 1.0, 0.8)
    p = torch.softmax(logits, -1)[0]
    assert p[0] < 0.8 < p[0] + p[1]  # the nucleus is {0, 1}
    assert torch.isinf(lp[0, [2, 3, 4]]).all()
    assert float(lp[0, :2].exp().sum()) == pytest.approx(1.0)
    model = model_of("llama")
    (g,) = generate(model, [PROMPTS[0]], [0], SamplingParams(max_new_tokens=30, greedy=True))
    stop = g.tokens[3]
    (h,) = generate(
        model,
        [PROMPTS[0]],
        [0],
        SamplingParams(max_new_tokens=30, greedy=True, stop_token_ids=(stop,)),
    )
    assert h.tokens == g.tokens[: g.tokens.index(stop) + 1] and h.finish_reason == "stop"


def test_replay_validation() -> None:
    model = model_of("huginn")
    with pytest.raises(ValueError, match="full depth"):  # deeper than the wire's uint8
        replay(model, [ReplayItem([1, 2], [3], 0, [256])])
    with pytest.raises(ValueError, match="one depth each"):
        replay(model, [ReplayItem([1, 2], [3, 4], 0, [6])])
    with pytest.raises(ValueError, match=r"exit_depths must be in \[1, exit_depths\[0\] = 4\]"):
        replay(model, [ReplayItem([1, 2], [3, 4], 0, [4, 5])])
    with pytest.raises(ValueError, match="latent seeds"):
        generate(model, [[1]], [-1], SamplingParams())


KV = dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def naive_layer(
    blk: Block,
    x: torch.Tensor,
    p: int,
    rope: torch.Tensor,
    kv: KV,
    key: tuple,
    src: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """One attention block for position p alone; keys of earlier positions come from src."""
    q, k, v = blk.qkv(x, rope, "exact")
    kv.setdefault(key, {})[p] = (k, v)
    ks = torch.cat([src(s)[0] for s in range(p)] + [k])[None]
    vs = torch.cat([src(s)[1] for s in range(p)] + [v])[None]
    mask = torch.ones(1, 1, p + 1, dtype=torch.bool)
    return blk.post(x, nx.attention(q[None], ks, vs, mask, "exact")[0], "exact")


@torch.no_grad()
def naive_logits(
    model: LoopedLM, tokens: list[int], depths: list[int], seed: int, last_exited: bool
) -> torch.Tensor:
    """Position by position with a dict KV cache, exact numerics. last_exited=True: the
    contract (a position runs its own depth; later queries at iteration d read its K/V of
    iteration min(d, its depth)). False: the alternative where every position keeps iterating
    to full depth and is read at iteration d (its readout still uses its own depth's state)."""
    mode, full = "exact", max(depths)
    kv: KV = {}
    out = []
    for p, tok in enumerate(tokens):
        pos = torch.tensor([p])
        rope = model.rope(pos, mode)
        e = model.embed(torch.tensor([tok]))
        for i, blk in enumerate(model.prelude_blocks()):
            e = naive_layer(blk, e, p, rope, kv, ("pre", i), lambda s, i=i: kv[("pre", i)][s])
        state = model.initial_state(e, pos, [seed])
        final = state
        for d in range(1, (depths[p] if last_exited else full) + 1):
            x = model.core_in(state, e, mode)
            for i, blk in enumerate(model.core_blocks()):
                if last_exited:
                    src = lambda s, d=d, i=i: kv[("core", min(d, depths[s]), i)][s]  # noqa: E731
                else:
                    src = lambda s, d=d, i=i: kv[("core", d, i)][s]  # noqa: E731
                x = naive_layer(blk, x, p, rope, kv, ("core", d, i), src)
            state = model.core_out(x, mode)
            if d == depths[p]:
                final = state
        x = model.readout_in(final, mode)
        for i, blk in enumerate(model.coda_blocks()):
            x = naive_layer(blk, x, p, rope, kv, ("coda", i), lambda s, i=i: kv[("coda", i)][s])
        out.append(model.head(model.readout_out(x, mode), mode)[0])
    return torch.stack(out)


@pytest.mark.parametrize("family,policy", [CASES[0], CASES[2]])
def test_last_exited_kv_rule(family: str, policy: ExitPolicy) -> None:
    model = model_of(family)
    policy = dataclasses.replace(policy, kv="last_exited")  # Ouro's default is kv='full'
    (g,) = generate(
        model, [PROMPTS[0]], [SEEDS[0]], SamplingParams(max_new_tokens=10), policy, "exact"
    )
    assert len(set(g.exit_depths)) >= 2
    seq = g.prompt_tokens + g.tokens[:-1]
    plen = len(g.prompt_tokens)
    depths = [g.full_depth] * (plen - 1) + g.exit_depths  # contract 2
    target = torch.tensor(g.tokens)

    def lps(logits: torch.Tensor) -> torch.Tensor:
        lp = behaviour_logprobs(logits[plen - 1 :], 512, 1.0, 1.0, "exact")
        return lp.gather(-1, target[:, None])[:, 0]

    rule = lps(naive_logits(model, seq, depths, g.latent_seed, last_exited=True))
    other = lps(naive_logits(model, seq, depths, g.latent_seed, last_exited=False))
    (rep,) = replay(model, items_of([g]), numerics="exact", kv="last_exited")
    assert float((rule - g.logprobs).abs().max()) <= 1e-6  # generation follows the rule
    assert float((rule - rep.logprobs).abs().max()) <= 1e-6  # and so does replay
    assert float((other - rule).abs().max()) > 1e-4  # the rule matters in this case
