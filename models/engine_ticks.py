"""Decode by ticks: every row at its own core iteration of its own token (issue 25).

`models.engine.run_chunk` decodes one token per row per chunk: a chunk runs the core until its
deepest row exits, so at a mean exit depth of D/2 a batch still runs ~D iterations, and where an
iteration's cost does not shrink with the rows still running (weight reads, launches, attention
over the whole layout: docs/PERFORMANCE.md "Depth batching") depth saves little. Here a *tick*
runs ONE core iteration for every unfinished row, each at its own iteration index and position:
a row whose token exits is read out (coda + head), its next token chosen, and it starts that
token's prelude and first iteration at the next tick while the other rows go on iterating. A
batch of B rows then advances B tokens every ~mean-depth ticks, each tick a full batch of core
work; the prelude and the readout run per tick on the rows that need them.

Same values as `run_chunk` decode, position by position: the same prelude / core / coda calls
on the same inputs (row-wise), K/V written in the same slots, `last_exited`'s copy rule applied
when a token exits (its iteration-e K/V copied into slots e+1 .. D), attention over the row's own
filled positions of the slot its iteration reads. In exact numerics the logits, the chosen
tokens and the whole cache are bit-identical to the chunk loop (tests/models/test_engine_ticks.py);
in fast numerics a matmul over another number of rows may pick another kernel.

Scope: kv `last_exited`; exit depths given per (row, token) (a schedule, as replay or a
stand-in for an exit policy gives them) or an exit policy judged per row at its own iteration
(`models.exits.should_exit` with per-row depths, each row's carry its own; LatentDiff, KL,
EntropyDiff, OuroGate: the same exits as `run_chunk`'s; not SampledGate yet, whose exit
log-probabilities are per iteration); the next token chosen greedily (argmax) by default or by
``choose``. What it is for: measuring what cross-token depth scheduling saves
(`benchmarks/depth_batching.py --paths ticks`); the torch engine's decode does not use it yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from models import numerics as nx
from models.engine import EngineModel, KVCache, _key_mask, _qkv, _seed_tensor
from models.exits import (
    ExitCarry,
    ExitPolicy,
    SampledGate,
    StepInfo,
    needs_gate,
    needs_logits,
    should_exit,
)
from models.layers import Block
from models.noise import latent_noise_torch


@dataclasses.dataclass
class TickOut:
    logits: Tensor
    """[B, T, V] fp32 readout logits of each fed token."""
    tokens: Tensor
    """[B, T] the token chosen after each fed token."""
    depths: Tensor
    """[B, T] iterations each fed token ran."""
    ticks: int
    """Core iterations run (each over every unfinished row)."""


def _stack_rows(
    blocks: Sequence[Block], slot: Callable[[int], Tensor], x: Tensor, b: Tensor, p: Tensor,
    slot_idx: Tensor | None, kmask: Tensor, rope: Tensor, mode: str,
) -> Tensor:  # fmt: skip
    """Blocks on rows x [M, h], one query each: row b[m] at position p[m]; K/V written into
    ``slot(layer)`` ([2, B, T, G, D], or [D, 2, B, T, G, D] indexed by ``slot_idx`` per row)
    and the row's keys read from there."""
    m = x.shape[0]
    for layer, blk in enumerate(blocks):
        q, k, v = _qkv(blk, x, rope, mode)
        s = slot(layer)
        if slot_idx is None:
            s[0, b, p], s[1, b, p] = k, v
            keys, vals = s[0].index_select(0, b), s[1].index_select(0, b)
        else:
            s[slot_idx, 0, b, p], s[slot_idx, 1, b, p] = k, v
            keys, vals = s[slot_idx, 0, b], s[slot_idx, 1, b]
        attn = nx.attention(q.view(m, 1, blk.n_heads, blk.head_dim), keys, vals, kmask, mode)
        x = blk.post(x, attn.reshape(m, -1), mode)
    return x


def decode_ticks(
    model: EngineModel, cache: KVCache, first: Tensor, start: Tensor, seeds: Sequence[int], *,
    max_depth: int, depths: Tensor | None = None, policy: ExitPolicy | None = None,
    tokens: int = 0, mode: str = "fast", choose: Callable[[Tensor], Tensor] | None = None,
    readout_every: int = 1,
) -> TickOut:  # fmt: skip
    """Feed ``first`` [B] at positions ``start`` [B], then each chosen token, T tokens a row,
    token t of row b exiting after ``depths[t, b]`` iterations (T = depths.shape[0]) or when
    the exit ``policy`` says (T = ``tokens``; evaluated per row at its own iteration, as
    `run_chunk` evaluates it per chunk: models.exits.should_exit with per-row depths; not
    SampledGate, whose exit log-probabilities are not computed here) (module doc).
    ``choose``: logits [M, V] -> tokens [M] (default argmax). ``readout_every`` k: the rows whose
    token exited wait (computing nothing) and are read out together every k ticks, and start
    their next token then: the coda, head and prelude weights are read once per k ticks instead
    of every tick, for k / 2 ticks of waiting per token on average (the same values)."""
    if readout_every < 1:
        raise ValueError(f"readout_every must be >= 1, got {readout_every}")
    nx.check_mode(mode)
    dev = cache.filled.device
    if (depths is None) == (policy is None):
        raise ValueError("decode_ticks needs exactly one of depths and policy")
    if isinstance(policy, SampledGate):
        raise ValueError("decode_ticks: SampledGate (sampled exits) is not supported yet")
    bsz = first.shape[0]
    if depths is None:
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1 with a policy, got {tokens}")
        depths = torch.full((tokens, bsz), max_depth, dtype=torch.int64)  # the forced exit
    n_tok = depths.shape[0]
    if bsz != depths.shape[1] or bsz != start.shape[0] or len(seeds) != bsz:
        raise ValueError("first, start, seeds and depths must agree on the batch")
    if bool(((depths < 1) | (depths > max_depth)).any()):
        raise ValueError(f"depths must be in [1, {max_depth}]")
    if max_depth > cache.core.shape[0]:
        raise ValueError(f"max_depth {max_depth} exceeds the cache's {cache.core.shape[0]} slots")
    pick = choose or (lambda lg: lg.argmax(dim=-1))
    dep = depths.to(dev)
    seed_t = _seed_tensor(seeds, dev)
    tok = first.to(dev).clone()
    pos = start.to(dev).clone()
    t_of = torch.zeros(bsz, dtype=torch.int64, device=dev)  # token index of each row
    it = torch.zeros(bsz, dtype=torch.int64, device=dev)  # iterations done of that token
    h = model.embed(tok[:1]).shape[-1]
    state = torch.zeros(bsz, h, dtype=cache.core.dtype, device=dev)
    e = torch.zeros_like(state)
    zeros = torch.zeros(bsz, n_tok, dtype=torch.int64, device=dev)
    outs = TickOut(torch.empty(0), zeros, zeros.clone(), 0)  # logits made at the first readout
    noise_here = dev.type != "cpu" and getattr(model, "draws_latent_noise", False)
    stop = torch.zeros(bsz, dtype=torch.bool, device=dev)  # the policy said exit
    carry: dict[str, Tensor] = {}  # the policy's per-row carry (ExitCarry fields), [B, ...]
    rows = torch.arange(bsz, device=dev)
    ticks = 0
    while True:
        live = t_of < n_tok
        waiting = live & (stop | (it == dep[t_of.clamp(max=n_tok - 1), rows]))
        n_live, n_wait = torch.stack([live.sum(), waiting.sum()]).tolist()  # one host sync
        if not n_live:
            break
        if n_wait and (ticks % readout_every == 0 or n_wait == n_live):
            _exit(model, cache, rows[waiting], state, pos, it, t_of, tok, stop, max_depth, mode,
                  pick, outs)  # fmt: skip
            continue
        run = rows[live & ~waiting]
        new = run[it[run] == 0]  # rows starting a token: its prelude and initial state
        if new.numel():
            p = pos[new]
            cache.filled[new, p] = True
            kmask = _key_mask(cache.filled.index_select(0, new), p[:, None])
            x0 = model.embed(tok[new]).to(cache.core.dtype)
            en = _stack_rows(model.prelude_blocks(), lambda i: cache.prelude[i], x0, new, p,
                             None, kmask, model.rope(p, mode), mode)  # fmt: skip
            sd = [int(seeds[i]) for i in new.tolist()]
            noise = latent_noise_torch(seed_t[new], p, en.shape[-1]) if noise_here else None
            e[new] = en
            state[new] = model.initial_state(en, p, sd, noise).to(en.dtype)
        p = pos[run]
        kmask = _key_mask(cache.filled.index_select(0, run), p[:, None])
        slot = it[run]
        x = model.core_in(state[run], e[run], mode)
        x = _stack_rows(model.core_blocks(), lambda i: cache.core[:, i], x, run, p, slot,
                        kmask, model.rope(p, mode), mode)  # fmt: skip
        new_state = model.core_out(x, mode)
        prev, state[run] = state[run], new_state
        it[run] += 1
        ticks += 1
        if policy is not None:
            stop[run] = _policy_exits(model, cache, policy, run, it[run], new_state, prev, p,
                                      max_depth, mode, carry)  # fmt: skip
    outs.ticks = ticks
    return outs


_CARRY = ("prev_logprobs", "prev_entropy", "remaining", "cumulative")


def _policy_exits(
    model: EngineModel, cache: KVCache, policy: ExitPolicy, run: Tensor, depth: Tensor,
    state: Tensor, prev: Tensor, pos: Tensor, max_depth: int, mode: str,
    carry: dict[str, Tensor],
) -> Tensor:  # fmt: skip
    """[M] the policy's exit decision for rows ``run`` after their iteration ``depth`` [M];
    rows at their first iteration are judged with no carry (as run_chunk's first iteration),
    the others with their own carry, which is kept per row in ``carry``."""
    info = StepInfo(depth, max_depth, state, prev, mode=mode)
    if needs_logits(policy):  # the readout of the new state (writes its coda K/V, as run_chunk)
        kmask = _key_mask(cache.filled.index_select(0, run), pos[:, None])
        xr = _stack_rows(model.coda_blocks(), lambda i: cache.coda[i], model.readout_in(state, mode),
                         run, pos, None, kmask, model.rope(pos, mode), mode)  # fmt: skip
        info.logits = model.head(model.readout_out(xr, mode), mode)
    if needs_gate(policy):
        info.gate_logit = model.gate_logit(state, mode)
    hit = torch.zeros(run.shape[0], dtype=torch.bool, device=state.device)
    first = depth == 1
    for part in (first, ~first):  # one call per group: the first without a carry
        idx = part.nonzero()[:, 0]
        if not idx.numel():
            continue
        sub = StepInfo(depth[idx], max_depth, state[idx], prev[idx], mode=mode,
                       logits=None if info.logits is None else info.logits[idx],
                       gate_logit=None if info.gate_logit is None else info.gate_logit[idx])  # fmt: skip
        rows = run[idx]
        before = None
        if part is not first:
            before = ExitCarry(**{k: v[rows] for k, v in carry.items()})
        h, after = should_exit(policy, sub, before)
        hit[idx] = h.to(hit.device)
        for k in _CARRY:
            v = getattr(after, k)
            if v is None:
                continue
            if k not in carry:
                carry[k] = v.new_zeros((cache.filled.shape[0], *v.shape[1:]))
            carry[k][rows] = v
    return hit


def _exit(
    model: EngineModel, cache: KVCache, done: Tensor, state: Tensor, pos: Tensor, it: Tensor,
    t_of: Tensor, tok: Tensor, stop: Tensor, max_depth: int, mode: str,
    pick: Callable[[Tensor], Tensor], outs: TickOut,
) -> None:  # fmt: skip
    """Rows ``done`` exited after ``it`` iterations: last_exited's K/V copies, the readout,
    the next token chosen and recorded; the rows move to it (position + 1, iteration 0)."""
    dev = state.device
    pd, ed = pos[done], it[done]
    copy = ed < max_depth  # last_exited: the exit iteration's K/V in every later slot
    if bool(copy.any()):
        cb, cp, ce = done[copy], pd[copy], ed[copy]
        later = torch.arange(max_depth, device=dev)[None, :] >= ce[:, None]  # [K, D]
        k_i, j = later.nonzero(as_tuple=True)
        cache.core[j, :, :, cb[k_i], cp[k_i]] = cache.core[ce[k_i] - 1, :, :, cb[k_i], cp[k_i]]
    kmask = _key_mask(cache.filled.index_select(0, done), pd[:, None])
    xr = model.readout_in(state[done], mode)
    xr = _stack_rows(model.coda_blocks(), lambda i: cache.coda[i], xr, done, pd, None,
                     kmask, model.rope(pd, mode), mode)  # fmt: skip
    lg = model.head(model.readout_out(xr, mode), mode)
    if not outs.logits.numel():
        outs.logits = lg.new_zeros(*outs.tokens.shape, lg.shape[-1])
    td = t_of[done]
    nxt = pick(lg)
    outs.logits[done, td] = lg
    outs.tokens[done, td] = nxt
    outs.depths[done, td] = ed
    tok[done] = nxt
    stop[done] = False
    pos[done] += 1
    t_of[done] += 1
    it[done] = 0


__all__ = ["TickOut", "decode_ticks"]
