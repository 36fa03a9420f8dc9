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


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_rope_adjacent_is_the_formula_bit_for_bit(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    table = precompute_freqs_cis(32, 4096, 50000.0)
    for scale in (1e-6, 1e-2, 1.0, 1e3, 1e6):
        x = torch.randn(257, 2, 3, 32, generator=gen) * scale
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])  # signed zeros
        cs = table[0, torch.randint(0, 4096, (257,), generator=gen), 0][:, None, None]
        want = _rope_adjacent_formula(x, cs, mode)
        got = nx.rope_adjacent(x, cs, mode)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


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
