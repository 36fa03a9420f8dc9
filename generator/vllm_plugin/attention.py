"""One paged-KV attention slot of a looped model: vLLM's kernel (fast) or fp64 (exact).

A looped model has one `SlotAttention` per (iteration, core layer) and per prelude / coda
layer, each owning a vLLM `Attention` (hence its own paged KV cache). Per call:

- fast: `Attention.forward(q, k, v)`: vLLM writes k, v at the tokens' slots, then runs its
  backend kernel (CPU_ATTN on CPU, FlashAttention & co. on GPU).
- exact: the k, v are written with vLLM's `unified_kv_cache_update` (backend-agnostic), then
  the keys / values of every request's context are gathered back from this layer's cache
  through the block table and attention runs as `models.numerics.attention(mode="exact")`
  (fp64, the order-defined recipe), so it equals the reference bit for bit.
- `write(k, v)`: only stores k, v (iterations no token of the step still runs; the cache
  must still hold every token's last-exited K/V for later queries, docs/CONTRACTS.md 3,
  kv: last_exited; under kv: full every token runs every iteration and writes its own).
- `attend_rows(q, k, v, plan)` (fast, CPU_ATTN; depth batching): stores the K/V of all the
  step's tokens, then runs vLLM's CPU attention kernel on the queries of the running rows
  alone (`rows_plan`: the step's layout cut to those rows, each run of consecutive running
  rows of one request a segment that ends at its last row's position), so attention costs
  what the running rows cost instead of the whole step's.

Cache layouts read back in exact mode (vLLM 0.32): CPU_ATTN `[blocks, kv_heads, block, 2*D]`
(each (block, head) page: the keys transposed [D, block], then the values [block, D]; this is
the "vec" ISA, fp32 on x86) and the FlashAttention-style
`[2, blocks, block, kv_heads, D]`. Each exact forward checks that the slots it just wrote read
back as the k it wrote, and raises otherwise, so an unknown layout fails loudly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from models import numerics as nx


@dataclasses.dataclass
class ExactPlan:
    """Gather indices of one forward, shared by all slots (one KV cache group)."""

    q_rows: Tensor
    """int64 [R, S] flattened token row of each (request, query) (0 where padded)."""
    q_valid: Tensor
    """bool [R, S]."""
    blocks: Tensor
    offsets: Tensor
    """int64 [R, K]: cache block and offset of each (request, key position)."""
    mask: Tensor
    """bool [R, S, K]: causal visibility (padding queries see key 0)."""
    checked: bool = False


def _split_cache(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(keys, values), each [blocks, kv_heads, block_size, D]."""
    if kv_cache.dim() == 4:  # CPU_ATTN: [nb, G, bs, 2D]; page = keys [D, bs], values [bs, D]
        nb, g, bs, two_d = kv_cache.shape
        pages = kv_cache.view(nb, g, 2, bs * (two_d // 2))
        keys = pages[:, :, 0].view(nb, g, two_d // 2, bs).transpose(2, 3)
        return keys, pages[:, :, 1].view(nb, g, bs, two_d // 2)
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:  # [2, nb, bs, G, D]
        return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    raise RuntimeError(
        f"exact numerics: unsupported KV cache layout {tuple(kv_cache.shape)}; "
        "use numerics='fast' with this attention backend"
    )


def build_plan(metadata: Any, block_size: int, device: torch.device) -> ExactPlan:
    """Gather plan of a forward from its attention metadata (query_start_loc, seq_lens,
    block_table: present in CPU_ATTN and FlashAttention metadata)."""
    qsl = metadata.query_start_loc.to("cpu", torch.int64)
    seq_lens = metadata.seq_lens.to("cpu", torch.int64)
    n_req = int(seq_lens.shape[0])
    qsl = qsl[: n_req + 1]
    q_lens = qsl[1:] - qsl[:-1]
    s_max, k_max = max(int(q_lens.max()), 1), max(int(seq_lens.max()), 1)
    j = torch.arange(s_max)
    q_valid = j[None, :] < q_lens[:, None]
    q_rows = torch.where(q_valid, qsl[:-1, None] + j[None, :], 0)
    q_pos = seq_lens[:, None] - q_lens[:, None] + j[None, :]
    t = torch.arange(k_max)
    k_valid = t[None, :] < seq_lens[:, None]
    table = metadata.block_table.to("cpu", torch.int64)[:n_req]
    page = torch.clamp(t // block_size, max=table.shape[1] - 1)
    blocks = torch.where(k_valid, table.gather(1, page.expand(n_req, -1)), 0)
    offsets = torch.where(k_valid, (t % block_size)[None, :], 0)
    mask = k_valid[:, None, :] & (t[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
    mask[..., 0] |= ~mask.any(dim=-1)
    return ExactPlan(
        q_rows.to(device),
        q_valid.to(device),
        blocks.to(device),
        offsets.to(device),
        mask.to(device),
    )


def row_segments(
    rows: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The attention layout of a subset of a step's query rows.

    rows: sorted int64 [M] rows of the step's flattened tokens; query_start_loc [R + 1] and
    seq_lens [R] the step's (request r's queries are rows qsl[r]..qsl[r + 1] - 1 at positions
    seq_lens[r] - q_len[r] + offset). Returns (keep [M] bool: rows inside a request, not
    padding; req [S] the request of each segment; query_start_loc' [S + 1]; seq_lens' [S]):
    each segment is a run of consecutive kept rows of one request, a pseudo-request whose
    queries sit at the same positions as in the step (its seq_len = its last row's position + 1)
    and read the same keys through the request's block table."""
    n_req = len(seq_lens)
    qsl = np.asarray(query_start_loc[: n_req + 1], dtype=np.int64)
    keep = rows < qsl[n_req]
    r = rows[keep]
    if r.size == 0:
        none = np.zeros(0, np.int64)
        return keep, none, np.zeros(1, np.int64), none
    req = np.searchsorted(qsl[1:], r, side="right")
    brk = np.flatnonzero((np.diff(r) != 1) | (np.diff(req) != 0)) + 1
    ends = np.append(brk, r.size)
    seg = req[np.insert(brk, 0, 0)]
    q_len = qsl[1:] - qsl[:-1]
    seq = np.asarray(seq_lens, dtype=np.int64)[seg] - q_len[seg] + (r[ends - 1] - qsl[seg]) + 1
    return keep, seg, np.insert(ends, 0, 0), seq


@dataclasses.dataclass
class RowsPlan:
    """CPU_ATTN metadata of one depth-batching iteration's running rows (`row_segments`),
    shared by the iteration's core layers (one KV cache group)."""

    n_rows: int
    """M: the running rows given (the queries of `attend_rows`)."""
    keep: Tensor | None
    """bool [M]: rows inside a request (None: all; padding rows get zeros)."""
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    scheduler_metadata: Tensor


def _cpu_attn_impl(attn: Any) -> Any:
    """The layer's CPU_ATTN decoder implementation, else None."""
    try:
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # pragma: no cover (a vLLM build without the CPU backend)
        return None
    impl = getattr(attn, "impl", None)
    if isinstance(impl, CPUAttentionBackendImpl) and impl.attn_type == AttentionType.DECODER:
        return impl
    return None


def cpu_rows_plan(
    rows: Tensor, metadata: Any, impl: Any, isa: str, dtype: torch.dtype,
    shape: tuple[int, int, int],
) -> RowsPlan:  # fmt: skip
    """The CPU_ATTN layout of the running rows `rows` [M] of a step whose attention metadata
    is `metadata` (query_start_loc, seq_lens, block_table): `row_segments`, and the kernel's
    scheduler metadata for it. impl: the layer's CPU_ATTN implementation; isa: its kernel ISA;
    dtype: the model's (the queries'); shape: (heads, kv_heads, head_dim)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    n_req = int(metadata.seq_lens.shape[0])
    keep, req, qsl, seq = row_segments(
        rows.cpu().numpy(),
        metadata.query_start_loc.cpu().numpy(),
        metadata.seq_lens.cpu().numpy(),
    )
    qsl_t = torch.from_numpy(qsl.astype(np.int32))
    seq_t = torch.from_numpy(seq.astype(np.int32))
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq.shape[0]),
        num_heads=shape[0],
        num_kv_heads=shape[1],
        head_dim=shape[2],
        seq_lens=seq_t,
        dtype=dtype,
        query_start_loc=qsl_t,
        causal=True,
        sliding_window_size=impl.sliding_window,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    table = metadata.block_table[:n_req].index_select(0, torch.from_numpy(req).to(torch.int64))
    return RowsPlan(
        n_rows=int(rows.shape[0]),
        keep=None if bool(keep.all()) else torch.from_numpy(keep),
        query_start_loc=qsl_t,
        seq_lens=seq_t,
        block_table=table,
        scheduler_metadata=sched,
    )


def cpu_rows_attention(q: Tensor, kv_cache: Tensor, plan: RowsPlan, layer: Any) -> Tensor:
    """vLLM's CPU attention kernel on the queries q [M, H, D] of a plan's rows against the
    layer's paged cache kv_cache [blocks, G, block, 2 D] -> [M, H * D] (zeros for padding
    rows). layer: the vLLM `Attention` (its impl's scale, window, softcap, sinks; its K/V
    scales)."""
    from vllm import _custom_ops as ops

    impl = layer.impl
    nb, g, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, g, bs * 2, -1).chunk(2, dim=2)
    qq = (q if plan.keep is None else q[plan.keep]).contiguous()
    if qq.shape[0] == 0:  # padding rows only
        return q.new_zeros(plan.n_rows, q.shape[1] * q.shape[2])
    out = torch.empty_like(qq)
    ops.cpu_attention_with_kv_cache(
        query=qq,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=plan.query_start_loc,
        seq_lens=plan.seq_lens,
        scale=impl.scale,
        causal=True,
        alibi_slopes=impl.alibi_slopes,
        sliding_window=impl.sliding_window,
        block_table=plan.block_table,
        softcap=impl.logits_soft_cap,
        scheduler_metadata=plan.scheduler_metadata,
        s_aux=impl.sinks,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    if plan.keep is None:
        return out.view(plan.n_rows, -1)
    full = q.new_zeros(plan.n_rows, q.shape[1] * q.shape[2])
    full[plan.keep] = out.view(out.shape[0], -1)
    return full


class SlotAttention(nn.Module):
    """A vLLM `Attention` plus the exact-mode path (see module doc)."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        mode: str,
        prefix: str,
        cache_config: Any,
        plans: dict[str, Any],
    ) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.heads, self.kv_heads, self.head_dim, self.mode = heads, kv_heads, head_dim, mode
        self.attn = Attention(
            heads,
            head_dim,
            1.0 / math.sqrt(head_dim),
            num_kv_heads=kv_heads,
            cache_config=cache_config,
            prefix=prefix,
        )
        self.layer_name = prefix
        self._plans = plans  # shared per model: {"plan": ExactPlan | None}

    def write(self, k: Tensor, v: Tensor) -> None:
        """Store k, v [T, G, D] at the tokens' slots without attending."""
        from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

        unified_kv_cache_update(k.contiguous(), v.contiguous(), self.layer_name)

    def rows_plan(self, rows: Tensor, dtype: torch.dtype) -> RowsPlan | None:
        """The plan of `attend_rows` for the running rows `rows` [M] (sorted) of this step
        (dtype: the queries', the model's), or None where it does not apply (exact numerics,
        another backend, no metadata: a dummy run), and the caller attends on the step's full
        layout."""
        impl = _cpu_attn_impl(self.attn) if self.mode != "exact" else None
        if impl is None:
            return None
        from vllm.model_executor.layers.attention.attention import get_attention_context

        md, _, kv_cache, _ = get_attention_context(self.layer_name)
        if md is None or kv_cache.numel() == 0 or md.dynamic_causal is not None or not md.causal:
            return None
        isa = str(self.attn.isa)  # (set on the layer by the CPU_ATTN builder)
        return cpu_rows_plan(rows, md, impl, isa, dtype,
                             (self.heads, self.kv_heads, self.head_dim))  # fmt: skip

    def attend_rows(self, q: Tensor, k: Tensor, v: Tensor, plan: RowsPlan) -> Tensor:
        """Depth batching, fast, CPU_ATTN: k / v [T, G, D] of every token of the step stored
        (as `forward` stores them), then attention for the M running rows' queries q [M, H, D]
        alone -> [M, H * D], each row the value `forward` gives it on the full layout."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        self.write(k, v)
        _, layer, kv_cache, _ = get_attention_context(self.layer_name)
        return cpu_rows_attention(q, kv_cache, plan, layer)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k / v [T, G, D] -> attention output [T, H * D]."""
        n = q.shape[0]
        if self.mode != "exact":
            return self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
        from vllm.model_executor.layers.attention.attention import get_attention_context

        metadata, _, kv_cache, slot_mapping = get_attention_context(self.layer_name)
        if metadata is None or kv_cache.numel() == 0:  # profiling / dummy runs
            return q.new_zeros(n, self.heads * self.head_dim)
        self.write(k, v)
        keys, values = _split_cache(kv_cache)
        plan = self._plans.get("plan")
        if plan is None:
            plan = build_plan(metadata, keys.shape[2], q.device)
            self._plans["plan"] = plan
        if not plan.checked:
            _check_layout(keys, k, slot_mapping)
            plan.checked = True
        kk = keys[plan.blocks, :, plan.offsets]  # [R, K, G, D]
        vv = values[plan.blocks, :, plan.offsets]
        qq = q[plan.q_rows]  # [R, S, H, D]
        out = nx.attention(qq, kk, vv, plan.mask, "exact")  # [R, S, H * D]
        result = q.new_zeros(n, self.heads * self.head_dim)
        result[plan.q_rows[plan.q_valid]] = out[plan.q_valid]
        return result


def _check_layout(keys: Tensor, k: Tensor, slot_mapping: Tensor | None) -> None:
    if slot_mapping is None:
        return
    slots = slot_mapping[: k.shape[0]].to(torch.int64)
    ok = slots >= 0
    bs = keys.shape[2]
    got = keys[slots[ok] // bs, :, slots[ok] % bs]
    if not torch.equal(got, k[ok].to(got.dtype)):
        raise RuntimeError(
            "exact numerics: the KV cache does not read back as written (unknown layout); "
            "use numerics='fast' with this attention backend"
        )


__all__ = [
    "ExactPlan",
    "RowsPlan",
    "SlotAttention",
    "build_plan",
    "cpu_rows_attention",
    "cpu_rows_plan",
    "row_segments",
]
