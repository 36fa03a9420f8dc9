"""Decode by ticks: every row at its own core iteration of its own token.

`models.engine.chunk.run_chunk` decodes one token per row per chunk: a chunk runs the core until its
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
EntropyDiff, OuroGate, and SampledGate with each row's exit uniforms and exit log-probability
drawn and summed at its own iterations: the same exits as `run_chunk`'s); the next token chosen greedily (argmax) by default or by
``choose``. What it is for: measuring what cross-token depth scheduling saves
(`benchmarks/depth_batching.py --paths ticks`); the torch engine's decode does not use it yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from models import numerics as nx
from models.engine.chunk import EngineModel, KVCache, _key_mask, _qkv, _seed_tensor
from models.exits import (
    ExitCarry,
    ExitPolicy,
    SampledGate,
    StepInfo,
    exit_step_logprob,
    needs_gate,
    needs_logits,
    should_exit,
)
from models.kernels.noise import latent_noise_cuda
from models.layers import Block
from models.noise import exit_uniform


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


class Ticker:
    """Decode by ticks, resumable (module doc): ``feed`` rows a token each (at a position, with
    an exit depth or under the policy), ``advance`` runs ticks until rows exit and returns them
    read out; the caller chooses their next tokens and feeds them (or new requests' tokens after
    a prefill of their own) while the other rows keep their place. Rows never fed are idle.

    model, cache: as `models.engine.chunk.run_chunk`'s (the cache's rows are the ticker's rows);
    seeds: the rows' latent seeds (``set_seed`` when a row takes a new request); policy: an exit
    policy, or None when every fed token carries its exit depth;
    readout_every k: exited rows wait and are read out together every k ticks."""

    def __init__(
        self, model: EngineModel, cache: KVCache, seeds: Sequence[int], *, max_depth: int,
        policy: ExitPolicy | None = None, mode: str = "fast", readout_every: int = 1,
    ) -> None:  # fmt: skip
        nx.check_mode(mode)
        if readout_every < 1:
            raise ValueError(f"readout_every must be >= 1, got {readout_every}")
        if max_depth > cache.core.shape[0]:
            raise ValueError(
                f"max_depth {max_depth} exceeds the cache's {cache.core.shape[0]} slots"
            )
        dev = cache.filled.device
        bsz = cache.filled.shape[0]
        if len(seeds) != bsz:
            raise ValueError(f"{len(seeds)} seeds for a cache of {bsz} rows")
        self.model, self.cache, self.policy, self.mode = model, cache, policy, mode
        self.max_depth, self.every = max_depth, readout_every
        self.seeds = [int(x) for x in seeds]
        self.seed_t = _seed_tensor(self.seeds, dev)
        self.rows = torch.arange(bsz, device=dev)
        self.tok = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.it = torch.zeros(bsz, dtype=torch.int64, device=dev)  # iterations done
        self.target = torch.full((bsz,), max_depth, dtype=torch.int64, device=dev)
        self.live = torch.zeros(bsz, dtype=torch.bool, device=dev)  # a fed token in progress
        self.stop = torch.zeros(bsz, dtype=torch.bool, device=dev)  # the policy said exit
        h = model.embed(self.tok[:1]).shape[-1]
        self.state = torch.zeros(bsz, h, dtype=cache.core.dtype, device=dev)
        self.e = torch.zeros_like(self.state)
        self.carry: dict[str, Tensor] = {}  # the policy's per-row carry (ExitCarry fields)
        self.sampled = isinstance(policy, SampledGate)
        self.elp = torch.zeros(bsz, dtype=torch.float64 if mode == "exact" else torch.float32,
                               device=dev)  # a sampled exit's log-prob so far  # fmt: skip
        self.exit_logprobs: Tensor | None = None
        """After ``advance``: the read-out rows' exit log-probs (SampledGate), else None."""
        self.noise_here = dev.type != "cpu" and getattr(model, "draws_latent_noise", False)
        self.ticks = 0

    def set_seed(self, row: int, seed: int) -> None:
        """Row ``row``'s latent seed (a new request in that slot)."""
        self.seeds[row] = int(seed)
        self.seed_t[row] = _seed_tensor([seed], self.seed_t.device)[0]

    def feed(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
             depths: Sequence[int] | None = None) -> None:  # fmt: skip
        """Rows ``rows`` start ``tokens`` at ``positions`` (exit depths ``depths``, needed
        without a policy; with one the forced exit at max_depth)."""
        dev = self.cache.filled.device
        r = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
        if bool(self.live[r].any()):
            raise ValueError("a row was fed while its token is still in progress")
        if depths is None:
            if self.policy is None:
                raise ValueError("without a policy every fed token needs its exit depth")
            d = torch.full((len(rows),), self.max_depth, dtype=torch.int64, device=dev)
        else:
            d = torch.as_tensor(list(depths), dtype=torch.int64, device=dev)
            if bool(((d < 1) | (d > self.max_depth)).any()):
                raise ValueError(f"depths must be in [1, {self.max_depth}]")
        self.tok[r] = torch.as_tensor(list(tokens), dtype=torch.int64, device=dev)
        self.pos[r] = torch.as_tensor(list(positions), dtype=torch.int64, device=dev)
        self.target[r], self.it[r], self.stop[r], self.live[r] = d, 0, False, True
        self.elp[r] = 0.0

    def advance(self) -> tuple[Tensor, Tensor, Tensor]:
        """Run ticks until rows exit; (those rows [M], their readout logits [M, V], their exit
        depths [M]), the rows idle until fed again. Empty tensors when no row is live."""
        m, cache, mode = self.model, self.cache, self.mode
        while True:
            live = self.live
            waiting = self._waiting()
            n_live, n_wait = torch.stack([live.sum(), waiting.sum()]).tolist()  # one host sync
            if not n_live:
                empty = self.rows[:0]
                return empty, self.state.new_zeros(0, 0), empty
            if n_wait and (self.ticks % self.every == 0 or n_wait == n_live):
                return self._read_out(self.rows[waiting])
            run = self.rows[live & ~waiting]
            new = run[self.it[run] == 0]  # rows starting a token: its prelude and initial state
            if new.numel():
                self._start(new)
            p = self.pos[run]
            kmask = _key_mask(cache.filled.index_select(0, run), p[:, None])
            x = m.core_in(self.state[run], self.e[run], mode)
            x = _stack_rows(m.core_blocks(), lambda i: cache.core[:, i], x, run, p, self.it[run],
                            kmask, m.rope(p, mode), mode)  # fmt: skip
            new_state = m.core_out(x, mode)
            prev = self.state[run]
            self.state[run] = new_state
            self.it[run] += 1
            self.ticks += 1
            if self.policy is not None:
                self.stop[run] = _policy_exits(m, cache, self.policy, run, self.it[run], new_state,
                                               prev, p, self.max_depth, mode, self.carry,
                                               self.seed_t[run], self.elp if self.sampled else None)  # fmt: skip

    def _waiting(self) -> Tensor:
        """[B] bool: rows whose token exited (the policy said so, or its depth is reached) and
        waits for its readout."""
        return self.live & (self.stop | (self.it == self.target))

    def _start(self, new: Tensor) -> None:
        """Rows ``new`` start their fed token: its position filled, the prelude (its K/V
        written), the embedding ``e`` and the initial state (Huginn's latent noise)."""
        m, cache, mode = self.model, self.cache, self.mode
        p = self.pos[new]
        cache.filled[new, p] = True
        kmask = _key_mask(cache.filled.index_select(0, new), p[:, None])
        x0 = m.embed(self.tok[new]).to(cache.core.dtype)
        en = _stack_rows(m.prelude_blocks(), lambda i: cache.prelude[i], x0, new, p,
                         None, kmask, m.rope(p, mode), mode)  # fmt: skip
        sd = [self.seeds[i] for i in new.tolist()]
        noise = (latent_noise_cuda(self.seed_t[new], p, en.shape[-1])
                 if self.noise_here else None)  # fmt: skip
        self.e[new] = en
        self.state[new] = m.initial_state(en, p, sd, noise).to(en.dtype)

    def _read_out(self, done: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rows ``done`` exited: last_exited's K/V copies, the readout; the rows go idle."""
        m, cache, mode, dev = self.model, self.cache, self.mode, self.cache.filled.device
        pd, ed = self.pos[done], self.it[done]
        copy = ed < self.max_depth  # last_exited: the exit iteration's K/V in every later slot
        if bool(copy.any()):
            cb, cp, ce = done[copy], pd[copy], ed[copy]
            later = torch.arange(self.max_depth, device=dev)[None, :] >= ce[:, None]  # [K, D]
            k_i, j = later.nonzero(as_tuple=True)
            cache.core[j, :, :, cb[k_i], cp[k_i]] = cache.core[ce[k_i] - 1, :, :, cb[k_i], cp[k_i]]
        kmask = _key_mask(cache.filled.index_select(0, done), pd[:, None])
        xr = _stack_rows(m.coda_blocks(), lambda i: cache.coda[i], m.readout_in(self.state[done], mode),
                         done, pd, None, kmask, m.rope(pd, mode), mode)  # fmt: skip
        logits = m.head(m.readout_out(xr, mode), mode)
        self.exit_logprobs = self.elp[done].clone() if self.sampled else None
        self.live[done] = False
        return done, logits, ed


def decode_ticks(
    model: EngineModel, cache: KVCache, first: Tensor, start: Tensor, seeds: Sequence[int], *,
    max_depth: int, depths: Tensor | None = None, policy: ExitPolicy | None = None,
    tokens: int = 0, mode: str = "fast", choose: Callable[[Tensor], Tensor] | None = None,
    readout_every: int = 1, ticker_cls: Callable[..., Ticker] | None = None,
) -> TickOut:  # fmt: skip
    """Feed ``first`` [B] at positions ``start`` [B], then each chosen token, T tokens a row,
    token t of row b exiting after ``depths[t, b]`` iterations (T = depths.shape[0]) or when
    the exit ``policy`` says (T = ``tokens``) (`Ticker`). ``choose``: logits [M, V] -> tokens
    [M] (default argmax). ``ticker_cls``: `Ticker` (default) or a subclass taking its
    arguments (`models.engine.tickgraph.GraphTicker`: every row every tick, in a CUDA graph)."""
    if (depths is None) == (policy is None):
        raise ValueError("decode_ticks needs exactly one of depths and policy")
    bsz = first.shape[0]
    if depths is not None:
        n_tok = depths.shape[0]
        if bsz != depths.shape[1]:
            raise ValueError("first, start, seeds and depths must agree on the batch")
    elif tokens < 1:
        raise ValueError(f"tokens must be >= 1 with a policy, got {tokens}")
    else:
        n_tok = tokens
    if bsz != start.shape[0] or len(seeds) != bsz:
        raise ValueError("first, start, seeds and depths must agree on the batch")
    if depths is not None and bool(((depths < 1) | (depths > max_depth)).any()):
        raise ValueError(f"depths must be in [1, {max_depth}]")
    pick = choose or (lambda lg: lg.argmax(dim=-1))
    ticker = (ticker_cls or Ticker)(model, cache, seeds, max_depth=max_depth, policy=policy,
                                    mode=mode, readout_every=readout_every)  # fmt: skip
    dev = cache.filled.device
    zeros = torch.zeros(bsz, n_tok, dtype=torch.int64, device=dev)
    out = TickOut(torch.empty(0), zeros, zeros.clone(), 0)  # logits made at the first readout
    t_of = [0] * bsz
    everyone = list(range(bsz))
    ticker.feed(everyone, first.tolist(), start.tolist(),
                None if depths is None else depths[0].tolist())  # fmt: skip
    while True:
        done, logits, ed = ticker.advance()
        if not done.numel():
            break
        if not out.logits.numel():
            out.logits = logits.new_zeros(bsz, n_tok, logits.shape[-1])
        nxt = pick(logits)
        rows, nxt_l = done.tolist(), nxt.tolist()
        td = torch.as_tensor([t_of[b] for b in rows], device=dev)
        out.logits[done, td], out.tokens[done, td], out.depths[done, td] = logits, nxt, ed
        again = [k for k, b in enumerate(rows) if t_of[b] + 1 < n_tok]
        for b in rows:
            t_of[b] += 1
        if again:
            fb = [rows[k] for k in again]
            ticker.feed(fb, [nxt_l[k] for k in again],
                        [int(start[b]) + t_of[b] for b in fb],
                        None if depths is None else [int(depths[t_of[b], b]) for b in fb])  # fmt: skip
    out.ticks = ticker.ticks
    return out


_CARRY = ("prev_logprobs", "prev_entropy", "remaining", "cumulative")


def _policy_exits(
    model: EngineModel, cache: KVCache, policy: ExitPolicy, run: Tensor, depth: Tensor,
    state: Tensor, prev: Tensor, pos: Tensor, max_depth: int, mode: str,
    carry: dict[str, Tensor], seeds: Tensor, elp: Tensor | None,
) -> Tensor:  # fmt: skip
    """[M] the policy's exit decision for rows ``run`` after their iteration ``depth`` [M];
    rows at their first iteration are judged with no carry (as run_chunk's first iteration),
    the others with their own carry, which is kept per row in ``carry``. A SampledGate draws
    each row's `exit_uniform` at its own (seed, position, depth) (``seeds``: the rows' seeds)
    and adds the iteration's `exit_step_logprob` to the row's ``elp`` (as run_chunk does)."""
    info = StepInfo(depth, max_depth, state, prev, mode=mode)
    levels = depth.unique().tolist()  # the per-depth calls below: one per distinct depth
    if isinstance(policy, SampledGate):
        info.uniform = torch.empty(run.shape[0], dtype=torch.float64, device=state.device)
        for dv in levels:
            m = depth == dv
            info.uniform[m] = exit_uniform(seeds[m], pos[m], int(dv)).to(state.device)
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
                       gate_logit=None if info.gate_logit is None else info.gate_logit[idx],
                       uniform=None if info.uniform is None else info.uniform[idx])  # fmt: skip
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
    if elp is not None and isinstance(policy, SampledGate):  # the exit's log-prob, per iteration
        assert info.gate_logit is not None
        forced = torch.full_like(depth, max_depth)
        for dv in levels:
            m = depth == dv
            term = exit_step_logprob(info.gate_logit.reshape(-1)[m], hit[m], int(dv),
                                     policy.min_depth, forced[m], mode)  # fmt: skip
            elp[run[m]] = elp[run[m]] + term.to(elp.device)
    return hit


__all__ = ["TickOut", "Ticker", "decode_ticks"]
