"""Nanbeige4.2-style whole-stack looped model (model_type nanbeige_looped), and the shared
Llama-style container the Ouro and Llama modules reuse.

No public modeling file was in reach; the semantics are the brief's: Llama pre-norm layers
(RMSNorm, GQA, SwiGLU, split-half RoPE), the whole layer stack looped `num_loops` times,
`model.norm` applied after every loop with the normed output feeding the next loop, an untied
`lm_head` by default (tie_word_embeddings ties it). No latent noise: s_0 = the embedding.
The readout of a state is lm_head(s) (s is already normed).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from models import numerics as nx
from models.base import LoopedLM
from models.config import LlamaConfig, NanbeigeConfig
from models.layers import Block, LlamaBlock, RMSNorm


class LlamaLikeModel(nn.Module):
    """`model.*`: embed_tokens, layers, norm (the HF Llama names)."""

    def __init__(self, config: LlamaConfig, *, sandwich: bool = False) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            LlamaBlock(
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.intermediate_size,
                c.rms_norm_eps,
                bias=c.attention_bias,
                sandwich=sandwich,
            )
            for _ in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LoopedLlamaLM(LoopedLM):
    """Whole-stack looped Llama: s_d = norm(layers(s_{d-1})), s_0 = embed(token)."""

    sandwich = False

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaLikeModel(config, sandwich=self.sandwich)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def core_blocks(self) -> Sequence[Block]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def embed(self, tokens: Tensor) -> Tensor:
        return self.model.embed_tokens(tokens).float()

    def rope(self, positions: Tensor, mode: str) -> Tensor:
        return nx.rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, mode)  # type: ignore[attr-defined]

    def core_out(self, x: Tensor, mode: str) -> Tensor:
        return self.model.norm(x, mode)  # type: ignore[no-any-return]

    def head(self, hidden: Tensor, mode: str) -> Tensor:
        return nx.linear(hidden, self.lm_head.weight, None, mode).float()


class NanbeigeLoopedForCausalLM(LoopedLlamaLM):
    """Nanbeige looped reference module (HF Llama parameter names)."""

    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__(config)


__all__ = ["LlamaLikeModel", "LoopedLlamaLM", "NanbeigeLoopedForCausalLM"]
