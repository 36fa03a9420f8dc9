"""Looped LM providers on megatron-core: the learner's policy and critic.

Public API (stable; see docs/LEARNER_MODELS.md):

    info = learner.parallel.init_distributed(tp)              # first: TP group, CPU compat
    policy = build_policy(model_config, MegatronOptions(), hf_state=None)
    critic = build_critic(model_config, MegatronOptions(), policy=policy)
    out = policy(tokens, depths, valid, latent_seeds)         # LoopedOutput
    # or learner.replay.replay_forward(policy, batch, ...) for log-probs / entropy

`model_config` is a `models.config` family config (Huginn, Ouro, Nanbeige, Llama). The model is
a `MegatronModule` (its `.config` is megatron's `TransformerConfig`), so Megatron DDP,
`get_megatron_optimizer` and `dist_checkpointing` (`.sharded_state_dict()`) take it as is.
Weights come from a Hugging Face state dict (`learner.hf_convert`): `hf_state`, or, when None,
the reference's deterministic init (`models.reference.build_model(config, seed=init_seed)`),
so every TP size starts from the same full weights.

Forward = the reference replay (`models.engine.chunk.run_chunk` with recorded depths), batch-first:
tokens [B, S] right-padded; one parallel pass over all positions per core iteration d. Exited
positions follow the KV semantics `kv` (docs/CONTRACTS.md 3; `MegatronOptions.kv`, default the
family's): 'last_exited': position p is active while d <= depths[p]; an inactive position
keeps its state and attends / is attended with its K/V of its exit iteration. 'full': every
position of row b runs its row's full depth D_b = its deepest position (the prompt's depth);
the state read out at p is the one after iteration depths[p].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor, nn

from learner.batching import flat_index, to_device
from learner.hf_convert import load_hf_state
from learner.megatron.layers import (
    DocMask,
    LoopedBlock,
    RMSNorm,
    Rope,
    column_linear,
    doc_mask,
    exact_embedding,
    replicated_linear,
)
from learner.megatron.options import MegatronOptions, padded_rows, transformer_config
from models import numerics as nx
from models.config import HuginnConfig, LlamaConfig, ModelConfig, OuroConfig
from models.exits import check_kv, default_kv
from models.kernels.noise import latent_noise_cuda
from models.noise import latent_noise
from models.seeds import seed_to_i64
from proto.records import MAX_DEPTH

LoopFn = Callable[[int, Tensor, Callable[[Tensor], Tensor]], Tensor | None]
"""loop_fn(k, state after core iteration k [B, S, h], readout) (LoopedGPT.forward); a tensor
it returns replaces the state from there on (the same values: learner.objectives.loops.tap)."""


class LoopedOutput(NamedTuple):
    """Per-position outputs of a forward."""

    logits: Tensor | None
    """[B, S, V_pad / tp] this rank's vocab shard of the logits ([N, ...]: head_rows; critic None)"""
    hidden: Tensor
    """[B, S, h] the hidden state the head reads (replicated on the TP group)."""
    values: Tensor | None
    """[B, S] value estimates (critic; None for a policy)."""


class LoopedGPT(MegatronModule):
    """A looped family on megatron-core: prelude, core looped per token depth, coda, head.

    Submodules (names used by `learner.hf_convert`): `embedding`, `prelude`, `core`, `coda`
    (ModuleLists of `LoopedBlock`), `adapter` (Huginn), `final_norm`, `output_layer` (policy;
    no weight of its own when tied), `exit_gate` (Ouro), `value_head` (critic); buffer
    `freqs_cis` (Huginn's fp32 RoPE table, loaded from the checkpoint).
    """

    freqs_cis: Tensor

    def __init__(
        self, family_config: ModelConfig, options: MegatronOptions, *, critic: bool = False
    ) -> None:
        super().__init__(config=transformer_config(family_config, options))
        c, tc = family_config, self.config
        self.family_config, self.options, self.is_critic = c, options, critic
        self.tp_size = tc.tensor_model_parallel_size
        self.rows = padded_rows(c, self.tp_size, options.vocab_multiple)
        self.huginn = isinstance(c, HuginnConfig)
        h, dt = tc.hidden_size, tc.params_dtype
        self.embedding = VocabParallelEmbedding(self.rows, h, init_method=nn.init.zeros_, config=tc)
        if isinstance(c, HuginnConfig):
            style, eps, counts = "huginn", c.norm_eps, c
            kw: dict[str, Any] = dict(qk_bias=c.qk_bias)
            n_pre, n_core, n_coda = (
                counts.n_layers_in_prelude,
                counts.n_layers_in_recurrent_block,
                counts.n_layers_in_coda,
            )
            self.tied = c.tie_embeddings
            self.adapter = ColumnParallelLinear(
                2 * h, h, config=tc, init_method=nn.init.zeros_, bias=c.bias, gather_output=True
            )
            self.register_buffer(
                "freqs_cis", torch.zeros(1, c.block_size, 1, c.head_dim // 2, 2), persistent=True
            )
        else:
            assert isinstance(c, LlamaConfig)
            style = "ouro" if isinstance(c, OuroConfig) else "llama"
            eps, kw = c.rms_norm_eps, dict(qkv_bias=c.attention_bias, proj_bias=c.attention_bias)
            n_pre, n_core, n_coda = 0, c.num_hidden_layers, 0
            self.tied = c.tie_word_embeddings

        def blocks(n: int) -> nn.ModuleList:
            return nn.ModuleList(LoopedBlock(tc, style, eps=eps, **kw) for _ in range(n))

        self.prelude, self.core, self.coda = blocks(n_pre), blocks(n_core), blocks(n_coda)
        self.final_norm = RMSNorm(h, eps, dt)
        if isinstance(c, OuroConfig):
            self.exit_gate = nn.Linear(h, 1, dtype=dt)
        k = options.backprop_depth
        if k is None:
            k = int(getattr(c, "mean_backprop_depth", 0))
        self.backprop_depth = 0 if k >= self.max_depth else k
        """Core iterations with gradient per token (0 = all; >= max_depth is all)."""
        if critic:
            self.value_head = nn.Linear(h, 1, dtype=dt)
        else:
            self.output_layer = ColumnParallelLinear(
                h,
                self.rows,
                config=tc,
                init_method=nn.init.zeros_,
                bias=False,
                gather_output=False,
                skip_weight_param_allocation=self.tied,
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron's default, recursing into the block lists (a plain ModuleList would be
        saved as TP-replicated)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            {},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        for name, module in self.named_children():
            if isinstance(module, nn.ModuleList):
                for i, blk in enumerate(_blocks(module)):
                    out.update(
                        blk.sharded_state_dict(f"{prefix}{name}.{i}.", sharded_offsets, metadata)
                    )
            else:
                out.update(
                    sharded_state_dict_default(
                        module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group
                    )
                )
        return out

    # ---- family hooks (models.base.LoopedLM semantics) ----------------------------------------

    @property
    def max_depth(self) -> int:
        return int(self.family_config.max_depth)

    def _embed(self, tokens: Tensor) -> Tensor:
        emb = self.embedding
        if tokens.is_cuda and self.options.numerics == "exact" and emb.tp_group.size() == 1:
            e = exact_embedding(emb.weight, tokens)  # the gradient summed in fp64
        else:
            e = emb(tokens)
        if self.huginn:
            scale = self.family_config.embed_scale  # type: ignore[union-attr]
            e = e * torch.full((), scale, dtype=torch.float32, device=e.device)
        return e.to(self.config.params_dtype)

    def _rope(self, positions: Tensor, mode: str, top: int | None = None) -> Rope:
        """``top``: the largest position when the caller knows it (else read off ``positions``)."""
        c = self.family_config
        if isinstance(c, HuginnConfig):
            top = int(positions.max()) if top is None else top
            if top >= c.block_size:
                raise ValueError(f"position {top} is beyond block_size")
            return Rope("adjacent", self.freqs_cis[0, positions, 0].float())
        table = nx.rope_cos_sin(positions.reshape(-1), c.head_dim, c.rope_theta, mode)
        return Rope("half", table)

    def _initial_state(self, e: Tensor, positions: Tensor, seeds: Tensor,
                       nonnegative: bool = False) -> Tensor:  # fmt: skip
        """seeds: [B] (one per row) or [B, S] (one per position: packed rows); ``nonnegative``:
        the positions are known >= 0 (checked on the host)."""
        if not self.huginn:
            return e
        c = self.family_config
        b, s = positions.shape
        h = c.n_embd  # type: ignore[union-attr]
        if e.is_cuda:  # same bits as the CPU spec (one Triton kernel: models.kernels.noise)
            per = to_device(seeds, e.device)
            per = per.reshape(-1) if per.dim() == 2 else per.repeat_interleave(s)
            z = latent_noise_cuda(per, positions.reshape(-1), h, nonnegative)
        else:
            per = seeds.cpu()
            per = per.reshape(-1) if per.dim() == 2 else per.repeat_interleave(s)
            z = latent_noise(per, positions.reshape(-1).cpu(), h)
        # (torch.full: filled on the device; a torch.tensor copied there would wait for it)
        std = torch.full((), c.init_std, dtype=torch.float32, device=z.device)  # type: ignore[union-attr]
        scale = torch.full((), c.embed_scale, dtype=torch.float32, device=z.device)  # type: ignore[union-attr]
        return ((z * std) * scale).view(b, s, -1).to(e.device, e.dtype)

    def _core_in(self, state: Tensor, e: Tensor, mode: str) -> Tensor:
        if self.huginn:
            return column_linear(self.adapter, torch.cat([state, e], dim=-1), mode)
        return state

    def _core_out(self, x: Tensor, mode: str) -> Tensor:
        return x if self.huginn else self.final_norm(x, mode)

    def _readout(self, state: Tensor, rope: Rope, mask: Any, mode: str) -> Tensor:
        x = self.final_norm(state, mode) if self.huginn else state
        for blk in _blocks(self.coda):
            x = self._block(blk, x, rope, mask, mode)[0]
        return self.final_norm(x, mode) if self.huginn else x

    def head_logits(self, hidden: Tensor, mode: str) -> Tensor:
        """This rank's vocab shard of the logits, [B, S, V_pad / tp] (fp32 in exact mode)."""
        weight = self.embedding.weight if self.tied else None
        return column_linear(self.output_layer, hidden, mode, weight=weight)

    def gate_logit(self, state: Tensor, mode: str) -> Tensor:
        """Ouro's exit-gate logit of a (normed) state, [...]."""
        return replicated_linear(self.exit_gate, state, mode)[..., 0]

    def _block(
        self,
        blk: LoopedBlock,
        x: Tensor,
        rope: Rope,
        mask: Any,
        mode: str,
        prev: tuple[Tensor, Tensor] | None = None,
        active: Tensor | None = None,
        frozen: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.options.recompute == "none" or not torch.is_grad_enabled():
            return blk(x, rope, mask, mode, prev, active, frozen, rows)  # type: ignore[no-any-return]
        # megatron's checkpoint takes tensors only: the optional ones travel as a flat tuple
        # (a packed row's mask rides in the closure). Its output needs an input that
        # requires grad, or the block's weights get none (the first iteration after no-grad
        # ones, when nothing but the state enters the core).
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        has = (prev is not None, active is not None, frozen is not None, rows is not None)
        opt = [*(prev or ()), *(t for t in (active, frozen, rows) if t is not None)]
        doc = None if isinstance(mask, Tensor) else mask  # a DocMask or FlexAttention BlockMask

        def run(x_: Tensor, table: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
            it = iter(rest)
            mask_: Any = doc if doc is not None else next(it)
            pkv = (next(it), next(it)) if has[0] else None
            act = next(it) if has[1] else None
            fr = next(it) if has[2] else None
            at = next(it) if has[3] else None
            return blk(x_, Rope(rope.kind, table), mask_, mode, pkv, act, fr, at)  # type: ignore[no-any-return]

        lead = [] if doc is not None else [mask]
        return tensor_parallel.checkpoint(run, False, x, rope.table, *lead, *opt)  # type: ignore[no-any-return]

    def forward(
        self,
        tokens: Tensor,
        depths: Tensor,
        valid: Tensor,
        latent_seeds: Tensor | Sequence[int],
        numerics: str | None = None,
        head_rows: Tensor | None = None,
        kv: str | None = None,
        loop_fn: LoopFn | None = None,
        segments: Tensor | None = None,
        positions: Tensor | None = None,
        host: HostView | None = None,
    ) -> LoopedOutput:
        """Replay forward of right-padded rows, or of packed rows (``segments``).

        tokens [B, S] int64; depths [B, S] int64 exit depths per position (1..255 where valid;
        the model may run deeper than its trained max_depth); valid [B, S] bool, a prefix of
        each row; latent_seeds: B uint64 seeds (ints, or an int64 tensor read as two's
        complement). numerics: None = options.numerics; kv: None = options.kv, else the
        family's default. head_rows [B, S] bool: the head runs at those N positions only
        (logits [N, V_pad / tp]). loop_fn (per-loop credit, learner.replay.loop_forward):
        called after core iteration k (1-based) as loop_fn(k, state [B, S, h], readout), outside
        any no_grad of truncated backprop; readout(state) is the family's readout of a state
        tensor (Huginn: norm, coda, norm; Ouro / Nanbeige: the state itself, normed by the
        core's exit) before the head. Adapted linears (learner.megatron.lora) merge once per
        call (``merged_once``), not at each iteration. host: the same depths, valid, seeds,
        segments and head_rows as host tensors (`HostView`), when the caller has them: the
        forward reads its loop counts and checks its inputs there instead of on the device
        (no sync; learner.batching's "No device read on the way in").
        """
        from learner.megatron.lora import merged_once

        with merged_once(self):
            return self._forward(tokens, depths, valid, latent_seeds, numerics, head_rows, kv,
                                 loop_fn, segments, positions, host)  # fmt: skip

    def _forward(
        self, tokens: Tensor, depths: Tensor, valid: Tensor,
        latent_seeds: Tensor | Sequence[int], numerics: str | None, head_rows: Tensor | None,
        kv: str | None, loop_fn: LoopFn | None, segments: Tensor | None,
        positions: Tensor | None, host: HostView | None = None,
    ) -> LoopedOutput:  # fmt: skip
        mode = nx.check_mode(numerics or self.options.numerics)
        kv = check_kv(kv or self.options.kv or default_kv(self.family_config))
        bsz, seq = tokens.shape
        dev = tokens.device
        h = host or HostView(depths, valid, latent_seeds, segments, head_rows)
        _check_rows(h.valid, h.depths)
        index = torch.arange(seq, device=dev).expand(bsz, seq)
        full = kv == "full"
        if segments is None:
            seeds = _seed_tensor(h.latent_seeds, bsz)
            positions = index
            # full: each position runs its row's full depth, the row's deepest position (its
            # prompt positions' D; with a one-token prompt a smaller one: no read-out depends on
            # deeper ones)
            deepest = torch.where(valid, depths, 0).amax(dim=1, keepdim=True).expand(bsz, seq)
            h_deepest = torch.where(h.valid, h.depths, 0).amax(dim=1, keepdim=True)
            mask = valid[:, None, :] & (index[:, None, :] <= index[:, :, None])
            attn_mask: Any = mask
        else:
            # a tail-padding query sees the padding keys up to itself: no empty row
            seeds, positions, deepest, doc, h_deepest = _packed(
                segments, positions, depths, valid, mode, h
            )
            attn_mask = doc.attn
        run_to = deepest if full else depths
        h_run_to = h_deepest.expand_as(h.depths) if full else h.depths
        if full and bool((h.depths > h_run_to)[h.valid].any()):
            raise ValueError("kv='full': an exit depth exceeds its row's full depth depths[b, 0]")
        if segments is None:
            mask[..., 0] |= ~mask.any(dim=-1)
        top = seq - 1 if segments is None else (
            int(h.positions.max()) if h.positions is not None else None)  # fmt: skip
        # the positions checked >= 0 on the host: an arange, or the host's packed positions
        nonnegative = segments is None or h.positions is not None
        if segments is not None and h.positions is not None and bool((h.positions < 0).any()):
            raise ValueError("packed rows: positions must be >= 0")
        rope = self._rope(positions, mode, top)
        e = self._embed(tokens)
        for blk in _blocks(self.prelude):
            e = self._block(blk, e, rope, attn_mask, mode)[0]
        state = self._initial_state(e, positions, seeds, nonnegative)
        prev: list[tuple[Tensor, Tensor] | None] = [None] * len(self.core)
        n_iter = int(h_run_to[h.valid].max()) if bool(h.valid.any()) else 0
        out_state = state
        # Truncated backprop (k > 0): token t's iterations i < depths[t] - k carry no gradient.
        # Iterations where that holds for every valid token run under no_grad; the others
        # detach the frozen tokens' K/V and outputs (LoopedBlock) and their new state.
        k_bp = self.backprop_depth if torch.is_grad_enabled() else 0
        lo = int(h.depths[h.valid].min()) - k_bp if k_bp and n_iter else 0
        hi = n_iter - k_bp if k_bp else 0
        for i in range(n_iter):
            frozen = valid & (depths - k_bp > i) if lo <= i < hi else None
            h_active = h.valid & (h_run_to > i)
            with torch.no_grad() if i < lo else contextlib.nullcontext():
                if self.options.compact and int(h_active.sum()) <= COMPACT_AT * bsz * seq:
                    state = self._rows_iteration(state, e, rope, attn_mask, mode, prev,
                                                 to_device(flat_index(h_active), dev),
                                                 frozen)  # fmt: skip
                else:
                    active = valid & (run_to > i)
                    x = self._core_in(state, e, mode)
                    for layer, blk in enumerate(_blocks(self.core)):
                        x, k, v = self._block(blk, x, rope, attn_mask, mode, prev[layer],
                                              active, frozen)  # fmt: skip
                        prev[layer] = (k, v)
                    new = self._core_out(x, mode)
                    if frozen is not None:
                        new = torch.where(frozen[:, :, None], new.detach(), new)
                    state = torch.where(active[:, :, None], new, state)
                if full:
                    out_state = torch.where((depths == i + 1)[:, :, None], state, out_state)
            if loop_fn is not None:
                after = loop_fn(i + 1, state, lambda s_: self._readout(s_, rope, attn_mask, mode))
                state = state if after is None else after
        hidden = self._readout(out_state if full else state, rope, attn_mask, mode)
        if self.is_critic:
            values = replicated_linear(self.value_head, hidden, mode)[..., 0]
            return LoopedOutput(None, hidden, values)
        rows = hidden
        if head_rows is not None:  # hidden[head_rows], its index found on the host
            at = to_device(flat_index(h.head_rows if h.head_rows is not None else head_rows),
                           hidden.device)  # fmt: skip
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
        return LoopedOutput(self.head_logits(rows, mode), hidden, None)

    def _rows_iteration(self, state: Tensor, e: Tensor, rope: Rope, attn_mask: Any, mode: str,
                        prev: list[tuple[Tensor, Tensor] | None], rows: Tensor,
                        frozen: Tensor | None) -> Tensor:  # fmt: skip
        """One core iteration of the positions at the flat indices ``rows`` (depth batching,
        `MegatronOptions.compact`): their states gathered into [1, M, h], the core stack on
        them (LoopedBlock's ``rows``: every other position attends and is attended with its
        K/V of ``prev``), the new states written back; ``prev`` updated in place. The values
        of the positions computed are the uncompacted iteration's (row-wise operations)."""
        bsz, seq, hidden = state.shape

        def take(t: Tensor) -> Tensor:
            return t.reshape(bsz * seq, *t.shape[2:]).index_select(0, rows)[None]

        at = rope.rows(rows)
        fr = None if frozen is None else take(frozen)
        x = self._core_in(take(state), take(e), mode)
        for layer, blk in enumerate(_blocks(self.core)):
            kv = prev[layer]
            if kv is None:  # the first iteration: padding positions have no K/V (never read)
                shape = (bsz, seq, blk.groups_local, blk.head_dim)
                kv = (x.new_zeros(shape), x.new_zeros(shape))
            if self.options.compile:
                _rows_dynamic(x, rows, at, fr)
            x, k, v = self._block(blk, x, at, attn_mask, mode, kv, None, fr, rows)
            prev[layer] = (k, v)
        new = self._core_out(x, mode)
        if fr is not None:
            new = torch.where(fr[:, :, None], new.detach(), new)
        flat = state.reshape(bsz * seq, hidden)
        return flat.index_copy(0, rows, new[0].to(state.dtype)).view(bsz, seq, hidden)


def _rows_dynamic(x: Tensor, rows: Tensor, rope: Rope, frozen: Tensor | None) -> None:
    """Mark M, the active positions' count, dynamic in a compiled block's inputs (x [1, M, h],
    rows [M], the RoPE rows, frozen [1, M]) from its first call. Left to torch.compile, each
    argument pattern's first two Ms compiled static graphs before dynamo made M dynamic (10
    graphs against 6 on the tiny Ouro of tests/learner/test_megatron_depth_batching.py; each
    graph more is a compile, and a guard to check at every one of a step's block calls)."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(x, 1)
    mark(rows, 0)
    mark(rope.table, 0 if rope.kind == "half" else 1)
    if frozen is not None:
        mark(frozen, 1)


COMPACT_AT = 0.875
"""Depth batching (`MegatronOptions.compact`) runs an iteration on its active positions alone
when they are at most this share of the batch's positions: the gathers and scatters cost a few
passes over [B, S, h] a layer whatever M is, so a batch that is nearly all active (a fixed
depth on packed rows: fill 0.88-0.96) keeps the masked iteration and its static shapes (compiled
blocks compile once for them)."""


class HostView(NamedTuple):
    """A forward's depths, valid, latent seeds, segments and head_rows as host tensors
    (LoopedGPT.forward ``host``), the same values as the device's."""

    depths: Tensor
    valid: Tensor
    latent_seeds: Tensor | Sequence[int]
    segments: Tensor | None = None
    head_rows: Tensor | None = None
    positions: Tensor | None = None


def _check_rows(valid: Tensor, depths: Tensor) -> None:
    index = torch.arange(valid.shape[1], device=valid.device)
    if not torch.equal(valid, index < valid.sum(dim=1)[:, None]):
        raise ValueError("valid must be a prefix of every row (right padding)")
    if ((depths < 1) | (depths > MAX_DEPTH))[valid].any():
        raise ValueError(f"depths must be in [1, {MAX_DEPTH}] at valid positions")


def _packed(
    segments: Tensor,
    positions: Tensor | None,
    depths: Tensor,
    valid: Tensor,
    mode: str,
    h: HostView,
) -> tuple[Tensor, Tensor, Tensor, DocMask, Tensor]:
    """Packed rows (LoopedGPT.forward): per-position seeds [B, S], positions, each position's
    sequence's deepest depth [B, S] (kv='full'), the block-diagonal causal mask, and the
    deepest depths again on ``h``'s device (counted and checked there)."""
    if positions is None or positions.shape != segments.shape or segments.shape != valid.shape:
        raise ValueError("packed rows: segments and positions [B, S] like tokens")
    assert h.segments is not None
    if bool(((h.segments < 0) == h.valid).any()):
        raise ValueError("packed rows: segments must be >= 0 exactly at valid positions")
    n_seg = int(h.segments.max()) + 1 if bool(h.valid.any()) else 1
    seeds = to_device(_seed_tensor(h.latent_seeds, n_seg), segments.device)
    seg = segments.clamp(min=0)
    per_seed = seeds[seg]

    def deepest(seg: Tensor, depths: Tensor, valid: Tensor) -> Tensor:
        # each segment's deepest valid depth (the padding scattered into a spare slot)
        top = torch.zeros(n_seg + 1, dtype=depths.dtype, device=depths.device)
        spare = torch.where(valid, seg, n_seg)
        top = top.scatter_reduce(0, spare.reshape(-1), torch.where(valid, depths, 0).reshape(-1),
                                 reduce="amax")  # fmt: skip
        return top[seg]

    h_seg = h.segments.clamp(min=0)
    return (per_seed, positions, deepest(seg, depths, valid), doc_mask(segments, mode, h.segments),
            deepest(h_seg, h.depths, h.valid))  # fmt: skip


def _blocks(blocks: nn.ModuleList) -> list[LoopedBlock]:
    return [b for b in blocks if isinstance(b, LoopedBlock)]


def _seed_tensor(seeds: Tensor | Sequence[int], bsz: int) -> Tensor:
    """B latent seeds as an int64 tensor (uint64 values in two's complement)."""
    if isinstance(seeds, Tensor):
        out = seeds.to("cpu", torch.int64).reshape(-1)
    else:
        out = torch.tensor([seed_to_i64(s) for s in seeds], dtype=torch.int64)
    if out.numel() != bsz:
        raise ValueError(f"need one latent seed per row ({bsz}), got {out.numel()}")
    return out


def _reference_state(config: ModelConfig, seed: int) -> dict[str, Tensor]:
    from models.reference import build_model

    return dict(build_model(config, seed=seed).state_dict())


def build_policy(
    config: ModelConfig,
    options: MegatronOptions | None = None,
    hf_state: Mapping[str, Tensor] | None = None,
) -> LoopedGPT:
    """The policy (LM head) of `config`'s family on the current TP group, weights loaded from
    `hf_state` (HF names, full tensors) or from the reference init. Call after
    `init_distributed`."""
    options = options or MegatronOptions()
    model = LoopedGPT(config, options)
    load_hf_state(
        model, hf_state if hf_state is not None else _reference_state(config, options.init_seed)
    )
    return _compile_blocks(_to_device(model))


def build_critic(
    config: ModelConfig,
    options: MegatronOptions | None = None,
    *,
    policy: LoopedGPT | None = None,
    hf_state: Mapping[str, Tensor] | None = None,
    value_init_std: float = 0.0,
) -> LoopedGPT:
    """The critic: the policy's trunk with a scalar value head Linear(h -> 1) for the LM head.

    Trunk weights from `policy` (copied, same TP layout), else `hf_state` / the reference init.
    The value head is initialised with normal(0, value_init_std) weights (0 = zeros) drawn from
    torch.Generator(options.init_seed), bias 0, identically on every rank.
    """
    options = options or MegatronOptions()
    model = LoopedGPT(config, options, critic=True)
    if policy is not None:
        trunk = {k: v for k, v in policy.state_dict().items() if not k.startswith("output_layer")}
        missing, unexpected = model.load_state_dict(trunk, strict=False)
        bad = [k for k in missing if not k.startswith("value_head")] + list(unexpected)
        if bad:
            raise ValueError(f"policy trunk does not fit the critic: {bad}")
    else:
        state = hf_state if hf_state is not None else _reference_state(config, options.init_seed)
        load_hf_state(model, state)
    gen = torch.Generator().manual_seed(options.init_seed)
    with torch.no_grad():
        w = torch.randn(model.value_head.weight.shape, generator=gen) * value_init_std
        model.value_head.weight.copy_(w)
        model.value_head.bias.zero_()
    return _compile_blocks(_to_device(model))


def _compile_blocks(model: LoopedGPT) -> LoopedGPT:
    """`options.compile`: torch.compile each block in place (parameters and state dict keys
    unchanged; `RowLinear` removes megatron's per-call graph break)."""
    if model.options.compile:
        import torch._dynamo as dynamo

        # One graph per (block, grad mode, argument pattern); shapes vary with the batch.
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        for blocks in (model.prelude, model.core, model.coda):
            for blk in _blocks(blocks):
                blk.compile()
    return model


def _to_device(model: LoopedGPT) -> LoopedGPT:
    if torch.cuda.is_available():  # megatron builds norms on the CPU
        model.cuda(torch.cuda.current_device())
    return model


__all__ = [
    "LoopedGPT",
    "LoopedOutput",
    "build_critic",
    "build_policy",
]
