"""Faster formulations of `models.numerics` primitives give the bits of their defining formula."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from models import numerics as nx
from models.huginn import precompute_freqs_cis
from models.layers import SandwichBlock


def _rope_adjacent_formula(x: Tensor, cos_sin: Tensor, mode: str) -> Tensor:
    """The docstring's formula, term by term: out[2i] = x0 c - x1 s, out[2i+1] = x1 c + x0 s."""
    dt = torch.float64 if mode == "exact" else torch.float32
    pairs = x.to(dt).unflatten(-1, (-1, 2))
    c, s = cos_sin[..., 0].to(dt), cos_sin[..., 1].to(dt)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    return out.float().to(x.dtype)


@pytest.mark.parametrize("head_dim", [32, 96, 40])  # 40: not the complex-product path
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_rope_adjacent_is_the_formula_bit_for_bit(mode: str, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    table = precompute_freqs_cis(head_dim, 4096, 50000.0)
    for scale in (1e-30, 1e-6, 1e-2, 1.0, 1e3, 1e6, 1e30):
        for rows in (1, 3, 257):
            x = torch.randn(rows, 2, 3, head_dim, generator=gen) * scale
            x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])  # signed zeros
            cs = table[0, torch.randint(0, 4096, (rows,), generator=gen), 0][:, None, None]
            want = _rope_adjacent_formula(x, cs, mode)
            for got in (nx.rope_adjacent(x, cs, mode), nx.rope_adjacent(x[:, :, :2], cs, mode)):
                ref = want if got.shape == want.shape else want[:, :, :2]
                assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_sandwich_qkv_joint_rope_is_per_head_rope(mode: str) -> None:
    """q and k rotated together (one bias add, one RoPE) equal separate rotations bit for bit."""
    torch.manual_seed(1)
    blk = SandwichBlock(64, 2, 128, 1e-6, qk_bias=True)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(19, 64)
    rope = precompute_freqs_cis(32, 512, 50000.0)[0, torch.arange(19) + 40, 0]
    q, k, v = blk.qkv(x, rope, mode)
    h = blk.norm_1(x, mode)
    q0, k0, v0 = nx.linear(h, blk.attn.Wqkv.weight, None, mode).view(19, 3, 2, -1).unbind(1)
    q0, k0 = q0 + blk.attn.qk_bias[0, 0], k0 + blk.attn.qk_bias[1, 0]
    cs = rope[:, None]
    for got, want in ((q, _rope_adjacent_formula(q0, cs, mode)),
                      (k, _rope_adjacent_formula(k0, cs, mode)), (v, v0)):  # fmt: skip
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rms_norm_fast_is_the_formula_bit_for_bit() -> None:
    """fast rms_norm (torch's rms_norm on the CPU in fp32) = the docstring's formula."""
    gen = torch.Generator().manual_seed(2)
    for hidden, scale in ((64, 1.0), (96, 1e-3), (5280, 1e2), (7, 1e-20), (64, 1e20)):
        x = torch.randn(301, hidden, generator=gen) * scale
        w = torch.randn(hidden, generator=gen)
        for eps in (1e-6, 1e-5, 0.0):
            xf = x.float()
            want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
            got = nx.rms_norm(x, w, eps, "fast")
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (hidden, eps)
