"""Decode by ticks (models.engine.ticks): every row at its own core iteration of its
own token. Against the chunk loop it replaces (`models.engine.chunk.run_chunk`, one token per row per
chunk, the same exit depths): logits, chosen tokens, depths and the whole KV cache bit for bit
in exact numerics, within 1e-6 in fast; the ticks run are the deepest row's summed depths, not
the tokens x the deepest depth of each chunk. Each test runs the eager, compacted `Ticker` and
the fixed-shape `GraphTicker` (models.engine.tickgraph: every row every tick, no host sync,
the ticks a CUDA graph on a GPU; eager here on the same buffers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import numerics as nx
from models.engine.chunk import KVCache, run_chunk
from models.engine.tickgraph import GraphTicker
from models.engine.ticks import Ticker, decode_ticks
from models.exits import KL, ExitPolicy, LatentDiff, OuroGate, SampledGate
from tests.models.test_reference import model_of

B, P, T = 5, 4, 6


def _setup(family: str, depth: int) -> tuple[object, KVCache, torch.Tensor, list[int]]:
    model = model_of(family)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, int(model.vocab_size), (B, P), generator=g)
    seeds = [11, 2**64 - 3, 12345, 7, 99][:B]
    cache = KVCache.empty(model, B, P + T + 1, depth)
    out = run_chunk(model, cache, prompt, torch.arange(P).expand(B, P), torch.ones(B, P, dtype=torch.bool),
                    seeds, max_depth=depth, depths=torch.full((B, P), depth), mode="exact")  # fmt: skip
    return model, cache, out.logits[:, -1].argmax(dim=-1), seeds


def _clone(c: KVCache) -> KVCache:
    return KVCache(c.prelude.clone(), c.core.clone(), c.coda.clone(), c.filled.clone())


TICKERS = pytest.mark.parametrize("ticker", [Ticker, GraphTicker], ids=["eager", "fixed_shape"])


@TICKERS
@pytest.mark.parametrize(
    "family,mode,every",
    [("huginn", "exact", 1), ("ouro", "exact", 1), ("huginn", "fast", 1), ("huginn", "exact", 3)],
)
@torch.no_grad()
def test_ticks_equal_the_chunk_loop(
    family: str, mode: str, every: int, ticker: type[Ticker]
) -> None:
    """(every: readout_every, the exited rows read out together every k ticks.)"""
    model = model_of(family)
    depth = int(model.max_depth)
    model, cache, first, seeds = _setup(family, depth)
    g = torch.Generator().manual_seed(5)
    sched = torch.randint(1, depth + 1, (T, B), generator=g)
    sched[0, 0] = depth  # the full depth once, one row always exiting after 1 iteration
    sched[:, 1] = 1
    ref_cache, tick_cache = _clone(cache), _clone(cache)
    tok, ref_logits, ref_tokens = first, [], []
    for t in range(T):
        pos = torch.full((B, 1), P + t)
        o = run_chunk(model, ref_cache, tok[:, None], pos, torch.ones(B, 1, dtype=torch.bool), seeds,
                      max_depth=depth, depths=sched[t][:, None], mode=mode)  # fmt: skip
        ref_logits.append(o.logits[:, 0])
        tok = o.logits[:, 0].argmax(dim=-1)
        ref_tokens.append(tok)
    out = decode_ticks(model, tick_cache, first, torch.full((B,), P), seeds, max_depth=depth,
                       depths=sched, mode=mode, readout_every=every, ticker_cls=ticker)  # fmt: skip
    assert torch.equal(out.tokens, torch.stack(ref_tokens, 1))
    assert torch.equal(out.depths, sched.T)
    got, want = out.logits, torch.stack(ref_logits, 1)
    if mode == "exact":
        assert torch.equal(got, want)
        for a, b in [(tick_cache.prelude, ref_cache.prelude), (tick_cache.core, ref_cache.core),
                     (tick_cache.coda, ref_cache.coda), (tick_cache.filled, ref_cache.filled)]:  # fmt: skip
            assert torch.equal(a, b)
    else:
        assert float((got - want).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))
    # ticks: the longest row's summed depths (each tick one iteration of every unfinished row),
    # fewer than the chunk loop's iterations (each chunk to its deepest row)
    if every == 1:
        assert out.ticks == int(sched.sum(0).max()) < int(sched.max(1).values.sum())
    else:  # waiting rows compute nothing: the same values, at most k - 1 idle ticks a token
        assert int(sched.sum(0).max()) <= out.ticks <= int(sched.sum(0).max()) + T * (every - 1)


def test_bad_depths_are_refused() -> None:
    model, cache, first, seeds = _setup("huginn", 4)
    with pytest.raises(ValueError, match=r"depths must be in \[1, 4\]"):
        decode_ticks(model, cache, first, torch.full((B,), P), seeds, max_depth=4,
                     depths=torch.zeros(T, B, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="agree on the batch"):
        decode_ticks(model, cache, first[:2], torch.full((B,), P), seeds, max_depth=4,
                     depths=torch.ones(T, B, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="readout_every must be >= 1"):
        decode_ticks(model, cache, first, torch.full((B,), P), seeds, max_depth=4,
                     depths=torch.ones(T, B, dtype=torch.int64), readout_every=0)  # fmt: skip


@TICKERS
@pytest.mark.parametrize(
    "family,policy,mode",
    [
        ("huginn", LatentDiff(0.45), "exact"),
        ("huginn", KL(0.1), "exact"),  # the policy's readout per iteration, per row
        ("ouro", OuroGate(0.8), "exact"),
        ("ouro", SampledGate(), "exact"),
        ("huginn", LatentDiff(0.45), "fast"),
    ],
)
@torch.no_grad()
def test_ticks_with_an_exit_policy_equal_the_chunk_loop(
    family: str, policy: ExitPolicy, mode: str, ticker: type[Ticker]
) -> None:
    """The exit policy judged per row at its own iteration (models.exits.should_exit with
    per-row depths; each row's carry its own) decides what run_chunk's policy decides per chunk:
    the same exit depths (mixed), tokens, logits and cache."""
    model = model_of(family)
    depth = int(model.max_depth)
    model, cache, first, seeds = _setup(family, depth)
    pol = dataclasses.replace(policy, kv="last_exited")  # type: ignore[type-var]
    if ticker is GraphTicker and isinstance(pol, KL):  # a readout per iteration: eager ticks
        with pytest.raises(ValueError, match="reads a readout every iteration"):
            GraphTicker(model, _clone(cache), seeds, max_depth=depth, policy=pol, mode=mode)
        return
    ref_cache, tick_cache = _clone(cache), _clone(cache)
    tok, ref_logits, ref_tokens, ref_depths = first, [], [], []
    for t in range(T):
        o = run_chunk(model, ref_cache, tok[:, None], torch.full((B, 1), P + t),
                      torch.ones(B, 1, dtype=torch.bool), seeds, max_depth=depth, policy=pol,
                      mode=mode)  # fmt: skip
        ref_logits.append(o.logits[:, 0])
        ref_depths.append(o.depths[:, 0])
        tok = o.logits[:, 0].argmax(dim=-1)
        ref_tokens.append(tok)
    want_depths = torch.stack(ref_depths, 1)
    assert len(set(want_depths.flatten().tolist())) >= 2, "mixed exit depths needed"
    out = decode_ticks(model, tick_cache, first, torch.full((B,), P), seeds, max_depth=depth,
                       policy=pol, tokens=T, mode=mode, ticker_cls=ticker)  # fmt: skip
    assert torch.equal(out.depths, want_depths)
    assert torch.equal(out.tokens, torch.stack(ref_tokens, 1))
    got, want = out.logits, torch.stack(ref_logits, 1)
    if mode == "exact":
        assert torch.equal(got, want)
        assert torch.equal(tick_cache.core, ref_cache.core)
        assert torch.equal(tick_cache.coda, ref_cache.coda)
    else:
        assert float((got - want).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "family,policy,mode,every",
    [("huginn", LatentDiff(0.45), "exact", 1), ("ouro", SampledGate(), "exact", 3),
     ("ouro", OuroGate(0.8), "fast", 2)],
)  # fmt: skip
@torch.no_grad()
def test_graph_ticks_on_cuda(family: str, policy: ExitPolicy, mode: str, every: int) -> None:
    """On CUDA the fixed-shape ticks are a CUDA graph (``every`` ticks a replay): in exact
    numerics the eager Ticker's logits, tokens, depths and cache bit for bit (Huginn's latent
    noise drawn on the device); in fast numerics the same ticks run eagerly on the same
    buffers (graph=False), bit for bit."""
    import copy
    import functools

    model = copy.deepcopy(model_of(family)).cuda()
    depth = int(model.max_depth)
    pol = dataclasses.replace(policy, kv="last_exited")  # type: ignore[type-var]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, int(model.vocab_size), (B, P), generator=g).cuda()
    seeds = [11, 2**64 - 3, 12345, 7, 99][:B]
    cache = KVCache.empty(model, B, P + T + 1, depth)
    pre = run_chunk(model, cache, prompt, torch.arange(P, device="cuda").expand(B, P),
                    torch.ones(B, P, dtype=torch.bool, device="cuda"), seeds, max_depth=depth,
                    depths=torch.full((B, P), depth, device="cuda"), mode=mode)  # fmt: skip
    first = pre.logits[:, -1].argmax(dim=-1)
    want_cls = Ticker if mode == "exact" else functools.partial(GraphTicker, graph=False)
    outs, caches = [], []
    for cls in (want_cls, GraphTicker):
        c = _clone(cache)
        with nx.fused_generation(mode == "fast"):  # the torch engine's kernels (slot attention)
            outs.append(decode_ticks(model, c, first, torch.full((B,), P, device="cuda"), seeds,
                                     max_depth=depth, policy=pol, tokens=T, mode=mode,
                                     readout_every=every, ticker_cls=cls))  # fmt: skip
        caches.append(c)
    want, got = outs
    assert len(set(want.depths.flatten().tolist())) >= 2, "mixed exit depths needed"
    assert torch.equal(got.depths, want.depths)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(caches[1].core, caches[0].core)


@pytest.mark.parametrize("n", [1, 3, 7, 8])
def test_first_rows_takes_the_first_exited_rows_at_a_fixed_shape(n: int) -> None:
    """`first_rows(w, n)` (the compacted readout's row choice): the first n True rows of w by
    index are selected; idx holds n distinct rows, the selected ones first in order; valid =
    sel[idx]. Masks with none, fewer than n, exactly n and more than n rows set."""
    from models.engine.tickdecide import first_rows

    g = torch.Generator().manual_seed(5)
    masks = [torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)]
    masks += [torch.rand(8, generator=g) < p for p in (0.2, 0.5, 0.8) for _ in range(4)]
    for w in masks:
        sel, idx, valid = first_rows(w, n)
        want = [i for i in range(8) if bool(w[i])][:n]
        assert [i for i in range(8) if bool(sel[i])] == want
        assert idx.shape == (n,) and len(set(idx.tolist())) == n
        assert idx[: len(want)].tolist() == want
        assert valid.tolist() == [True] * len(want) + [False] * (n - len(want))
