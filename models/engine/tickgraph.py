"""Decode by ticks in a CUDA graph: every row, every tick, one fixed shape.

`models.engine.ticks.Ticker` runs a tick on the rows still iterating (compacted, like the chunk
decode's depth batching) and asks the host after every tick which rows exited: on a GPU each
tick is ~150 eager kernel launches plus gathers and a sync, so at a batch of 256 the adaptive
decode was launch-bound at ~5x the fixed-depth CUDA graph's time per token
(docs/PERFORMANCE.md, "The torch engine on the GPU"). Here a tick has one shape whatever the exits:

- every row of the batch runs the core iteration of its own token at its own iteration index
  (``it``, the K/V slot it writes and reads) and position; a row that is not iterating (idle,
  or exited and waiting for its readout) computes too, but its state, iteration count, exit
  carry and K/V stay as they were (``torch.where`` on the results; its K/V go to a spare core
  slot D when the cache has one, as the torch engine's has, else it puts back the value already
  there); the K/V row writes are `models.engine.kv` kernels on CUDA;
- attention reads each row's own (slot, row) of the layer's cache: on CUDA in fast numerics the
  decode kernel's slot index (`models.engine.attention.decode_attention(rows=, slots=)`, no
  gather), elsewhere a gather of the row's slot and `numerics.attention`;
- the exit policy decides on the device for every row at its own depth
  (`models.exits.should_exit` with per-row depths, `exit_uniform(..., check=False)`,
  `exit_step_logprob` with per-row depths): FixedDepth / given depths, LatentDiff, OuroGate,
  SampledGate (its exit log-prob summed per row). KL and EntropyDiff read a readout per
  iteration: refused here (the eager `Ticker` runs them).

So ``readout_every`` ticks are captured once in a `torch.cuda.CUDAGraph` and replayed with no
host sync between them. Two ways to read out:

- `advance` (any policy, any sampling): after each replay one read of two counts says whether
  rows wait; the rest is `Ticker`'s, eager and compacted: `_read_out` (last_exited's K/V
  copies, coda, head) on the exited rows, then the caller samples and `feed`s (a token's
  prelude and initial state run at once for the fed rows, with their RoPE rows and key mask
  written into the graph's static buffers);
- `step` / `launch` + `collect` (`sample_in_graph`: one temperature and top_p for every row):
  the replay is the ticks, then `_readout_feed` at the same fixed shape: the exited rows'
  last_exited copies (`models.engine.kv.carry_exits`), coda and head, the draw
  (`models.sampling.draw_keys` with each row's sampler key and step on the device) and the feed
  of the drawn token (position + 1, prelude, initial state with the latent noise on the device,
  RoPE rows from a table, key mask); `out` [5, B] says which rows were read out, with their
  token, log-prob, exit depth and exit log-prob, copied to a pinned host buffer per launch (two:
  the host files one step while the next runs; the caller retires finished rows, `retire`).
  ``readout_rows`` n < B: the readout, coda, head and draw run on n rows, the first n that
  exited (`models.engine.tickdecide.first_rows`; any more wait for a later step), not on all B (the head over the
  vocabulary and the draw cost per row; at mean depth ~D/2 with a readout every 4 ticks about
  0.4 B rows exit per step); a step runs the n-row graph while the last step collected read
  out fewer than n rows, else the full one.

Same values as `Ticker` (and so as `run_chunk`'s decode): the same calls on the same inputs row
by row, so in exact numerics the logits, tokens, depths, exit log-probs and the whole cache are
bit-identical (tests/models/test_engine_ticks.py runs both). What it costs: a tick is a full
batch of core work whether or not a row iterates, and a row that exits waits up to
``readout_every`` - 1 ticks for its readout; what it saves against the fixed depth: a token
costs its own depth in ticks, not the batch's deepest row's.

On the CPU (or ``graph=False``) the same ticks run eagerly on the same buffers (the tests'
path; slower than `Ticker` there, which computes only the iterating rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from models import numerics as nx
from models.engine.chunk import EngineModel, KVCache, Regions, _key_mask, _post, _qkv, _seed_tensor
from models.engine.graph import captured_or_eager, warm_on_side
from models.engine.kv import carry_exits, write_rows
from models.engine.tickdecide import compiled_decide, decide, first_rows
from models.engine.ticks import Ticker
from models.exits import ExitPolicy, OuroGate, needs_gate, needs_logits
from models.kernels.noise import latent_noise_cuda
from models.layers import Block


def graph_policy(policy: ExitPolicy | None) -> bool:
    """Whether `GraphTicker` decides ``policy``'s exits on the device (not KL / EntropyDiff,
    which read a readout of every row at every iteration)."""
    return policy is None or not needs_logits(policy)


class GraphTicker(Ticker):
    """`Ticker` whose ticks run every row at one shape, ``readout_every`` of them per CUDA graph
    replay (module doc). graph: None = a graph exactly when the cache is on CUDA; regions: the
    blocks' compiled (qkv, post) (`models.engine.graph.compiled_regions`, fast mode);
    warmup: eager runs before the capture (with every row idle: nothing changes)."""

    def __init__(
        self, model: EngineModel, cache: KVCache, seeds: Sequence[int], *, max_depth: int,
        policy: ExitPolicy | None = None, mode: str = "fast", readout_every: int = 1,
        graph: bool | None = None, regions: Regions | None = None, warmup: int = 2,
        readout_rows: int | None = None,
    ) -> None:  # fmt: skip
        if not graph_policy(policy):
            raise ValueError(f"{type(policy).__name__} reads a readout every iteration: decode "
                             "it by eager ticks (models.engine.ticks.Ticker)")  # fmt: skip
        if regions is not None and mode != "fast":
            raise ValueError("compiled blocks are fast numerics only")
        super().__init__(model, cache, seeds, max_depth=max_depth, policy=policy, mode=mode,
                         readout_every=readout_every)  # fmt: skip
        dev = cache.filled.device
        self.graphed = dev.type == "cuda" if graph is None else graph
        if self.graphed and dev.type != "cuda":
            raise ValueError(f"a CUDA graph needs the cache on a CUDA device, not {dev}")
        self.regions, self.warmup = regions, warmup
        bsz, length = cache.filled.shape
        if readout_rows is not None and not 1 <= readout_rows <= bsz:
            raise ValueError(f"readout_rows must be in [1, {bsz}] (the batch), got {readout_rows}")
        self.readout_rows = bsz if readout_rows is None else int(readout_rows)
        """At most this many exited rows read out a step (`step`; module doc)."""
        self._last_read = 0
        self.kmask = torch.ones(bsz, 1, length, dtype=torch.bool, device=dev)
        self.rope_rows = model.rope(self.pos, mode).clone()
        dt = torch.float64 if mode == "exact" else torch.float32
        if isinstance(policy, OuroGate):  # each row's carry; a fed row starts from (1, 0)
            self.carry = {"remaining": torch.ones(bsz, dtype=dt, device=dev),
                          "cumulative": torch.zeros(bsz, dtype=dt, device=dev)}  # fmt: skip
        self.forced = torch.full((bsz,), max_depth, dtype=torch.int64, device=dev)
        self.scratch = cache.core.shape[0] > max_depth
        """A spare core slot (index max_depth) takes the K/V writes of rows not iterating."""
        self._decide: Callable[..., tuple[Tensor, ...]] = (
            compiled_decide() if regions is not None else decide
        )
        self._graphs: dict[object, torch.cuda.CUDAGraph] = {}
        """Captured replays: None -> ``readout_every`` ticks; (temperature, top_p, n) -> the
        ticks, then the readout, the draw and the feed of at most n rows that exited (`step`)."""
        self.sampling: tuple[float, float] | None = None
        self.vocab = 0
        self.keys = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.out = torch.zeros(5, bsz, dtype=torch.float64, device=dev)
        self.rope_table: Tensor | None = None
        self.prompt = torch.zeros(bsz, length, dtype=torch.int64, device=dev)
        """Each row's prompt (`feed_prompts`): fed token by token through the ticks."""
        self.plen = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.free = torch.zeros(bsz, dtype=torch.bool, device=dev)
        """Rows whose token runs the max depth whatever the policy (prompt positions)."""
        self.token0_policy = False
        self._flip = 0
        self._host: list[Tensor] = []
        self._done: list[torch.cuda.Event] = []

    def reset(self) -> None:
        """Every row idle (a new call on the same cache and captured graph)."""
        self.live.zero_()
        self.stop.zero_()
        self.it.zero_()
        self.free.zero_()
        self.plen.zero_()
        self.ticks = 0
        self._last_read = 0

    def feed(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
             depths: Sequence[int] | None = None) -> None:  # fmt: skip
        """`Ticker.feed`, then the fed tokens' prelude and initial state at once, and their
        RoPE rows, key masks and exit carry in the static buffers."""
        super().feed(rows, tokens, positions, depths)
        dev = self.cache.filled.device
        r = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
        self.plen[r] = 0  # a generated token (`feed_prompts` sets its prompt after this)
        self.free[r] = False
        self._start(r)
        p = self.pos[r]
        self.kmask[r] = _key_mask(self.cache.filled.index_select(0, r), p[:, None])
        self.rope_rows[r] = self.model.rope(p, self.mode).to(self.rope_rows.dtype)
        if "remaining" in self.carry:
            self.carry["remaining"][r] = 1.0
            self.carry["cumulative"][r] = 0.0

    def advance(self) -> tuple[Tensor, Tensor, Tensor]:
        """Replay ``readout_every`` ticks until rows exit; then as `Ticker.advance`."""
        while True:
            waiting = self._waiting()
            n_live, n_wait = torch.stack([self.live.sum(), waiting.sum()]).tolist()
            if not n_live:
                empty = self.rows[:0]
                return empty, self.state.new_zeros(0, 0), empty
            if n_wait:
                return self._read_out(self.rows[waiting])
            self._replay()
            self.ticks += self.every

    def _replay(self) -> None:
        self._run(None)

    def _body(self, key: object) -> None:
        for _ in range(self.every):
            self._tick()
        if key is not None:
            assert isinstance(key, tuple)
            self._readout_feed(key[2])

    def _run(self, key: object) -> None:
        if not self.graphed:
            self._body(key)
            return
        if key not in self._graphs:
            self._capture(key)
            if not self.graphed:  # (the capture failed: eager from now on)
                self._body(key)
                return
        self._graphs[key].replay()

    # ---- the readout inside the replay (the torch engine's decode) -------------------------
    def sample_in_graph(self, temperature: float, top_p: float, vocab: int,
                        token0_policy: bool = False) -> None:  # fmt: skip
        """Each `step` reads out the rows that exited, draws their next tokens (every row's
        sampler key and step in ``keys`` / ``steps``, `set_keys`) at this temperature and
        top_p (0: greedy) over the first ``vocab`` logits, and feeds them, all inside the
        replay; the caller reads `out` and retires finished rows (`retire`). token0_policy:
        the last prompt position's exit follows the policy (`models.exits.
        token0_follows_policy`: Ouro), else it runs the max depth (Huginn)."""
        self.sampling, self.vocab = (float(temperature), float(top_p)), int(vocab)
        self.token0_policy = bool(token0_policy)
        if self.rope_table is None:  # every position's RoPE rows, gathered in the graph
            length = self.cache.filled.shape[1]
            pos = torch.arange(length, device=self.cache.filled.device)
            self.rope_table = self.model.rope(pos, self.mode).to(self.rope_rows.dtype)

    def set_keys(self, rows: Sequence[int], keys: Sequence[int], steps: Sequence[int]) -> None:
        """Rows ``rows``' sampler keys (u64) and steps (tokens drawn so far)."""
        dev = self.keys.device
        r = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
        self.keys[r] = _seed_tensor(keys, dev)  # (u64 as int64, as the latent seeds)
        self.steps[r] = torch.as_tensor(list(steps), dtype=torch.int64).to(dev)

    def feed_prompts(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Rows ``rows`` take new requests: their caches cleared and their prompts fed token by
        token through the ticks (`step`): each prompt position runs the max depth (K/V in every
        slot, its coda K/V at its readout, as a chunk prefill writes them), the last one under
        the policy where ``token0_policy``; its readout draws token 0. The same values as a
        prefill chunk, position by position (causal attention)."""
        if not rows:
            return
        if any(not p for p in prompts):
            raise ValueError("feed_prompts: every prompt needs a token")
        length = self.prompt.shape[1]
        if max(len(p) for p in prompts) > length:
            raise ValueError(f"feed_prompts: a prompt longer than the cache ({length})")
        dev = self.prompt.device
        r = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
        self.cache.filled[r] = False  # the slot's earlier request is gone
        buf = torch.zeros(len(rows), length, dtype=torch.int64)
        for k, p in enumerate(prompts):
            buf[k, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        self.prompt[r] = buf.to(dev)
        self.feed(rows, [int(p[0]) for p in prompts], [0] * len(rows))
        self.plen[r] = torch.tensor([len(p) for p in prompts], dtype=torch.int64).to(dev)
        first_free = [len(p) > 1 or not self.token0_policy for p in prompts]
        self.free[r] = torch.tensor(first_free, dtype=torch.bool).to(dev)

    def retire(self, rows: Sequence[int]) -> None:
        """Rows ``rows`` idle (their requests finished)."""
        if rows:
            self.live[torch.as_tensor(list(rows), dtype=torch.int64, device=self.live.device)] = (
                False
            )

    def step(self) -> list[list[float]]:
        """``readout_every`` ticks, then the rows that exited read out, sampled and fed (one
        replay); returns `out` read back: per row [read out (0/1), its token, the token's
        log-prob, the exit depth, the exit log-prob]."""
        return self.collect(self.launch())

    def launch(self) -> int:
        """`step` without waiting: the replay and the copy of `out` to a host buffer are
        queued; returns the buffer's index for `collect` (two buffers: one step may be in
        flight while the host files the previous one)."""
        if self.sampling is None:
            raise ValueError("launch() needs sample_in_graph() first")
        bsz = self.rows.shape[0]
        # the compacted readout while the last step collected read out fewer rows than it
        # could (no exited row was left waiting then); else every row's
        n = self.readout_rows if self._last_read < self.readout_rows else bsz
        self._run((*self.sampling, n))
        self.ticks += self.every
        i = self._flip
        self._flip ^= 1
        cuda = self.out.is_cuda
        if not self._host:
            self._host = [torch.empty_like(self.out, device="cpu") for _ in range(2)]
            if cuda:
                self._host = [t.pin_memory() for t in self._host]
                self._done = [torch.cuda.Event() for _ in range(2)]
        self._host[i].copy_(self.out, non_blocking=cuda)
        if cuda:
            self._done[i].record()
        return i

    def collect(self, i: int) -> list[list[float]]:
        """The host copy of `out` of the step launched as ``i`` (waits for it)."""
        if self._done:
            self._done[i].synchronize()
        out: list[list[float]] = self._host[i].tolist()
        self._last_read = int(sum(out[0]))
        return out

    def _readout_feed(self, n_rows: int) -> None:
        """Fixed shape, no host sync: rows that exited (the first ``n_rows`` of them by row
        index when fewer than the batch: `first_rows`; the others wait for a later step) get
        last_exited's K/V copies, the readout (coda, head) and the draw
        (`models.sampling.draw_keys`) on those ``n_rows`` rows, and their next token fed
        (position + 1, prelude, initial state, RoPE rows, key mask); `out` says which."""
        from models.kernels.draw import draw_step

        m, cache, mode, rows, dmax = self.model, self.cache, self.mode, self.rows, self.max_depth
        assert self.sampling is not None and self.rope_table is not None
        temp, top_p = self.sampling
        w = self._waiting()
        exit_at = self.it.clone()
        pos = self.pos
        compact = n_rows < rows.shape[0]
        if compact:  # the readout on n_rows rows: idx (distinct), valid (those that exited)
            w, idx, valid = first_rows(w, n_rows)
        else:
            idx, valid = rows, w
        carry_exits(cache.core, w, exit_at, rows, pos, dmax)  # last_exited's copies

        def sub(t: Tensor) -> Tensor:
            return t.index_select(0, idx) if compact else t

        x = _masked_stack(m.coda_blocks(), cache.coda, m.readout_in(sub(self.state), mode), valid,
                          idx, sub(pos), sub(self.kmask), sub(self.rope_rows), mode)  # fmt: skip
        logits = m.head(m.readout_out(x, mode), mode)
        greedy = temp == 0.0
        tok, picked = draw_step(logits, self.vocab, 1.0 if greedy else temp,
                                1.0 if greedy else top_p, mode, None if greedy else sub(self.keys),
                                None if greedy else sub(self.steps))  # fmt: skip
        if compact:  # back to the batch's rows (rows not read out: zeros, unused)
            tok = torch.zeros_like(self.tok).index_copy_(0, idx, tok)
            picked = picked.new_zeros(rows.shape[0]).index_copy_(0, idx, picked)
        # the exited rows' next token: the next prompt token while the prompt lasts (nothing
        # drawn is kept), else the drawn one (recorded: `out`); position + 1, its prelude and
        # initial state
        length = cache.filled.shape[1]
        nxt = (pos + 1).clamp(max=length - 1)
        in_prompt = w & (pos + 1 < self.plen)
        kept = w & ~in_prompt
        self.out.copy_(torch.stack([kept.to(torch.float64), tok.to(torch.float64),
                                    picked.to(torch.float64), exit_at.to(torch.float64),
                                    self.elp.to(torch.float64)]))  # fmt: skip
        new_pos = torch.where(w, nxt, pos)
        self.steps.add_(kept.to(self.steps.dtype))
        next_tok = torch.where(in_prompt, self.prompt.gather(1, nxt[:, None])[:, 0], tok)
        self.tok.copy_(torch.where(w, next_tok, self.tok))
        last = nxt == self.plen - 1  # the prompt's last position samples token 0
        free_next = in_prompt & ~(last & self.token0_policy)
        self.free.copy_(torch.where(w, free_next, self.free))
        self.pos.copy_(new_pos)
        self.it.masked_fill_(w, 0)
        self.stop.masked_fill_(w, False)
        self.elp.masked_fill_(w, 0.0)
        self.target.masked_fill_(w, dmax)
        for key, val in self.carry.items():
            val.masked_fill_(w, 1.0 if key == "remaining" else 0.0)
        cache.filled[rows, new_pos] = cache.filled[rows, new_pos] | w
        self.kmask.copy_(_key_mask(cache.filled, new_pos[:, None]))
        self.rope_rows.copy_(torch.where(w.view(-1, *[1] * (self.rope_rows.dim() - 1)),
                                         self.rope_table[new_pos], self.rope_rows))  # fmt: skip
        x0 = m.embed(self.tok).to(cache.core.dtype)
        en = _masked_stack(m.prelude_blocks(), cache.prelude, x0, w, rows, new_pos, self.kmask,
                           self.rope_rows, mode)  # fmt: skip
        noise = (latent_noise_cuda(self.seed_t, new_pos, en.shape[-1], check=False)
                 if self.noise_here else None)  # fmt: skip
        s0 = m.initial_state(en, new_pos, self.seeds, noise).to(en.dtype)
        self.e.copy_(torch.where(w[:, None], en, self.e))
        self.state.copy_(torch.where(w[:, None], s0, self.state))

    def _capture(self, key: object) -> None:
        live = self.live.clone()
        self.live.zero_()  # warm-up (compiles) with every row idle: it changes nothing

        def drop_compiled() -> bool:
            had = self.regions is not None
            self.regions, self._decide = None, decide
            return had

        warm_on_side(self.cache.filled.device, lambda: self._warm(key), drop_compiled)
        self.live.copy_(live)
        got = captured_or_eager(lambda: self._body(key), "GraphTicker")
        if got is None:
            self.graphed = False
        else:
            self._graphs[key] = got[0]

    def _warm(self, key: object) -> None:
        for _ in range(self.warmup):
            self._body(key)

    def _tick(self) -> None:
        """One core iteration of every row (module doc); static buffers updated in place."""
        m, cache, mode, rows, pos = self.model, self.cache, self.mode, self.rows, self.pos
        bsz = rows.shape[0]
        running = self.live & ~self.stop & (self.it < self.target)
        if self.scratch:  # rows not iterating write into the spare slot D
            slot = torch.where(running, self.it, self.max_depth)
        else:  # the iteration this tick runs (0-based); rows not iterating put back their K/V
            slot = self.it.clamp(max=self.max_depth - 1)
        qkv_fn, post_fn = self.regions if self.regions is not None else (_qkv, _post)
        kernel = _slot_kernel(self.state, mode)
        x = m.core_in(self.state, self.e, mode)
        keep = running[:, None, None]
        ends = None
        if kernel is not None:  # the tick's layers share its mask: its key ends computed once
            from models.engine.attention import key_ends

            ends = key_ends(self.kmask)
        for layer, blk in enumerate(m.core_blocks()):
            q, k, v = qkv_fn(blk, x, self.rope_rows, mode)
            kv = cache.core[:, layer]  # [D (+ 1), 2, B, T, G, Dh]
            if self.scratch:
                write_rows(kv[:, 0], slot, rows, pos, k)
                write_rows(kv[:, 1], slot, rows, pos, v)
            else:
                kv[slot, 0, rows, pos] = torch.where(keep, k, kv[slot, 0, rows, pos])
                kv[slot, 1, rows, pos] = torch.where(keep, v, kv[slot, 1, rows, pos])
            q4 = q.view(bsz, 1, blk.n_heads, blk.head_dim)
            if kernel is not None:
                attn = kernel(q4, kv[:, 0], kv[:, 1], self.kmask, rows=rows, slots=slot,
                              ends=ends)  # fmt: skip
            else:
                attn = nx.attention(q4, kv[slot, 0, rows], kv[slot, 1, rows], self.kmask, mode)
            x = post_fn(blk, x, attn.reshape(bsz, -1), mode)
        new = m.core_out(x, mode)
        gate = m.gate_logit(new, mode) if self.policy is not None and needs_gate(self.policy) \
            else None  # fmt: skip
        out = self._decide(self.policy, self.max_depth, mode, running, self.it, new, self.state,
                           gate, self.seed_t, pos, self.stop, self.elp, self.forced,
                           self.carry.get("remaining"), self.carry.get("cumulative"),
                           self.free)  # fmt: skip
        for buf, val in zip(self._outputs(), out, strict=True):
            buf.copy_(val)

    def _outputs(self) -> list[Tensor]:
        """The buffers `_decide` returns new values of, in its order."""
        bufs = [self.state, self.it, self.stop, self.elp]
        return bufs + [self.carry[k] for k in ("remaining", "cumulative") if k in self.carry]


def _masked_stack(
    blocks: Sequence[Block], slots: Tensor, x: Tensor, w: Tensor, rows: Tensor, pos: Tensor,
    kmask: Tensor, rope: Tensor, mode: str,
) -> Tensor:  # fmt: skip
    """Blocks (prelude or coda: one K/V slot per layer, ``slots`` [layers, 2, B, T, G, Dh]) on
    rows ``rows`` [R] (distinct; all B, or a subset), x [R, h], one query each at ``pos`` [R];
    K/V written only where ``w`` [R] (the others put back theirs); attention over each row's
    own cache."""
    keep = w[:, None, None]
    bsz = x.shape[0]
    subset = bsz != slots.shape[2]
    for layer, blk in enumerate(blocks):
        q, k, v = _qkv(blk, x, rope, mode)
        s = slots[layer]
        s[0, rows, pos] = torch.where(keep, k, s[0, rows, pos])
        s[1, rows, pos] = torch.where(keep, v, s[1, rows, pos])
        ks, vs = s[0], s[1]
        if subset:  # the rows' own caches
            ks, vs = ks.index_select(0, rows), vs.index_select(0, rows)
        attn = nx.attention(q.view(bsz, 1, blk.n_heads, blk.head_dim), ks, vs, kmask, mode)
        x = _post(blk, x, attn.reshape(bsz, -1), mode)
    return x


def _slot_kernel(x: Tensor, mode: str):  # type: ignore[no-untyped-def]
    """The decode kernel with per-row slots where `numerics.attention` would take the kernel
    (fast mode, CUDA, inside `fused_generation`), else None (a gather and numerics.attention)."""
    if mode == "exact" or not nx.DECODE_KERNEL or not nx._fused_inference(x):
        return None
    from models.engine import attention as ea  # (Triton: imported on CUDA only)

    return ea.decode_attention if ea.triton is not None else None


__all__ = ["GraphTicker", "graph_policy"]
