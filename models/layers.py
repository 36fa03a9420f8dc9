"""Transformer blocks shared by the families, split at the attention for the looped engine.

A block exposes `qkv(x, rope, mode) -> (q, k, v)` (norm, projections, bias, RoPE) and
`post(x, attn, mode) -> x` (output projection, residuals, norms, MLP); the engine does the
attention in between against its per-(iteration, layer) KV cache. Rows are flattened tokens:
x [N, h], q [N, H, D], k / v [N, G, D], attn [N, H * D]. Parameter names are the official
checkpoint names. Every matmul goes through `models.numerics.linear` (`linears` for projections of one input:
one fp64 promotion, so their input gradients round once, as a fused linear's do).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models import numerics as nx


class RMSNorm(nn.Module):
    """RMSNorm with a `weight` parameter (see `models.numerics.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, mode: str = "fast") -> Tensor:
        return nx.rms_norm(x, self.weight, self.eps, mode)


def _lin(module: nn.Linear, x: Tensor, mode: str) -> Tensor:
    return nx.linear(x, module.weight, module.bias, mode)


class HuginnAttention(nn.Module):
    """Huginn `CausalSelfAttention`: fused Wqkv, optional qk_bias, proj; adjacent-pair RoPE."""

    def __init__(self, hidden: int, heads: int, qk_bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        if qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, heads, self.head_dim))
        self.proj = nn.Linear(hidden, hidden, bias=False)


class GatedMLP(nn.Module):
    """Huginn `GatedMLP`: fc -> chunk(2) = (gate, up) -> silu(gate) * up -> proj."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 2 * inner, bias=False)
        self.proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor, mode: str) -> Tensor:
        gate, up = _lin(self.fc, x, mode).chunk(2, dim=-1)
        return _lin(self.proj, nx.silu_mul(gate, up, mode), mode)


class SandwichBlock(nn.Module):
    """Huginn block: x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x).

    q/k bias is added to q, k before RoPE; RoPE rotates adjacent pairs with the model's
    persistent fp32 `freqs_cis` table (`rope` = its rows at the tokens' positions, [N, D/2, 2]).
    """

    def __init__(self, hidden: int, heads: int, inner: int, eps: float, qk_bias: bool) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(hidden, eps)
        self.attn = HuginnAttention(hidden, heads, qk_bias)
        self.norm_2 = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, inner)
        self.norm_3 = RMSNorm(hidden, eps)
        self.norm_4 = RMSNorm(hidden, eps)
        self.n_heads = self.n_kv_heads = heads
        self.head_dim = hidden // heads

    def qkv(self, x: Tensor, rope: Tensor, mode: str) -> tuple[Tensor, Tensor, Tensor]:
        h = self.norm_1(x, mode)
        q, k, v = _lin(self.attn.Wqkv, h, mode).view(x.shape[0], 3, self.n_heads, -1).unbind(1)
        if hasattr(self.attn, "qk_bias"):  # one add each: the bias gradients then reduce as
            q = nx.bias_add(q, self.attn.qk_bias[0, 0], mode)  # the learner's (megatron) do,
            k = nx.bias_add(k, self.attn.qk_bias[1, 0], mode)  # bit for bit (fp64 in exact)
        cs = rope[:, None]  # [N, 1, D/2, 2]
        return nx.rope_adjacent(q, cs, mode), nx.rope_adjacent(k, cs, mode), v

    def post(self, x: Tensor, attn: Tensor, mode: str) -> Tensor:
        x = self.norm_2(_lin(self.attn.proj, attn, mode) + x, mode)
        return self.norm_4(self.mlp(self.norm_3(x, mode), mode) + x, mode)


class LlamaAttention(nn.Module):
    """q_proj / k_proj / v_proj / o_proj (HF Llama / Qwen2 / Ouro names)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor, mode: str) -> Tensor:
        gate, up = nx.linears(x, [(m.weight, m.bias) for m in (self.gate_proj, self.up_proj)], mode)
        return _lin(self.down_proj, nx.silu_mul(gate, up, mode), mode)


class LlamaBlock(nn.Module):
    """Pre-norm Llama layer, or Ouro's sandwich variant (`sandwich=True`).

    Llama: x = x + o(attn(n_in(x))); x = x + mlp(n_post(x)).
    Ouro:  x = x + n_in2(o(attn(n_in(x)))); x = x + n_post2(mlp(n_post(x)))
           (n_in = input_layernorm, n_in2 = input_layernorm_2, n_post = post_attention_layernorm,
           n_post2 = post_attention_layernorm_2). RoPE is split-half (`rope` = [N, 2, D]).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inner: int,
        eps: float,
        *,
        bias: bool = False,
        sandwich: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden, heads, kv_heads, head_dim, bias)
        self.mlp = LlamaMLP(hidden, inner)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.sandwich = sandwich
        if sandwich:
            self.input_layernorm_2 = RMSNorm(hidden, eps)
            self.post_attention_layernorm_2 = RMSNorm(hidden, eps)
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, head_dim

    def qkv(self, x: Tensor, rope: Tensor, mode: str) -> tuple[Tensor, Tensor, Tensor]:
        h = self.input_layernorm(x, mode)
        a = self.self_attn
        n = x.shape[0]
        q, k, v = nx.linears(h, [(m.weight, m.bias) for m in (a.q_proj, a.k_proj, a.v_proj)], mode)
        q = q.view(n, self.n_heads, self.head_dim)
        k, v = k.view(n, self.n_kv_heads, self.head_dim), v.view(n, self.n_kv_heads, self.head_dim)
        return nx.rope_half(q, rope, mode), nx.rope_half(k, rope, mode), v

    def post(self, x: Tensor, attn: Tensor, mode: str) -> Tensor:
        out = _lin(self.self_attn.o_proj, attn, mode)
        if self.sandwich:
            out = self.input_layernorm_2(out, mode)
        x = x + out
        out = self.mlp(self.post_attention_layernorm(x, mode), mode)
        if self.sandwich:
            out = self.post_attention_layernorm_2(out, mode)
        return x + out


Block = SandwichBlock | LlamaBlock

__all__ = ["Block", "GatedMLP", "LlamaBlock", "LlamaMLP", "RMSNorm", "SandwichBlock"]
