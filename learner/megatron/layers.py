"""megatron-core building blocks of the looped families, in both numerics modes.

Layout is batch-first: activations are [B, S, h] (B rows, S positions), q [B, S, H_l, D],
k / v [B, S, G_l, D] with H_l = H / tp query heads and G_l = G / tp key/value heads on this
tensor-parallel rank. Every linear is a megatron `ColumnParallelLinear` / `RowParallelLinear`
(`VocabParallelEmbedding` for the embedding), so Megatron DDP, the DistributedOptimizer and
`dist_checkpointing` see ordinary megatron parameters.

Numerics (docs/CONTRACTS.md 5, `models.numerics`):

- `fast`: megatron's own forward (native fp32 / bf16 matmuls) and attention through
  `F.scaled_dot_product_attention(is_causal=True)` (flash / memory-efficient kernels on GPU). A
  causal mask is all the depth logic needs: the exit KV semantics (contract 3) live in which
  K/V are passed, and rows are right-padded, so a real query never sees a padding key.
- `exact`: every linear is `F.linear(x.double(), W.double())`; a `RowParallelLinear`'s fp64
  partial sums are all-reduced in fp64 over the TP group, the bias added in fp64, and the result
  rounded ONCE to fp32 after the reduction, so TP=1 and TP=2 agree bit for bit with the reference.
  Attention, norms, SwiGLU and RoPE call the `models.numerics` recipes.

Fused layouts (TP-invariant, so dist_checkpointing can reshard between TP sizes):

- `linear_qkv` rows are grouped per key/value group g: [q heads of g (H/G of them), k_g, v_g];
  rank r holds groups [r G/tp, (r+1) G/tp). Needs G % tp == 0.
- `linear_fc1` rows on rank r are [gate_r; up_r] (megatron's SwiGLU layout; its sharded state
  dict splits the two halves with `apply_swiglu_sharded_factory`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor, nn

from models import numerics as nx

BLOCK_STYLES = ("huginn", "llama", "ouro")


def column_linear(
    layer: ColumnParallelLinear, x: Tensor, mode: str, weight: Tensor | None = None
) -> Tensor:
    """Output of a ColumnParallelLinear (local shard unless it gathers its output); a layer
    with adapters (learner.megatron.lora) computes with its merged weight."""
    if weight is None and hasattr(layer, "lora"):
        weight = _adapted(layer)
    w = layer.weight if weight is None else weight
    if mode == "exact":
        xp = copy_to_tensor_model_parallel_region(x)  # identity; backward all-reduces
        b = None if layer.bias is None else layer.bias.double()
        y = F.linear(xp.double(), w.double(), b).float()
        return gather_from_tensor_model_parallel_region(y) if layer.gather_output else y
    out, _ = layer(x, weight=weight)
    return out  # type: ignore[no-any-return]


def row_linear(layer: RowParallelLinear, x: Tensor, mode: str) -> Tensor:
    """Output of a RowParallelLinear (full, replicated on the TP group).

    exact: fp64 partial sums all-reduced in fp64, bias added in fp64, one rounding to fp32.
    """
    if mode == "exact":
        w = _adapted(layer)
        y = reduce_from_tensor_model_parallel_region(F.linear(x.double(), w.double()))
        if layer.bias is not None:
            y = y + layer.bias.double()
        return y.float()
    out, _ = layer(x)
    return out  # type: ignore[no-any-return]


def replicated_linear(layer: nn.Linear, x: Tensor, mode: str) -> Tensor:
    """A small TP-replicated linear (exit gate, value head) via `models.numerics.linear`."""
    return nx.linear(x, _adapted(layer), layer.bias, mode)


def _adapted(layer: nn.Module) -> Tensor:
    """The layer's weight, merged with its adapters when it has them (learner.megatron.lora)."""
    w = layer.weight
    assert isinstance(w, Tensor)
    lora = getattr(layer, "lora", None)
    return w if lora is None else lora(w)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class DocMask:
    """The attention mask of packed rows (models.token_rows.pack_rows): causal within a sequence,
    nothing across sequences (block-diagonal). ``dense`` [B, S, S] bool (True = visible; a
    tail-padding query sees the padding keys up to itself): the exact recipe's mask, and the
    fast one's on the CPU. ``flex``: a FlexAttention BlockMask of the same mask (fast numerics
    on CUDA), whose kernel skips the blocks across sequences; None elsewhere."""

    dense: Tensor | None
    segments: Tensor
    flex: Any = None
    spans: tuple[tuple[int, int], ...] = ()
    """[start, stop) of each sequence in the packed row (B = 1; the tail padding its own span):
    fast numerics outside torch.compile run SDPA is_causal per span (work sum n_i^2, the padded
    rows' kernel) instead of the dense N x N mask."""

    @property
    def attn(self) -> Any:
        """What the blocks get: the BlockMask itself when there is one (a compiled block takes
        it as FlexAttention's documented argument), else this DocMask (its dense mask)."""
        return self if self.flex is None else self.flex


_FLEX: dict[str, Any] = {}
"""The compiled flex_attention, once it worked on this process's device ("fn"), or the reason
it did not ("error"): `doc_mask` falls back to SDPA with the dense mask."""


def _flex_fn() -> Any:
    """torch.compile(flex_attention), checked once on a small doc mask against SDPA."""
    if "fn" in _FLEX or "error" in _FLEX:
        return _FLEX.get("fn")
    if os.environ.get("LOOPRL_PACKED_ATTENTION", "auto") == "sdpa":
        _FLEX["error"] = "LOOPRL_PACKED_ATTENTION=sdpa"
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fn = torch.compile(flex_attention)
        dev = torch.device("cuda", torch.cuda.current_device())
        seg = torch.tensor([0] * 100 + [1] * 156, device=dev)[None]
        bm = create_block_mask(_doc_mod(seg), 1, None, 256, 256, device=dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, 2, 256, 96, device=dev, generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))  # fmt: skip
        got = fn(q, k, v, block_mask=bm)
        dense = (seg[:, None, :] == seg[:, :, None]) & torch.ones(
            256, 256, device=dev
        ).tril().bool()
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
        err = float((got.float() - want.float()).abs().max())
        if not err < 0.05:
            raise RuntimeError(f"flex_attention differs from SDPA by {err}")
        _FLEX["fn"] = fn
    except Exception as exc:  # noqa: BLE001  (any failure: the dense SDPA path, logged)
        _FLEX["error"] = f"{type(exc).__name__}: {exc}"
        logging.getLogger(__name__).warning(
            "packed rows: FlexAttention unavailable (%s); SDPA with a dense mask", _FLEX["error"]
        )
    return _FLEX.get("fn")


def _doc_mod(segments: Tensor) -> Any:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (segments[b, q_idx] == segments[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def doc_mask(segments: Tensor, mode: str, host: Tensor | None = None) -> DocMask:
    """The `DocMask` of packed rows' ``segments`` [B, S] (-1 on the tail padding): fast numerics
    on CUDA get a FlexAttention BlockMask (no dense mask) when FlexAttention works there.
    ``host``: the same segments on the host (the spans are cut there, no device read)."""
    b, s = segments.shape
    if mode != "exact" and segments.is_cuda and _flex_fn() is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(_doc_mod(segments), b, None, s, s, device=segments.device)
        return DocMask(None, segments, bm)
    idx = torch.arange(s, device=segments.device)
    dense = (segments[:, None, :] == segments[:, :, None]) & (idx[None, :] <= idx[:, None])
    spans: tuple[tuple[int, int], ...] = ()
    if b == 1:
        seg = (segments if host is None else host)[0].cpu()
        cut = [0, *(torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1).tolist(), s]
        spans = tuple(zip(cut[:-1], cut[1:], strict=True))
    return DocMask(dense, segments, spans=spans)


def core_attention(q: Tensor, k: Tensor, v: Tensor, mask: Any, mode: str) -> Tensor:
    """Causal attention, q [B, S, H_l, D], k / v [B, S, G_l, D] -> [B, S, H_l * D].

    exact: `models.numerics.attention` with `mask` ([B, S, T] bool, True = visible; a
    `DocMask`'s dense mask).
    fast: SDPA with is_causal=True (right-padded rows: real queries see only real keys); a
    `DocMask` (packed rows): SDPA is_causal per sequence (its spans; under torch.compile SDPA
    with its dense mask); its FlexAttention BlockMask, passed instead of it (`DocMask.attn`):
    FlexAttention.
    """
    if isinstance(mask, DocMask):
        # (compiling first: a compiled block must not guard on the spans, which change)
        if mode != "exact" and not torch.compiler.is_compiling() and mask.spans:
            gqa = q.shape[2] != k.shape[2]
            outs = [F.scaled_dot_product_attention(
                        q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2),
                        v[:, a:b].transpose(1, 2), is_causal=True, enable_gqa=gqa)
                    for a, b in mask.spans]  # fmt: skip
            return torch.cat(outs, dim=2).transpose(1, 2).flatten(2)
        assert mask.dense is not None
        return nx.attention(q, k, v, mask.dense, mode)
    if not isinstance(mask, Tensor):  # a DocMask's FlexAttention BlockMask (fast, CUDA)
        out = _FLEX["fn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          block_mask=mask, enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
        return out.transpose(1, 2).flatten(2)  # type: ignore[no-any-return]
    if mode == "exact":
        return nx.attention(q, k, v, mask, "exact")
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
    )
    return out.transpose(1, 2).flatten(2)


def _put_rows(full: Tensor, rows: Tensor, part: Tensor) -> Tensor:
    """``full`` [B, S, ...] with the flat positions ``rows`` replaced by ``part`` [1, M, ...]
    (out of place: the gradient reaches both)."""
    b, s = full.shape[:2]
    flat = full.reshape(b * s, *full.shape[2:])
    return flat.index_copy(0, rows, part[0].to(full.dtype)).view(full.shape)


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE rows of a batch: `adjacent` (Huginn, table [B, S, D/2, 2]) or `half` (split-half,
    table [B * S, 2, D])."""

    kind: str
    table: Tensor

    def rows(self, index: Tensor) -> Rope:
        """The rows of the flat positions ``index`` ([M]), as a batch [1, M]."""
        if self.kind == "adjacent":
            t = self.table
            return Rope(self.kind, t.reshape(-1, *t.shape[2:]).index_select(0, index)[None])
        return Rope(self.kind, self.table.index_select(0, index))

    def __call__(self, x: Tensor, mode: str) -> Tensor:
        if self.kind == "adjacent":
            return nx.rope_adjacent(x, self.table[:, :, None], mode)
        b, s, heads, dim = x.shape
        return nx.rope_half(x.reshape(b * s, heads, dim), self.table, mode).view(b, s, heads, dim)


class RMSNorm(nn.Module):
    """TP-replicated RMSNorm (`models.numerics.rms_norm`); `weight` [h]."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor, mode: str) -> Tensor:
        return nx.rms_norm(x, self.weight, self.eps, mode)


class RowLinear(RowParallelLinear):
    """megatron's RowParallelLinear, passing its own TP group to the matmul: 0.16.1's forward
    passes `tp_group=None`, whose fallback (`get_tensor_model_parallel_group_if_none`) warns on
    every call, a torch.compile graph break inside each block. Same group, same result. With
    adapters (learner.megatron.lora) it multiplies by its merged weight."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        if hasattr(self, "lora"):  # adapters (learner.megatron.lora): the merged weight
            weight = _adapted(self)
        return super()._forward_impl(input, weight, *args, **kwargs)


def _zero_init(t: Tensor) -> Tensor:
    """Megatron init method: weights are loaded afterwards (hf_convert)."""
    return nn.init.zeros_(t)


class LoopedBlock(nn.Module):
    """One attention + SwiGLU block, split at the attention like `models.layers`.

    style 'huginn': x = n2(proj(attn(n1 x)) + x); x = n4(mlp(n3 x) + x); qk_bias before RoPE.
    style 'llama':  x = x + proj(attn(n1 x)); x = x + mlp(n3 x).
    style 'ouro':   x = x + n2(proj(attn(n1 x))); x = x + n4(mlp(n3 x)).
    (n1 input_norm, n2 attn_out_norm, n3 pre_mlp_norm, n4 mlp_out_norm.)
    """

    def __init__(
        self,
        config: TransformerConfig,
        style: str,
        *,
        eps: float,
        qkv_bias: bool = False,
        proj_bias: bool = False,
        qk_bias: bool = False,
    ) -> None:
        super().__init__()
        if style not in BLOCK_STYLES:
            raise ValueError(f"block style must be one of {BLOCK_STYLES}, got {style!r}")
        tp = config.tensor_model_parallel_size
        heads, groups = config.num_attention_heads, config.num_query_groups or 1
        dim = config.kv_channels or config.hidden_size // heads
        if groups % tp:
            raise ValueError(f"key/value heads ({groups}) must be a multiple of tp ({tp})")
        self.style, self.head_dim = style, dim
        self.heads_local, self.groups_local = heads // tp, groups // tp
        h, dt = config.hidden_size, config.params_dtype
        common: dict[str, Any] = dict(config=config, init_method=_zero_init)
        self.input_norm = RMSNorm(h, eps, dt)
        self.linear_qkv = ColumnParallelLinear(
            h, (heads + 2 * groups) * dim, bias=qkv_bias, gather_output=False, **common
        )
        if qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads_local, dim, dtype=dt))
            set_tensor_model_parallel_attributes(self.qk_bias, True, 2, 1)
        self.linear_proj = RowLinear(
            heads * dim, h, bias=proj_bias, input_is_parallel=True, skip_bias_add=False, **common
        )
        self.pre_mlp_norm = RMSNorm(h, eps, dt)
        ffn = config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            h, 2 * ffn, bias=False, gather_output=False, **common
        )
        self.linear_fc2 = RowLinear(
            ffn, h, bias=False, input_is_parallel=True, skip_bias_add=False, **common
        )
        if style != "llama":
            self.attn_out_norm = RMSNorm(h, eps, dt)
            self.mlp_out_norm = RMSNorm(h, eps, dt)

    def qkv(self, x: Tensor, rope: Rope, mode: str) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, H_l, D], k / v [B, S, G_l, D] after bias and RoPE."""
        b, s, _ = x.shape
        y = column_linear(self.linear_qkv, self.input_norm(x, mode), mode)
        per = self.heads_local // self.groups_local
        y = y.view(b, s, self.groups_local, per + 2, self.head_dim)
        q = y[:, :, :, :per].reshape(b, s, self.heads_local, self.head_dim)
        k, v = y[:, :, :, per], y[:, :, :, per + 1]
        if hasattr(self, "qk_bias"):  # exact: the gradient summed in fp64 (any token layout)
            q = nx.bias_add(q, self.qk_bias[0, 0], mode)
            k = nx.bias_add(k, self.qk_bias[1, 0], mode)
        return rope(q, mode), rope(k, mode), v

    def mlp(self, x: Tensor, mode: str) -> Tensor:
        gate, up = column_linear(self.linear_fc1, x, mode).chunk(2, dim=-1)
        return row_linear(self.linear_fc2, nx.silu_mul(gate, up, mode), mode)

    def post(self, x: Tensor, attn: Tensor, mode: str) -> Tensor:
        out = row_linear(self.linear_proj, attn, mode)
        if self.style == "huginn":
            x = self.attn_out_norm(out + x, mode)
            return self.mlp_out_norm(self.mlp(self.pre_mlp_norm(x, mode), mode) + x, mode)
        if self.style == "ouro":
            out = self.attn_out_norm(out, mode)
        x = x + out
        out = self.mlp(self.pre_mlp_norm(x, mode), mode)
        if self.style == "ouro":
            out = self.mlp_out_norm(out, mode)
        return x + out

    def forward(
        self,
        x: Tensor,
        rope: Rope,
        mask: Any,
        mode: str,
        prev_kv: tuple[Tensor, Tensor] | None = None,
        active: Tensor | None = None,
        frozen: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(x out, k, v). With `prev_kv` and `active` ([B, S] bool), inactive positions attend
        with (and return) their previous K/V: the last-exited rule. `frozen` ([B, S] bool):
        positions whose computation here carries no gradient (truncated depth backprop):
        their K/V are detached before attention and their output is detached (values equal).

        Depth batching (`rows`, [M] int64 with `prev_kv` [B, S, G_l, D]): x [1, M, h] holds
        only the active positions, at these flat indices of the [B, S] layout (rope's table
        and `frozen`, [1, M], likewise); their projections and MLP run on M rows, their K/V
        are written into `prev_kv`'s at those indices (the others keep theirs: the
        last-exited rule) and their queries attend the whole [B, S] layout, the rest's
        queries zero (their outputs are never read). Returns x [1, M, h] and the [B, S] K/V."""
        if rows is not None:
            return self._rows(x, rope, mask, mode, prev_kv, frozen, rows)
        q, k, v = self.qkv(x, rope, mode)
        if prev_kv is not None:
            assert active is not None
            keep = active[:, :, None, None]
            k = torch.where(keep, k, prev_kv[0])
            v = torch.where(keep, v, prev_kv[1])
        if frozen is not None:
            f4 = frozen[:, :, None, None]
            k, v = torch.where(f4, k.detach(), k), torch.where(f4, v.detach(), v)
        out = self.post(x, core_attention(q, k, v, mask, mode), mode)
        if frozen is not None:
            out = torch.where(frozen[:, :, None], out.detach(), out)
        return out, k, v

    def _rows(self, x: Tensor, rope: Rope, mask: Any, mode: str,
              prev_kv: tuple[Tensor, Tensor] | None, frozen: Tensor | None,
              rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """`forward` of the active rows only (its docstring)."""
        assert prev_kv is not None, "depth batching needs the [B, S] K/V the rows write into"
        q, k, v = self.qkv(x, rope, mode)
        if frozen is not None:
            f4 = frozen[:, :, None, None]
            k, v = torch.where(f4, k.detach(), k), torch.where(f4, v.detach(), v)
        b, s = prev_kv[0].shape[:2]
        k, v = _put_rows(prev_kv[0], rows, k), _put_rows(prev_kv[1], rows, v)
        queries = _put_rows(q.new_zeros(b, s, *q.shape[2:]), rows, q)
        attn = core_attention(queries, k, v, mask, mode)
        attn = attn.reshape(b * s, -1).index_select(0, rows)[None]
        out = self.post(x, attn, mode)
        if frozen is not None:
            out = torch.where(frozen[:, :, None], out.detach(), out)
        return out, k, v

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """TP-sharded linears (SwiGLU fc1 split into gate / up), qk_bias sharded on heads."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        out: dict[str, Any] = {}
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out.update(
            make_sharded_tensors_for_checkpoint(
                own,
                prefix,
                {"qk_bias": 2},
                sharded_offsets,
                tp_group=tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )
        )
        for name, module in self.named_children():
            sub = sharded_state_dict_default(
                module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group
            )
            if name == "linear_fc1":
                key = f"{prefix}{name}.weight"
                sub[key] = apply_swiglu_sharded_factory(sub[key], sharded_offsets)
            out.update(sub)
        return out


class _ExactLookup(torch.autograd.Function):
    """The embedding lookup of exact numerics on CUDA (one tensor-parallel rank): F.embedding's
    CUDA backward sums a token's rows in segments of its sorted index, so the bits of a
    token's gradient depend on where else it occurs in the layout (padded vs packed rows:
    tests/learner/test_packed_rows.py on the H200, model.embed_tokens 1 ulp apart); here they
    are summed in fp64 (index_add_) and rounded once. On the CPU the sum runs in position
    order, the same in every layout and the reference policy's: F.embedding is kept there."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, tokens: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(tokens)
        ctx.rows = weight.shape[0]
        return torch.nn.functional.embedding(tokens, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        (tokens,) = ctx.saved_tensors
        h = grad.shape[-1]
        acc = torch.zeros(ctx.rows, h, dtype=torch.float64, device=grad.device)
        acc.index_add_(0, tokens.reshape(-1), grad.reshape(-1, h).double())
        return acc.to(grad.dtype), None


def exact_embedding(weight: Tensor, tokens: Tensor) -> Tensor:
    """F.embedding(tokens, weight) whose weight gradient is summed in fp64 (`_ExactLookup`)."""
    out: Tensor = _ExactLookup.apply(weight, tokens)
    return out


__all__ = [
    "BLOCK_STYLES",
    "DocMask",
    "LoopedBlock",
    "RMSNorm",
    "Rope",
    "RowLinear",
    "column_linear",
    "core_attention",
    "doc_mask",
    "exact_embedding",
    "replicated_linear",
    "row_linear",
]
