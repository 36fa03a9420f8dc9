"""The small per-family interface the looped engine (`models.engine.chunk`) runs.

A token's forward pass, for every family:

    e     = embed(token)                               # fp32 [h]
    e     = prelude stack(e)                           # attention layers, run once
    s_0   = initial_state(e, position, latent_seed)
    s_d   = core_out(core stack(core_in(s_{d-1}, e)))  # d = 1 .. exit depth, KV per (d, layer)
    hid   = readout_out(coda stack(readout_in(s_D)))   # coda: attention layers, run once
    logits = head(hid)                                 # fp32 [V]
    gate  = gate_logit(s_d)                            # Ouro only

| family   | prelude | s_0                              | core_in               | core_out | readout_in / out | gate |
|----------|---------|----------------------------------|-----------------------|----------|------------------|------|
| huginn   | prelude | noise * std * embed_scale        | adapter(cat[s, e])    | id       | ln_f / ln_f      | -    |
| ouro     | -       | e                                | s                     | norm     | id / id          | yes  |
| nanbeige | -       | e                                | s                     | norm     | id / id          | -    |
| llama    | -       | e                                | s  (one iteration)    | norm     | id / id          | -    |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.engine.chunk import forward_full
from models.layers import Block, RMSNorm


class LoopedLM(nn.Module):
    """Base class of the family modules (subclasses set the stacks and override the hooks)."""

    config: Any

    @property
    def max_depth(self) -> int:
        return int(self.config.max_depth)  # type: ignore[attr-defined]

    @property
    def vocab_size(self) -> int:
        """Rows of the sampled distribution (logits beyond it, e.g. padding, are dropped)."""
        return int(self.config.vocab_size)  # type: ignore[attr-defined]

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)  # type: ignore[attr-defined]

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(kv heads, head_dim) of every attention layer."""
        return int(self.config.num_key_value_heads), int(self.config.head_dim)  # type: ignore[attr-defined]

    def prelude_blocks(self) -> Sequence[Block]:
        return ()

    def core_blocks(self) -> Sequence[Block]:
        raise NotImplementedError

    def coda_blocks(self) -> Sequence[Block]:
        return ()

    def embed(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def rope(self, positions: Tensor, mode: str) -> Tensor:
        raise NotImplementedError

    draws_latent_noise = False
    """True when `initial_state` draws latent noise (Huginn)."""

    def initial_state(
        self, e: Tensor, positions: Tensor, seeds: Sequence[int], noise: Tensor | None = None
    ) -> Tensor:
        """s_0 of rows [N] (seeds: one latent seed per row; `noise`: the rows'
        `models.noise.latent_noise`, when the caller drew them already)."""
        return e

    def core_in(self, state: Tensor, e: Tensor, mode: str) -> Tensor:
        return state

    def core_out(self, x: Tensor, mode: str) -> Tensor:
        return x

    def readout_in(self, state: Tensor, mode: str) -> Tensor:
        return state

    def readout_out(self, x: Tensor, mode: str) -> Tensor:
        return x

    def head(self, hidden: Tensor, mode: str) -> Tensor:
        raise NotImplementedError

    def gate_logit(self, state: Tensor, mode: str) -> Tensor | None:
        return None

    def forward(
        self,
        input_ids: Tensor,
        latent_seeds: Sequence[int] | None = None,
        depth: int | None = None,
        numerics: str = "fast",
    ) -> Tensor:
        """Logits [B, S, V] of every position at full depth (`depth`, default max_depth)."""
        return forward_full(self, input_ids, latent_seeds, depth=depth, mode=numerics)

    def init_weights(self, seed: int, std: float) -> None:
        """Deterministic init: every parameter, in sorted-name order, gets normal(0, std)
        clamped to +-3 std from torch.Generator(seed); then biases (incl. qk_bias) are zeroed
        and RMSNorm weights set to 1."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
                draw = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
                p.copy_(draw.clamp_(-3 * std, 3 * std))
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)


__all__ = ["LoopedLM"]
