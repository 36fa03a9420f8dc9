"""vLLM model classes of the looped families: the models/ modules with vLLM's paged attention.

Each class subclasses the family's reference module (`models.huginn.HuginnForCausalLM`, ...),
so its parameters carry the official checkpoint names and every non-attention primitive is
the reference's own code (`qkv` / `post` of the blocks, `embed`, `initial_state`, `core_in`,
`core_out`, `readout_in/out`, `head`, `gate_logit`). Only the attention is replaced: one
`SlotAttention` (a vLLM `Attention` = one paged KV cache) per

    prelude layer i      prefix "prelude.{i}.attn"
    core (d, l)          prefix "core.{P + d * L + l}.attn"   d < D (the policy's max depth)
    coda layer j         prefix "coda.{P + D * L + j}.attn"

(every name holds one integer, unique across the model). A forward over the step's flattened
tokens runs, like `models.engine.chunk.run_chunk`:

    e = prelude(embed(tokens));  s = initial_state(e, positions, latent seeds)
    for d in 1..D: core stack on the tokens still running; exits: prompt positions at D,
                   generated positions (and the prompt's last one, which samples token 0, where
                   `models.exits.token0_follows_policy`: Ouro) by the exit policy (or their
                   recorded depth after a preemption), checked after each iteration. Exited
                   tokens (contract 3, the policy's kv): 'last_exited': K/V carried from their
                   exit iteration, state frozen; 'full': they run on (K/V of every iteration),
                   their exit state is kept aside for the readout
    hidden = readout_out(coda(readout_in(s_exit)))  -> compute_logits: head(hidden)

Depth batching (`depth_batching = True`, the default): under kv 'last_exited' an
iteration in which some tokens of the step have exited computes only the M running ones: their rows
of the state and the embedding are gathered (`index_select`), run through core_in, each core
block's norms / projections / RoPE / MLP and core_out as an [M, h] batch, and written back
(`index_copy`). Every token's K/V carry, with the M new rows copied in, is written into this
iteration's slot (the exited tokens' K/V of their exit iteration, exactly as the masked path writes
them). Attention (`rows_attention = True`, fast numerics, vLLM's CPU_ATTN backend): the M queries
alone through vLLM's CPU kernel, the step's layout cut to the running rows
(`SlotAttention.attend_rows`: each run of consecutive running rows of a request a segment ending at
its last row's position, reading the request's blocks); elsewhere (exact numerics, other backends,
`rows_attention = False`) the M queries are scattered into the step's full layout (N rows, its
metadata is per step) and the M output rows gathered back. Either way each row is the row the
masked path computes. Prompt positions run D, so prefill chunks and decodes of different requests
share the step as before. Tokens, depths, log-probs and exit log-probs equal the masked path's
(`depth_batching = False`: every token to the deepest running one, K/V writes masked) bit for bit
in exact numerics and within 1e-6 in fast (a matmul over M rows may take another MKL kernel than
over N; tests/generator/test_depth_batching_plugin.py,
tests/generator/test_vllm_rows_attention.py). What it saves: the core FLOPs and (CPU_ATTN) the
attention of exited tokens; not their K/V writes (every iteration's slot must hold every token's
K/V), not the weight reads (once per iteration while any token runs: where a step is bound by them,
the deepest token sets the time), not the exit policy's per-iteration work on the policy rows. kv
'full' cannot save: every token feeds its K/V to every iteration's slot (later tokens' queries at
those depths read them), so it runs the masked loop. Measured (docs/PERFORMANCE.md, "Depth
batching in the vLLM plugin (CPU)"; `benchmarks/depth_batching.py --plugin`): Ouro small,
D = 16, mean exit depth D/2, one CPU thread: 0.49-0.59x the FixedDepth decode time per token
at batch 256, 0.63x at 128, 0.69x at 64 (the masked path 0.94-1.02x).

Under FixedDepth every token runs D iterations: `_fixed_core` runs them without masks or
exit checks, compiled by vLLM (`generator.vllm_plugin.compiled.FixedDepthCore`) unless
`enforce_eager`; Huginn's latent noise comes from `generator.vllm_plugin.noise.NoiseAhead`.

Settings (numerics, exit policy, recording) come from `additional_config["looprl"]`
(`generator.vllm_plugin.settings`). Per-token latent seeds and the request layout come from the
runner hook (`generator.vllm_plugin.context`); depths / log-probs / versions go to `record_book`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from generator.vllm_plugin.attention import SlotAttention
from generator.vllm_plugin.context import StepBatch, current_runner, step_batch
from generator.vllm_plugin.noise import NoiseAhead
from generator.vllm_plugin.records import RecordBook
from generator.vllm_plugin.settings import settings_from_additional_config
from models import numerics as nx
from models.base import LoopedLM
from models.config import config_from_hf_dict
from models.exits import (
    ExitCarry,
    FixedDepth,
    SampledGate,
    StepInfo,
    exit_step_logprob,
    needs_gate,
    needs_logits,
    resolve_kv,
    resolve_max_depth,
    should_exit,
    token0_follows_policy,
)
from models.huginn import HuginnForCausalLM
from models.layers import Block
from models.nanbeige import NanbeigeLoopedForCausalLM as _NanbeigeRef
from models.noise import exit_uniform
from models.ouro import OuroForCausalLM as _OuroRef
from models.reference import behaviour_logprobs


def _read_hf_config(vllm_config: Any) -> dict[str, Any]:
    """config.json of the served model (local directory, else the HF cache)."""
    import json
    from pathlib import Path

    mc = vllm_config.model_config
    path = Path(mc.model) / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(mc.model, "config.json", revision=mc.revision))
    return dict(json.loads(path.read_text()))


class _LoopedVllm:
    """The vLLM side of a looped model (mixed into a `models` family module)."""

    family_class: ClassVar[type[LoopedLM]]
    depth_batching: bool = True
    """Depth batching (module doc): at each core iteration only the tokens still running are
    computed (kv 'last_exited'); False = the masked path (every token to the deepest running
    one, K/V writes masked), kept for comparison (tests, benchmarks/depth_batching.py)."""
    rows_attention: bool = True
    """Depth batching, fast numerics, vLLM's CPU attention: the running rows' queries alone
    through the attention kernel (`SlotAttention.attend_rows`); False = their queries scattered
    into the step's full layout (every row attends; any backend)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        config = config_from_hf_dict(_read_hf_config(vllm_config))
        self.family_class.__init__(self, config)  # type: ignore[call-arg,arg-type]
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise RuntimeError(
                "looped models need vLLM's V1 model runner (per-request latent seeds are read "
                "through GPUModelRunner._model_forward): set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        settings = settings_from_additional_config(vllm_config.additional_config)
        me: Any = self
        self.mode = settings.numerics
        self.policy = settings.exit_policy or FixedDepth(me.max_depth)
        self.depth = resolve_max_depth(self.policy, me.max_depth)
        self.kv = resolve_kv(self.policy, config)
        self._token0 = 1 if token0_follows_policy(self.policy, config) else 0
        """1 where the prompt's last position follows the policy (contract 2), else 0."""
        self.record = settings.record
        self.record_book = RecordBook()
        self._noise = NoiseAhead(config.hidden_size)
        self.weight_version = 0
        self._plans: dict[str, Any] = {}
        self._step: StepBatch | None = None
        self._step_positions: np.ndarray | None = None
        cache = vllm_config.cache_config
        p, core = len(me.prelude_blocks()), list(me.core_blocks())

        def slots(blocks: Sequence[Block], name: str, first: int) -> nn.ModuleList:
            return nn.ModuleList(
                SlotAttention(
                    b.n_heads,
                    b.n_kv_heads,
                    b.head_dim,
                    mode=self.mode,
                    prefix=f"{prefix}{'.' if prefix else ''}{name}.{first + i}.attn",
                    cache_config=cache,
                    plans=self._plans,
                )
                for i, b in enumerate(blocks)
            )

        self.prelude_attn = slots(me.prelude_blocks(), "prelude", 0)
        self.core_attn = slots(core * self.depth, "core", p)
        self.coda_attn = slots(me.coda_blocks(), "coda", p + self.depth * len(core))
        self._compiled: list[Any] = []
        if isinstance(self.policy, FixedDepth) and self.mode == "fast":
            from generator.vllm_plugin.compiled import FixedDepthCore

            core_mod = FixedDepthCore(vllm_config=vllm_config, prefix=prefix, owner=self)
            if not getattr(core_mod, "do_not_compile", True):
                self._compiled.append(core_mod)  # a list: not a submodule
                # RMSNorm opaque to inductor in this (generator) process: eager bits
                nx.OPAQUE_NORM_UNDER_COMPILE = True
        n = len(core)  # per-iteration slot lists (slicing a ModuleList builds a new one)
        self._iter_slots: list[list[Any]] = [
            list(self.core_attn[d * n : (d + 1) * n]) for d in range(self.depth)
        ]

    # ---- vLLM model interface ------------------------------------------------------------
    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids)  # type: ignore[attr-defined,no-any-return]

    def _stack(
        self,
        blocks: Sequence[Block],
        slots: Iterable[Any],
        x: Tensor,
        rope: Tensor,
        carry: list[tuple[Tensor, Tensor] | None] | None = None,
        active: Tensor | None = None,
    ) -> Tensor:
        all_active = active is None or bool(active.all())
        for layer, (blk, slot) in enumerate(zip(blocks, slots)):
            q, k, v = blk.qkv(x, rope, self.mode)
            if carry is not None:
                old = carry[layer]
                if old is not None and active is not None and not all_active:
                    keep = active[:, None, None]
                    k, v = torch.where(keep, k, old[0]), torch.where(keep, v, old[1])
                carry[layer] = (k, v)
            x = blk.post(x, slot(q, k, v), self.mode)
        return x

    def _stack_running(
        self,
        blocks: Sequence[Block],
        slots: Iterable[Any],
        x: Tensor,
        rope: Tensor,
        idx: Tensor,
        carry: list[tuple[Tensor, Tensor] | None],
    ) -> Tensor:
        """`_stack` on the running rows `idx` [M] of the step's N tokens alone (depth batching,
        kv 'last_exited'): x [M, h] -> [M, h]. Norms, projections, RoPE and MLP run on M rows;
        vLLM's attention runs on the batch's full layout (its metadata is per batch): the M
        queries scattered into N zero rows, the keys / values every token's carry with the M
        new rows copied in (the exited tokens' K/V of their exit iteration, as `_stack` writes
        them), and the M output rows gathered back, so each is the uncompacted path's row."""
        n = rope.shape[0]
        rope_m = rope.index_select(0, idx)
        slots = list(slots)
        plan = slots[0].rows_plan(idx, x.dtype) if self.rows_attention and slots else None
        for layer, (blk, slot) in enumerate(zip(blocks, slots)):
            q, k, v = blk.qkv(x, rope_m, self.mode)
            old = carry[layer]
            assert old is not None  # iteration 1 runs every row and fills the carry
            kf, vf = old[0].index_copy(0, idx, k), old[1].index_copy(0, idx, v)
            carry[layer] = (kf, vf)
            if plan is not None:  # vLLM's CPU kernel on the running rows' queries alone
                a = slot.attend_rows(q, kf, vf, plan)
            else:
                qf = q.new_zeros((n, *q.shape[1:])).index_copy_(0, idx, q)
                a = slot(qf, kf, vf).index_select(0, idx)
            x = blk.post(x, a, self.mode)
        return x

    def _readout(self, state: Tensor, rope: Tensor) -> Tensor:
        me: Any = self
        x = me.readout_in(state, self.mode)
        x = self._stack(me.coda_blocks(), self.coda_attn, x, rope)
        return me.readout_out(x, self.mode)  # type: ignore[no-any-return]

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Tensor | None = None,
        **_: Any,
    ) -> Tensor:
        me: Any = self
        mode, n = self.mode, positions.shape[0]
        step = step_batch(current_runner(), n)
        self._plans["plan"] = None
        pos = positions.to(torch.int64)
        pos_np = pos.cpu().numpy()
        noise = self._noise.rows(step, pos_np) if me.draws_latent_noise else None
        # exit schedule: D for prompt positions (but the last where token 0 follows the policy)
        # and padding, recorded depth, else the policy (0)
        target = np.where(pos_np < step.prompt_len - self._token0, self.depth, 0)
        fixed_depth = isinstance(self.policy, FixedDepth)
        if self.record and step.requests and not fixed_depth:  # (FixedDepth records only D)
            rec = self.record_book.recorded_depths(step, pos_np)
            target = np.where((target == 0) & (rec > 0), rec, target)
        all_d = fixed_depth and bool(np.all((target == 0) | (target == self.depth)))
        exit_lps: np.ndarray | None = None  # a sampled exit's log-probs (SampledGate)
        if all_d and self._compiled and input_ids is not None and inputs_embeds is None:
            me.rope(pos, mode)  # (its position check, outside the compiled graph)
            hidden = self._compiled[0](input_ids, pos, noise)
            ran_np = np.full(n, self.depth, dtype=np.int64)
        elif all_d:
            # every token runs all D iterations (FixedDepth exits at D): no masks, no carry,
            # no exit checks, no host syncs; the same values as the general loop below with
            # every row active (its torch.where(all True, new, old) selects new)
            if inputs_embeds is None:
                hidden = self._fixed_core(input_ids, pos, noise)
            else:
                hidden = self._fixed_core(None, pos, noise, inputs_embeds)
            ran_np = np.full(n, self.depth, dtype=np.int64)
        else:
            e = inputs_embeds if inputs_embeds is not None else me.embed(input_ids)
            rope = me.rope(pos, mode)
            e = self._stack(me.prelude_blocks(), self.prelude_attn, e, rope)
            state = me.initial_state(e, pos, step.seeds.tolist(), noise)
            seeds_t = None  # the exit uniforms' seeds: a sampled exit only
            if isinstance(self.policy, SampledGate):
                seeds_t = torch.from_numpy(step.seeds.view(np.int64).copy()).to(pos.device)
            hidden, ran_np, exit_lps = self._loop(state, e, rope, target, seeds_t, pos)
        if self.record and step.requests:
            toks = input_ids.cpu().numpy() if input_ids is not None else np.zeros(n, np.int64)
            self.record_book.on_forward(step, pos_np, toks, ran_np, self.weight_version,
                                        exit_lps)  # fmt: skip
        self._step, self._step_positions = step, pos_np
        return hidden

    def _fixed_core(
        self,
        input_ids: Tensor | None,
        pos: Tensor,
        noise: Tensor | None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """embed -> prelude -> s_0 -> D iterations -> readout (FixedDepth, no exits)."""
        me: Any = self
        mode = self.mode
        e = inputs_embeds if inputs_embeds is not None else me.embed(input_ids)
        rope = me.rope(pos, mode)
        e = self._stack(me.prelude_blocks(), self.prelude_attn, e, rope)
        state = me.initial_state(e, pos, [], noise)
        core = list(me.core_blocks())
        for d in range(self.depth):
            x = self._stack(core, self._iter_slots[d], me.core_in(state, e, mode), rope)
            state = me.core_out(x, mode)
        return self._readout(state, rope)

    def _loop(
        self, state: Tensor, e: Tensor, rope: Tensor, target: np.ndarray, seeds: Tensor | None,
        pos: Tensor,
    ) -> tuple[Tensor, np.ndarray, np.ndarray | None]:  # fmt: skip
        """The depth loop with exits (target: per-token exit depth, 0 = the policy's);
        returns (hidden, iterations run per token, and under a sampled exit each token's exit
        log-prob: NaN where the policy did not decide, e.g. a recomputed recorded depth).
        seeds [N] int64 (a sampled exit; else None), pos [N]: the rows' latent seeds and
        positions (the exit uniforms)."""
        me: Any = self
        mode, n = self.mode, state.shape[0]
        dev = state.device
        fixed = torch.from_numpy(target).to(dev)
        pol_idx = torch.nonzero(fixed == 0).flatten()
        ran = torch.zeros(n, dtype=torch.int64, device=dev)
        active = torch.ones(n, dtype=torch.bool, device=dev)
        core = list(me.core_blocks())
        carry: list[tuple[Tensor, Tensor] | None] = [None] * len(core)
        exit_carry: ExitCarry | None = None
        full = self.kv == "full"  # every token runs every iteration; exit state kept aside
        out_state = state
        sampled = isinstance(self.policy, SampledGate)
        elp = None
        if sampled:
            assert isinstance(self.policy, SampledGate)
            min_d = self.policy.min_depth
            forced = torch.full((pol_idx.numel(),), self.depth, dtype=torch.int64, device=dev)
            elp = torch.zeros(pol_idx.numel(), dtype=torch.float64 if mode == "exact"
                              else torch.float32, device=dev)  # fmt: skip
        for d in range(self.depth):
            slots = self._iter_slots[d]
            if not full and not bool(active.any()):
                for slot, kv in zip(slots, carry):  # keep the last-exited K/V visible
                    assert kv is not None
                    slot.write(*kv)
                continue
            idx = None if full or not self.depth_batching else torch.nonzero(active)[:, 0]
            if idx is not None and idx.numel() < n:  # depth batching: the running rows alone
                x = me.core_in(state.index_select(0, idx), e.index_select(0, idx), mode)
                x = self._stack_running(core, slots, x, rope, idx, carry)
                prev, state = state, state.index_copy(0, idx, me.core_out(x, mode))
                new = state  # (exited rows: their frozen state; the policy masks them)
            else:
                x = me.core_in(state, e, mode)
                x = self._stack(core, slots, x, rope, *((None, None) if full else (carry, active)))
                new = me.core_out(x, mode)
                prev, state = state, new if full else torch.where(active[:, None], new, state)
            ran = torch.where(active, d + 1, ran)
            stop = active & (fixed == d + 1)
            if pol_idx.numel():
                info = StepInfo(d + 1, self.depth, new[pol_idx], prev[pol_idx], mode=mode)
                if needs_logits(self.policy):
                    info.logits = me.head(self._readout(state, rope), mode)[pol_idx]
                if needs_gate(self.policy):
                    info.gate_logit = me.gate_logit(new[pol_idx], mode)
                if sampled:
                    assert seeds is not None
                    info.uniform = exit_uniform(seeds[pol_idx], pos[pol_idx], d + 1)
                hit, exit_carry = should_exit(self.policy, info, exit_carry)
                decided = active[pol_idx] & hit.to(dev)
                if elp is not None and info.gate_logit is not None:  # models.engine.chunk's order
                    term = exit_step_logprob(info.gate_logit, decided, d + 1, min_d, forced, mode)
                    elp = elp + torch.where(active[pol_idx], term.to(elp.device),
                                            torch.zeros_like(elp))  # fmt: skip
                stop[pol_idx] |= decided
            if full:
                out_state = torch.where(stop[:, None], state, out_state)
            active = active & ~stop
        lps = None
        if elp is not None:
            lps = np.full(n, np.nan, np.float32)
            lps[pol_idx.cpu().numpy()] = elp.to(torch.float32).cpu().numpy()
        return self._readout(out_state if full else state, rope), ran.cpu().numpy(), lps

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        me: Any = self
        logits = me.head(hidden_states, self.mode)[:, : me.vocab_size]
        step, self._step = self._step, None
        if (
            self.record
            and step is not None
            and step.requests
            and hidden_states.shape[0] == len(step.requests)
        ):
            groups: dict[tuple[float, float], list[int]] = {}
            for i, rs in enumerate(step.requests):  # greedy: log-softmax of the raw logits
                greedy = rs.temperature < 1e-5
                key = (1.0, 1.0) if greedy else (rs.temperature, rs.top_p)
                groups.setdefault(key, []).append(i)
            rows: list[np.ndarray] = [np.zeros(0, np.float32)] * len(step.requests)
            for (temp, top_p), idx in groups.items():  # row-wise ops: grouping changes no bit
                rows_in = logits if len(idx) == len(rows) else logits[idx]
                lp = behaviour_logprobs(rows_in, me.vocab_size, temp, top_p, self.mode)
                lp_np = lp.cpu().numpy()
                for j, i in enumerate(idx):
                    rows[i] = lp_np[j]
            assert self._step_positions is not None
            self.record_book.on_logits(step, self._step_positions, rows)
        return logits  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load HF-named tensors 1:1 (a tied head's `lm_head.weight` is skipped, as HF does)."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        me: Any = self
        params = dict(me.named_parameters())
        buffers = dict(me.named_buffers())
        all_params = dict(me.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in params:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            elif name in buffers:
                buffers[name].copy_(tensor.to(buffers[name].dtype))
            elif name in all_params:  # tied alias (e.g. lm_head.weight = wte.weight)
                pass
            else:
                raise ValueError(f"unexpected tensor {name!r} for {type(self).__name__}")
            loaded.add(name)
        return loaded


class RavenForCausalLM(_LoopedVllm, HuginnForCausalLM):  # type: ignore[misc]
    """Huginn-0125 in vLLM."""

    family_class = HuginnForCausalLM


class OuroForCausalLM(_LoopedVllm, _OuroRef):  # type: ignore[misc]
    """Ouro LoopLM in vLLM."""

    family_class = _OuroRef


class NanbeigeLoopedForCausalLM(_LoopedVllm, _NanbeigeRef):  # type: ignore[misc]
    """Nanbeige looped model in vLLM."""

    family_class = _NanbeigeRef


__all__ = ["NanbeigeLoopedForCausalLM", "OuroForCausalLM", "RavenForCausalLM"]
