"""Huginn-0125 (`RavenForCausalLM`, model_type huginn_raven): the reference module.

Semantics from seal-rg/recurrent-pretraining `recpre/raven_modeling_minimal.py` and
`raven_config_minimal.py` (read, not copied):

- e = wte(token) * embed_scale, embed_scale = sqrt(n_embd) (fp32 product with the scale
  rounded to fp32); then the prelude blocks (attention, run once per token).
- s_0 = (z * std) * embed_scale, z = `models.noise.latent_noise(latent_seed, position, h)`
  (truncated standard normal, +-3), std = sqrt(2 / (5 n_embd)): the official `initialize_state`
  (`trunc_normal_(std, a=-3 std, b=3 std)` then `* emb_scale`), with the random draw replaced by
  the counter-based latent-noise contract. Two fp32 products, in that order.
- Core iteration: x = adapter(cat[s, e]) (state FIRST, prelude output second; Linear(2h -> h),
  bias = config.bias), then the core blocks; s_d = the last block's output (no norm).
- Readout: ln_f(s_D) -> coda blocks -> ln_f -> lm_head (ln_f used twice, as in `forward` and
  `predict_from_latents`). lm_head is tied to wte when tie_embeddings.
- Blocks are `SandwichBlock`s (models.layers): sandwich norms, fused Wqkv split [q | k | v],
  qk_bias added before RoPE, RoPE on adjacent pairs with the persistent fp32 buffer
  `freqs_cis` [1, block_size, 1, head_dim / 2, 2] (cos, sin), GatedMLP fc -> (gate, up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models import numerics as nx
from models.base import LoopedLM
from models.config import HuginnConfig
from models.layers import Block, RMSNorm, SandwichBlock
from models.noise import latent_noise


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> Tensor:
    """The official fp32 RoPE table [1, end, 1, head_dim / 2, 2] of (cos, sin)."""
    inv_freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, inv_freqs).float()
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)[None, :, None, :, :]


class HuginnForCausalLM(LoopedLM):
    """Huginn reference module; state_dict keys are the official checkpoint names."""

    freqs_cis: Tensor
    config: HuginnConfig

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        h, c = config.n_embd, config

        def block() -> SandwichBlock:
            return SandwichBlock(h, c.n_heads, c.intermediate_size, c.norm_eps, c.qk_bias)

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(c.rows, h),
                prelude=nn.ModuleList(block() for _ in range(c.n_layers_in_prelude)),
                adapter=nn.Linear(2 * h, h, bias=c.bias),
                core_block=nn.ModuleList(block() for _ in range(c.n_layers_in_recurrent_block)),
                coda=nn.ModuleList(block() for _ in range(c.n_layers_in_coda)),
                ln_f=RMSNorm(h, c.norm_eps),
            )
        )
        self.lm_head = nn.Linear(h, c.rows, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self._t("wte").weight
        table = precompute_freqs_cis(c.head_dim, c.block_size, c.rope_base)
        self.register_buffer("freqs_cis", table, persistent=True)

    def _t(self, name: str) -> Any:
        """transformer[name] (untyped ModuleDict access)."""
        return self.transformer[name]

    def prelude_blocks(self) -> Sequence[Block]:
        return list(self._t("prelude"))

    def core_blocks(self) -> Sequence[Block]:
        return list(self._t("core_block"))

    def coda_blocks(self) -> Sequence[Block]:
        return list(self._t("coda"))

    @property
    def kv_shape(self) -> tuple[int, int]:
        return self.config.n_heads, self.config.head_dim

    def embed(self, tokens: Tensor) -> Tensor:
        e = self._t("wte")(tokens).float()
        return e * torch.tensor(self.config.embed_scale, dtype=torch.float32)

    def rope(self, positions: Tensor, mode: str) -> Tensor:
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.freqs_cis.shape[1]:
            raise ValueError(
                f"position {int(positions.max())} is beyond block_size {self.freqs_cis.shape[1]}"
            )
        return self.freqs_cis[0, positions, 0].float()  # [N, D/2, 2]

    draws_latent_noise = True

    def initial_state(
        self, e: Tensor, positions: Tensor, seeds: Sequence[int], noise: Tensor | None = None
    ) -> Tensor:
        if noise is None:
            noise = latent_noise(list(seeds), positions.cpu(), self.config.n_embd)
        z = noise.to(e.device)
        std = torch.tensor(self.config.init_std, dtype=torch.float32)
        scale = torch.tensor(self.config.embed_scale, dtype=torch.float32)
        return (z * std) * scale

    def core_in(self, state: Tensor, e: Tensor, mode: str) -> Tensor:
        a = self._t("adapter")
        return nx.linear(torch.cat([state, e], dim=-1), a.weight, a.bias, mode)

    def readout_in(self, state: Tensor, mode: str) -> Tensor:
        return self._t("ln_f")(state, mode)

    def readout_out(self, x: Tensor, mode: str) -> Tensor:
        return self._t("ln_f")(x, mode)

    def head(self, hidden: Tensor, mode: str) -> Tensor:
        return nx.linear(hidden, self.lm_head.weight, None, mode).float()


__all__ = ["HuginnForCausalLM", "precompute_freqs_cis"]
