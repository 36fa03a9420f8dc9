"""The family-agnostic looped engine: KV cache per (iteration, layer) and one chunk forward.

A chunk is B rows x S positions of new tokens (prefill: a prompt; decode: one token; replay:
whole sequences). Positions are absolute; row b's K/V of position p live at index p of that
row's cache. A chunk runs, for every position at once:

    prelude stack (KV slot per prelude layer)  ->  s_0  ->
    for d = 1 .. max_depth:  core stack with KV slot (d, layer), only for ACTIVE positions
                             (a position is active until it exits) ->
    readout: coda stack (KV slot per coda layer) on each position's final state -> head

On a device other than the CPU, Huginn's latent noise (contract 1) is computed there by
`models.kernels.noise.latent_noise_cuda` (the spec's bits: one Triton kernel on CUDA, the torch
ops of `models.noise.latent_noise_torch` elsewhere), not drawn on the CPU and copied.

Exited positions follow one of the two KV semantics of docs/CONTRACTS.md 3 (`kv`):

- `last_exited` is implemented by copying: when a position exits after iteration e, its K/V of
  slots (e, l) are copied into slots (d, l) for every d > e, so any later query at iteration d
  reads the position's iteration-e K/V; its state is frozen (an inactive position's new state
  is discarded), and its K/V are never rewritten.
- `full`: every valid position runs every iteration up to its row's full depth (`max_depth`,
  or `row_depths`) and writes its K/V in every slot; the state read out is the one after its
  exit iteration (kept aside when it exits; later iterations only feed the K/V).

Attention of the query at position p sees the cached positions t <= p of its own row
(`filled`).

Depth batching (`compact=True`, the default): at core iteration d only the
positions still running are computed. Their rows of the state are gathered (`index_select`),
run through core_in / the core stack / core_out as an [M, h] batch (M = running positions;
their K/V written by integer indices), and written back (`index_copy`); attention takes their
queries scattered into the chunk's [B, S] layout (the keys are the whole cache, as before), so
each query's attention row is the one the uncompacted path computes. An exit policy's readout
(KL / entropy criteria) is computed for the active positions alone, likewise. When every
position runs, the uncompacted calls run unchanged. Where it saves:

- `last_exited`: a position stops costing core compute after its exit iteration (its K/V of
  later slots are the copies above). In decode (one token per row) this saves the FLOPs of the
  exited rows; the weights are still read once per iteration while any row runs, so where a
  step is bound by weight reads (a GPU at small batch) the iteration count (the deepest row)
  sets the time, not the mean depth.
- `full`: cannot save within its row depth: every valid position must write its K/V in every
  slot up to its row's full depth, because later queries at deeper iterations read them; only
  positions past their row's `row_depths` (replay of rows with smaller full depths) drop out.

`compact=False` is the uncompacted path (every row runs to the deepest running one, only K/V
writes are masked): kept as the tests' and the benchmark's comparison. Tokens, depths and
log-probs are bit-identical between the two in exact numerics (row-wise fp64 accumulation);
in fast numerics a matmul over M rows may pick another kernel than over N (differences at
fp32 rounding level, tests/models/test_depth_batching.py).

Generation feeds the prompt as one chunk with every position at full depth, then one token per
chunk with an exit policy; replay feeds whole sequences as one chunk with the recorded depths.
Both compute the same values in the same order per position, which is what makes `exact`-mode
replay bit-identical (`models.numerics`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from models import numerics as nx
from models.engine.kv import write_kv
from models.exits import (
    ExitCarry,
    ExitPolicy,
    SampledGate,
    StepInfo,
    check_kv,
    exit_step_entropy,
    exit_step_logprob,
    needs_gate,
    needs_logits,
    should_exit,
)
from models.kernels.noise import latent_noise_cuda
from models.layers import Block
from models.noise import exit_uniform


class EngineModel(Protocol):
    """What the engine runs of a family module: models.base.LoopedLM implements it (the hooks'
    meaning: their docstrings there). A protocol here, so that models.base (whose forward runs
    `forward_full`) imports the engine and not the other way round."""

    @property
    def max_depth(self) -> int: ...
    @property
    def kv_shape(self) -> tuple[int, int]: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def prelude_blocks(self) -> Sequence[Block]: ...
    def core_blocks(self) -> Sequence[Block]: ...
    def coda_blocks(self) -> Sequence[Block]: ...
    def embed(self, tokens: Tensor) -> Tensor: ...
    def rope(self, positions: Tensor, mode: str) -> Tensor: ...
    def initial_state(
        self, e: Tensor, positions: Tensor, seeds: Sequence[int], noise: Tensor | None = None
    ) -> Tensor: ...
    def core_in(self, state: Tensor, e: Tensor, mode: str) -> Tensor: ...
    def core_out(self, x: Tensor, mode: str) -> Tensor: ...
    def readout_in(self, state: Tensor, mode: str) -> Tensor: ...
    def readout_out(self, x: Tensor, mode: str) -> Tensor: ...
    def head(self, hidden: Tensor, mode: str) -> Tensor: ...
    def gate_logit(self, state: Tensor, mode: str) -> Tensor | None: ...


@dataclasses.dataclass
class KVCache:
    """K/V of every attention slot: [layers, 2 (k, v), B, T, kv_heads, head_dim] per stack."""

    prelude: Tensor
    core: Tensor
    """[max_depth, core layers, 2, B, T, G, D]."""
    coda: Tensor
    filled: Tensor
    """[B, T] bool: positions whose K/V exist."""

    @classmethod
    def empty(cls, model: EngineModel, batch: int, length: int, depth: int) -> KVCache:
        g, d = model.kv_shape
        param = next(model.parameters())
        dev = param.device

        def zeros(*lead: int) -> Tensor:  # K/V in the parameters' dtype (fp32, bf16)
            return torch.zeros(*lead, 2, batch, length, g, d, device=dev, dtype=param.dtype)

        return cls(
            prelude=zeros(len(model.prelude_blocks())),
            core=zeros(depth, len(model.core_blocks())),
            coda=zeros(len(model.coda_blocks())),
            filled=torch.zeros(batch, length, dtype=torch.bool, device=dev),
        )


@dataclasses.dataclass
class ChunkOut:
    """Results of one chunk, per (row, position)."""

    logits: Tensor
    """[B, S, V] fp32 readout logits of the final state."""
    hidden: Tensor
    """[B, S, h] the hidden state the head reads."""
    depths: Tensor
    """[B, S] int64 iterations run (0 for padding)."""
    exit_logprobs: Tensor | None = None
    """[B, S] log-probability of each position's exit (a SampledGate policy, or replay with
    ``exit_lp``; 0 at padding and where the gate was never consulted); else None."""
    exit_entropy: Tensor | None = None
    """[B, S] the entropy of each position's exit decisions along its path (with
    exit_logprobs; models.exits.exit_step_entropy)."""


@dataclasses.dataclass
class _Rows:
    batch: int
    seq: int
    b: Tensor  # [N] row of each flattened position
    pos: Tensor  # [N] absolute position
    kmask: Tensor  # [B, S, T] keys visible to each query
    rope: Tensor
    mode: str
    regions: Regions | None = None
    """Compiled (qkv, post) callables in place of `_qkv` / `Block.post` (the fixed-depth CUDA
    graph decode, `models.engine.graph.compiled_regions`); None: eager."""

    @functools.cached_property
    def ends(self) -> Tensor | None:
        """One query a row on CUDA: each row's last visible key + 1 for the fused decode
        attention, computed at the first layer and shared by the step's others
        (`models.engine.attention.key_ends`); else None."""
        if self.seq != 1 or not self.kmask.is_cuda:
            return None
        from models.engine.attention import key_ends

        return key_ends(self.kmask)


def _qkv(blk: Block, x: Tensor, rope: Tensor, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of a block in x's dtype (RoPE tables are fp32: bf16 q / k come back fp32)."""
    q, k, v = blk.qkv(x, rope, mode)
    return q.to(x.dtype), k.to(x.dtype), v


def _post(blk: Block, x: Tensor, attn: Tensor, mode: str) -> Tensor:
    return blk.post(x, attn, mode)


Regions = tuple[
    Callable[[Block, Tensor, Tensor, str], tuple[Tensor, Tensor, Tensor]],
    Callable[[Block, Tensor, Tensor, str], Tensor],
]
"""(qkv, post) of a block: `_qkv`, `_post` or compiled versions of them."""


def _stack(
    blocks: Sequence[Block], slots: Tensor, x: Tensor, write: Tensor | None, r: _Rows
) -> Tensor:
    """Run attention blocks on rows x [N, h]; write K/V of rows `write` into `slots` (None:
    every row, with integer indices only: no boolean-mask indexing, no host sync)."""
    wb, wp = (r.b, r.pos) if write is None else (r.b[write], r.pos[write])
    qkv_fn, post_fn = r.regions if r.regions is not None else (_qkv, _post)
    for layer, blk in enumerate(blocks):
        q, k, v = qkv_fn(blk, x, r.rope, r.mode)
        if write is None:  # every row: one copy kernel for both on CUDA (models.engine.kv)
            write_kv(slots[layer], wb, wp, k, v)
        else:
            slots[layer, 0, wb, wp] = k[write]
            slots[layer, 1, wb, wp] = v[write]
        q = q.view(r.batch, r.seq, blk.n_heads, blk.head_dim)
        attn = nx.attention(q, slots[layer, 0], slots[layer, 1], r.kmask, r.mode, r.ends)
        x = post_fn(blk, x, attn.reshape(x.shape[0], -1), r.mode)
    return x


def _stack_at(blocks: Sequence[Block], slots: Tensor, x: Tensor, idx: Tensor, r: _Rows) -> Tensor:
    """`_stack` on the compacted positions `idx` [M] (indices into the chunk's N flattened
    positions) with x [M, h]: their K/V written, their queries scattered into the [B, S] layout
    for attention (so each attention row is the uncompacted one), the rest of every block on
    M rows only. Returns [M, h]."""
    wb, wp = r.b.index_select(0, idx), r.pos.index_select(0, idx)
    rope = r.rope.index_select(0, idx)
    n = r.batch * r.seq
    for layer, blk in enumerate(blocks):
        q, k, v = _qkv(blk, x, rope, r.mode)
        slots[layer, 0, wb, wp] = k
        slots[layer, 1, wb, wp] = v
        qf = q.new_zeros((n, *q.shape[1:])).index_copy_(0, idx, q)
        qf = qf.view(r.batch, r.seq, blk.n_heads, blk.head_dim)
        attn = nx.attention(qf, slots[layer, 0], slots[layer, 1], r.kmask, r.mode, r.ends)
        x = blk.post(x, attn.reshape(n, -1).index_select(0, idx), r.mode)
    return x


def _seed_tensor(seeds: Sequence[int], dev: torch.device) -> Tensor:
    """u64 latent seeds as int64 two's complement on `dev` (`models.noise.latent_noise_torch`)."""
    signed = [int(s) - (1 << 64) if int(s) >= 1 << 63 else int(s) for s in seeds]
    return torch.tensor(signed, dtype=torch.int64).to(dev)


def _key_mask(filled: Tensor, positions: Tensor) -> Tensor:
    """[B, S, T] keys visible to each query: the row's filled positions t <= the query's."""
    key_pos = torch.arange(filled.shape[1], device=filled.device)
    kmask = filled[:, None, :] & (key_pos[None, None, :] <= positions[:, :, None])
    kmask[..., 0] |= ~kmask.any(dim=-1)  # padding queries that see nothing: keep softmax finite
    return kmask


def _readout(
    model: EngineModel, cache: KVCache, state: Tensor, write: Tensor | None, r: _Rows
) -> tuple[Tensor, Tensor]:
    x = model.readout_in(state, r.mode)
    x = _stack(model.coda_blocks(), cache.coda, x, write, r)
    hidden = model.readout_out(x, r.mode)
    return model.head(hidden, r.mode), hidden


def _policy_logits(
    model: EngineModel, cache: KVCache, state: Tensor, active: Tensor, r: _Rows, compact: bool
) -> Tensor:
    """[N, V] readout logits for an exit policy: of every position (uncompacted), or of the
    active ones alone (compact; zeros elsewhere, which the policy's mask ignores). Writes the
    coda K/V of the active positions."""
    idx = active.nonzero()[:, 0]
    if not compact or idx.numel() == active.shape[0]:
        return _readout(model, cache, state, active, r)[0]
    x = model.readout_in(state.index_select(0, idx), r.mode)
    x = _stack_at(model.coda_blocks(), cache.coda, x, idx, r)
    logits = model.head(model.readout_out(x, r.mode), r.mode)
    return logits.new_zeros((active.shape[0], logits.shape[1])).index_copy_(0, idx, logits)


def run_chunk(
    model: EngineModel,
    cache: KVCache,
    tokens: Tensor,
    positions: Tensor,
    valid: Tensor,
    seeds: Sequence[int],
    *,
    max_depth: int,
    depths: Tensor | None = None,
    policy: ExitPolicy | None = None,
    mode: str = "fast",
    kv: str = "last_exited",
    row_depths: Sequence[int] | None = None,
    compact: bool = True,
    exit_lp: tuple[int, Sequence[int]] | None = None,
) -> ChunkOut:
    """One chunk forward (see module doc).

    tokens, positions: [B, S] int64; valid: [B, S] bool (False = padding, never written);
    seeds: one latent seed per row. Exactly one of `depths` ([B, S], 1..max_depth at valid
    positions: replay / prefill) and `policy` (decode, S == 1) says when positions exit.
    kv: 'last_exited' | 'full' (contract 3); row_depths (kv='full' only): each row's full
    depth, the iterations every position of the row runs (default: max_depth). `depths` of
    the returned ChunkOut are the exit depths. compact: depth batching (module doc); False =
    the uncompacted path (every row to the deepest running one, K/V writes masked).
    exit_lp (replay of sampled exits): (the SampledGate's min_depth, each row's forced exit
    depth D): the recorded exits' log-probabilities are computed as decode computed them
    (`models.exits.exit_step_logprob` per iteration); a SampledGate `policy` implies it.
    """
    nx.check_mode(mode)
    full = check_kv(kv) == "full"
    if (depths is None) == (policy is None):
        raise ValueError("run_chunk needs exactly one of depths and policy")
    bsz, seq = tokens.shape
    if policy is not None and seq != 1:
        raise ValueError("an exit policy decides per decoded token: chunks of one position")
    if max_depth > cache.core.shape[0]:
        raise ValueError(f"max_depth {max_depth} exceeds the cache's {cache.core.shape[0]} slots")
    n = bsz * seq
    dev = cache.filled.device
    pos = positions.reshape(n).to(dev)
    val = valid.reshape(n).to(dev)
    rows = torch.arange(bsz, device=dev).repeat_interleave(seq)
    if depths is not None:
        dep = depths.reshape(n).to(dev)
        bad = val & ((dep < 1) | (dep > max_depth))
        if bad.any():
            raise ValueError(f"depths must be in [1, {max_depth}] at valid positions")
    cache.filled[rows[val], pos[val]] = True
    kmask = _key_mask(cache.filled, positions.to(dev))
    r = _Rows(bsz, seq, rows, pos, kmask, model.rope(pos, mode), mode)
    row_seeds = [int(seeds[b]) for b in rows.tolist()]

    x0 = model.embed(tokens.reshape(n).to(dev)).to(cache.core.dtype)  # bf16 runs bf16 on
    e = _stack(model.prelude_blocks(), cache.prelude, x0, val, r)  # (Huginn embeds in fp32)
    noise = None
    if dev.type != "cpu" and getattr(model, "draws_latent_noise", False):  # the spec's bits
        noise = latent_noise_cuda(_seed_tensor(row_seeds, dev), pos, e.shape[-1])
    state = model.initial_state(e, pos, row_seeds, noise).to(e.dtype)  # (noise fp32, cast)
    done = ~val
    ran = torch.zeros(n, dtype=torch.int64, device=dev)
    carry: ExitCarry | None = None
    run_to = torch.full((n,), max_depth, dtype=torch.int64, device=dev)
    if row_depths is not None:
        if not full:
            raise ValueError("row_depths is for kv='full' (last_exited runs to the exit depth)")
        run_to = torch.as_tensor(list(row_depths), dtype=torch.int64, device=dev)[rows]
        if bool(((run_to < 1) | (run_to > max_depth)).any()):
            raise ValueError(f"row_depths must be in [1, {max_depth}]")
    if full and depths is not None and bool((val & (dep > run_to)).any()):
        raise ValueError("kv='full': an exit depth exceeds its row's full depth")
    out_state = state
    sampled = isinstance(policy, SampledGate)
    if sampled:
        assert isinstance(policy, SampledGate)
        exit_lp = (policy.min_depth, [max_depth] * bsz)
    elp = forced = seed_t = None
    if exit_lp is not None:
        if model.gate_logit(state[:1], mode) is None:
            raise ValueError(
                f"sampled exits (SampledGate) need a family with an exit gate (Ouro); "
                f"{type(model).__name__} has none"
            )
        forced = torch.as_tensor(list(exit_lp[1]), dtype=torch.int64, device=dev)[rows]
        elp = torch.zeros(n, dtype=torch.float64 if mode == "exact" else torch.float32,
                          device=dev)  # fmt: skip
        eh = torch.zeros_like(elp)
        seed_t = _seed_tensor(row_seeds, dev) if sampled else None
    for i in range(max_depth):
        active = ~done
        running = val & (run_to > i) if full else active
        idx = running.nonzero()[:, 0] if compact else None
        if (idx.numel() == 0) if idx is not None else not running.any():
            break
        if idx is None or idx.numel() == n:  # every position runs: the uncompacted calls
            x = _stack(
                model.core_blocks(), cache.core[i], model.core_in(state, e, mode), running, r
            )
            new = model.core_out(x, mode)
            prev, state = state, torch.where(running[:, None], new, state)
        else:  # depth batching: only the running positions (module doc)
            xin = model.core_in(state.index_select(0, idx), e.index_select(0, idx), mode)
            x = _stack_at(model.core_blocks(), cache.core[i], xin, idx, r)
            prev, state = state, state.index_copy(0, idx, model.core_out(x, mode))
            new = state  # (rows not running: their frozen state; the policy masks them)
        ran[active] = i + 1
        gate_now: Tensor | None = None
        if depths is not None:
            stop = active & (dep == i + 1)
        elif compact and not bool(active.any()):  # kv='full' past every exit: K/V only
            stop = active
        else:
            assert policy is not None
            info = StepInfo(i + 1, max_depth, new, prev, mode=mode)
            if needs_logits(policy):
                info.logits = _policy_logits(model, cache, state, active, r, compact)
            if needs_gate(policy):
                info.gate_logit = gate_now = model.gate_logit(new, mode)
            if seed_t is not None:
                info.uniform = exit_uniform(seed_t, pos, i + 1)
            hit, carry = should_exit(policy, info, carry)
            stop = active & hit.to(dev)
        if elp is not None and forced is not None:  # the exit's log-prob, iteration by iteration
            g = model.gate_logit(new, mode) if gate_now is None else gate_now
            if g is None:
                raise ValueError("sampled exits need a model with an exit gate")
            assert exit_lp is not None
            term = exit_step_logprob(g, stop, i + 1, exit_lp[0], forced, mode)
            elp = elp + torch.where(active, term.to(elp.device), torch.zeros_like(elp))
            h = exit_step_entropy(g, i + 1, exit_lp[0], forced, mode)
            eh = eh + torch.where(active, h.to(eh.device), torch.zeros_like(eh))
        if full:  # keep the exit state aside; the position runs on for the K/V
            out_state = torch.where(stop[:, None], state, out_state)
        elif stop.any() and i + 1 < max_depth:
            sb, sp = rows[stop], pos[stop]
            cache.core[i + 1 :, :, :, sb, sp] = cache.core[i, :, :, sb, sp].unsqueeze(0)
        done = done | stop
    logits, hidden = _readout(model, cache, out_state if full else state, val, r)
    return ChunkOut(
        logits=logits.view(bsz, seq, -1),
        hidden=hidden.view(bsz, seq, -1),
        depths=torch.where(val, ran, 0).view(bsz, seq),
        exit_logprobs=None if elp is None else torch.where(val, elp, 0.0).view(bsz, seq),
        exit_entropy=None if elp is None else torch.where(val, eh, 0.0).view(bsz, seq),
    )


def forward_full(
    model: EngineModel,
    input_ids: Tensor,
    latent_seeds: Sequence[int] | None = None,
    *,
    depth: int | None = None,
    mode: str = "fast",
) -> Tensor:
    """Logits [B, S, V] of every position of `input_ids` [B, S] at full depth."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    bsz, seq = input_ids.shape
    depth = model.max_depth if depth is None else depth
    seeds = list(latent_seeds) if latent_seeds is not None else [0] * bsz
    cache = KVCache.empty(model, bsz, seq, depth)
    positions = torch.arange(seq).expand(bsz, seq)
    ones = torch.ones(bsz, seq, dtype=torch.bool)
    out = run_chunk(
        model,
        cache,
        input_ids,
        positions,
        ones,
        seeds,
        max_depth=depth,
        depths=torch.full((bsz, seq), depth),
        mode=mode,
    )
    return out.logits


__all__ = ["ChunkOut", "KVCache", "forward_full", "run_chunk"]
