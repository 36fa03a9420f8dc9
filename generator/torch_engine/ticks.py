"""The torch engine's adaptive decode by ticks (`TorchEngine(ticks=k)`): requests
decoded on a `models.engine.ticks.Ticker`, every row at its own core iteration of its own token,
instead of one `run_chunk` per decoded token whose deepest row sets the iterations of all.

The engine's loop otherwise: a free slot takes the next request, whose prompt is prefilled by
`run_chunk` at full depth (token 0 under the policy where contract 2 says so) while the other
rows keep their place mid-token (a prefill writes only its own rows' cache); rows read out by
the ticker are sampled as the chunk decode samples them (`TorchEngine._sample_rows`: the same
keys, so the same tokens), and fed their next token unless finished. Samples (tokens, log-probs, exit depths)
equal the chunk decode's, bit for bit in exact numerics (tests/generator/test_torch_ticks.py).
Sampled exits (SampledGate) file their exit log-probs as the chunk decode does. Not for kv
'full' or the fixed-depth graph decode."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from models.engine.chunk import KVCache
from models.engine.graph import compiled_regions
from models.engine.tickgraph import GraphTicker, graph_policy
from models.engine.ticks import Ticker


def check_ticks(ticks: int, kv: str, graph: bool) -> int:
    """``ticks`` if the engine can decode by ticks with these settings, else ValueError."""
    if ticks < 0:
        raise ValueError(f"ticks must be >= 0 (0: one chunk per token), got {ticks}")
    if ticks and (kv != "last_exited" or graph):
        raise ValueError("decode by ticks needs kv last_exited and no graph decode (a fixed "
                         f"depth on a GPU): kv {kv!r}, graph {graph}")  # fmt: skip
    return ticks


def resolve_tick_graph(tick_graph: bool | None, ticks: int, policy: Any, device: Any) -> bool:
    """Whether decode by ticks runs at one shape (`GraphTicker`, a CUDA graph on CUDA): None =
    on CUDA when the policy decides on the device (`graph_policy`); True refused for a policy
    that does not, or without ticks."""
    if tick_graph is None:
        return bool(ticks) and device.type == "cuda" and graph_policy(policy)
    if tick_graph and not ticks:
        raise ValueError("tick_graph needs decode by ticks (ticks >= 1)")
    if tick_graph and not graph_policy(policy):
        raise ValueError(f"tick_graph: {type(policy).__name__} reads a readout every iteration "
                         "(eager ticks only)")  # fmt: skip
    return bool(tick_graph)


def generate_by_ticks(eng: Any, reqs: list[Any], cache: KVCache,
                      kept: GraphTicker | None = None) -> Ticker:  # fmt: skip
    """Decode ``reqs`` (a TorchEngine's requests) into their own records (tokens, log-probs,
    depths) on ``cache``'s rows; ``eng``: the TorchEngine (its prefill, sampling and feed; typed
    loosely so that this module does not import generator.torch_engine.engine, which imports it).
    With ``eng.tick_graph`` the ticks run at one shape in a CUDA graph
    (`models.engine.tickgraph.GraphTicker`; ``kept``: the previous call's on this cache, its
    graph reused). Returns the ticker."""
    bsz = cache.filled.shape[0]
    ticker: Ticker
    if kept is not None:
        ticker = kept
        ticker.reset()
    elif eng.tick_graph:
        ticker = GraphTicker(eng.model, cache, [0] * bsz, max_depth=eng.full_depth,
                             policy=eng.policy, mode=eng.numerics, readout_every=eng.ticks,
                             graph=eng.device.type == "cuda",
                             regions=compiled_regions() if eng.compile else None,
                             readout_rows=None if eng.readout_rows is None
                             else min(eng.readout_rows, bsz))  # fmt: skip
    else:
        ticker = Ticker(eng.model, cache, [0] * bsz, max_depth=eng.full_depth, policy=eng.policy,
                        mode=eng.numerics, readout_every=eng.ticks)  # fmt: skip
    sampling = {(0.0, 1.0) if r.work.temperature == 0 else
                (float(r.work.temperature), float(r.work.top_p)) for r in reqs}  # fmt: skip
    if isinstance(ticker, GraphTicker) and len(sampling) == 1:  # the readout in the replay
        _by_graph_steps(eng, reqs, cache, ticker, *sampling.pop())
        return ticker
    slots: list[Any] = [None] * bsz
    waiting = deque(reqs)
    pending: list[tuple[list[int], torch.Tensor]] = []  # rows and their logits [M, V] to sample
    while True:
        free = [b for b in range(bsz) if slots[b] is None][: len(waiting)]
        for b in free:
            slots[b] = waiting.popleft()
            ticker.set_seed(b, slots[b].seed)
        if free:
            pre = eng._prefill(cache, slots, free)
            pending.append((list(pre), torch.stack(list(pre.values()))))
        _sample_and_feed(eng, ticker, slots, pending)
        pending.clear()
        if not waiting and all(s is None for s in slots):
            return ticker
        if waiting and any(s is None for s in slots):
            continue  # fill the freed slots first
        done, out, depths = ticker.advance()
        elp = None if ticker.exit_logprobs is None else ticker.exit_logprobs.tolist()
        rows, exits = done.tolist(), depths.tolist()  # (one read each, not one per row)
        for k, b in enumerate(rows):
            r = slots[b]
            assert r is not None
            r.depths.append(int(exits[k]))
            if eng.sampled:  # a sampled exit: its log-prob, as the chunk decode files it
                r.exit_lps.append(0.0 if elp is None else float(elp[k]))
        if rows:
            pending.append((rows, out))


def _sample_and_feed(eng: Any, ticker: Ticker, slots: list[Any],
                     blocks: list[tuple[list[int], torch.Tensor]]) -> list[int]:  # fmt: skip
    """Draw the next token of each block's rows from its logits (`TorchEngine._sample_block`),
    free the slots whose request finished, feed the others their token; returns those rows."""
    sampled = [b for rows, _ in blocks for b in rows]
    for rows, block in blocks:
        eng._sample_block(slots, rows, block, eng.weight_version)
    go = [b for b in sampled if not slots[b].finish]
    for b in sampled:
        if slots[b].finish:
            slots[b] = None
    if go:
        toks, pos = eng._feed(slots)
        ticker.feed(go, toks[go].tolist(), pos[go].tolist())
    return go


def _by_graph_steps(eng: Any, reqs: list[Any], cache: KVCache, ticker: GraphTicker,
                    temperature: float, top_p: float) -> None:  # fmt: skip
    """`generate_by_ticks` with every request at one (temperature, top_p): each
    `GraphTicker.step` (one CUDA graph replay on a GPU) runs ``readout_every`` ticks, then
    reads out, draws and feeds the rows that exited; the host files what it read back (one
    read a step) and retires the finished rows. Requests start in slots two ways: when nothing
    runs (the call's first fill) their prompts are one prefill chunk (`TorchEngine._prefill`,
    token 0 drawn by `_sample_block`); a slot freed while others run takes the next request
    whose prompt is fed token by token through the same ticks (`GraphTicker.feed_prompts`: no
    eager prefill between steps, launch-bound on a GPU; token 0 drawn at the last prompt
    position's readout)."""
    bsz = cache.filled.shape[0]
    ticker.sample_in_graph(temperature, top_p, eng.model.vocab_size, eng.token0_policy)
    slots: list[Any] = [None] * bsz
    waiting = deque(reqs)
    inflight: tuple[int, list[Any]] | None = None  # a launched step and its slots' requests
    while True:
        free = [b for b in range(bsz) if slots[b] is None][: len(waiting)]
        if free:
            idle = inflight is None and all(s is None for s in slots)
            for b in free:
                slots[b] = waiting.popleft()
                ticker.set_seed(b, slots[b].seed)
            if idle:  # nothing runs: one prefill chunk for them all, token 0 drawn here
                pre = eng._prefill(cache, slots, free)
                block = torch.stack([pre[b] for b in free])
                go = _sample_and_feed(eng, ticker, slots, [(free, block)])
                ticker.set_keys(go, [slots[b].key for b in go], [1] * len(go))
                if waiting and any(s is None for s in slots):
                    continue  # (requests finished at token 0)
            else:  # rows run: the prompts go through the ticks (no eager prefill between steps)
                ticker.feed_prompts(free, [slots[b].prompt for b in free])
                ticker.set_keys(free, [slots[b].key for b in free], [0] * len(free))
        if inflight is None and all(s is None for s in slots):
            return
        # the next step is queued before the host files the one in flight (its outputs come
        # back while the GPU runs): a request finished there runs one more step, ignored
        nxt = (ticker.launch(), list(slots)) if any(s is not None for s in slots) else None
        if inflight is not None:
            read, tok, lp, depth, elp = ticker.collect(inflight[0])
            done = []
            for b, r in enumerate(inflight[1]):  # the requests the step ran for
                if not read[b] or r is None or r.finish:
                    continue
                r.depths.append(int(depth[b]))
                if eng.sampled:  # a sampled exit: its log-prob, as the chunk decode files it
                    r.exit_lps.append(float(elp[b]))
                if r.take(int(tok[b]), lp[b], eng.weight_version):
                    done.append(b)
                    slots[b] = None
            ticker.retire(done)
        inflight = nxt


__all__ = ["check_ticks", "generate_by_ticks"]
