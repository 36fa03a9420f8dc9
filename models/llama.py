"""Plain Llama (model_type llama): the depth-1 case of the looped engine.

One pass of the layer stack, then `model.norm`, then `lm_head`: exactly HF `LlamaForCausalLM`
(pre-norm RMSNorm, GQA, SwiGLU, split-half RoPE with the `default` rope type). It is the
Nanbeige module with one loop.
"""

from __future__ import annotations

from models.config import LlamaConfig
from models.nanbeige import LoopedLlamaLM


class LlamaForCausalLM(LoopedLlamaLM):
    """Llama reference module (HF parameter names)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)


__all__ = ["LlamaForCausalLM"]
