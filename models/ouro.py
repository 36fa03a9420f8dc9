"""Ouro LoopLM (`OuroForCausalLM`, model_type ouro): the reference module.

Semantics from ByteDance `modeling_ouro.py` (read, not copied):

- s_0 = embed_tokens(token) (no scale, no noise).
- One step = all `num_hidden_layers` decoder layers, then `model.norm`; the normed state feeds
  the next step (`total_ut_steps` steps in all). KV cache slot of (step, layer) =
  step * num_hidden_layers + layer in the official cache; here (iteration, layer).
- Decoder layer (sandwich): x = x + input_layernorm_2(o_proj(attn(input_layernorm(x))));
  x = x + post_attention_layernorm_2(mlp(post_attention_layernorm(x))).
  Attention: q/k/v/o_proj without bias, GQA (repeat_kv), split-half RoPE (HF `default`).
- Exit gate: `model.early_exit_gate` = Linear(h -> 1, bias) on the normed state after each
  step; lambda = sigmoid(logit); exit rule in `models.exits.OuroGate`.
- Readout: lm_head(s) (s already normed).
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from models import numerics as nx
from models.config import OuroConfig
from models.nanbeige import LoopedLlamaLM


class OuroForCausalLM(LoopedLlamaLM):
    """Ouro reference module; state_dict keys are the official checkpoint names."""

    sandwich = True

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.model.early_exit_gate = nn.Linear(config.hidden_size, 1)

    def gate_logit(self, state: Tensor, mode: str) -> Tensor:
        g = cast(nn.Linear, self.model.early_exit_gate)
        return nx.linear(state, g.weight, g.bias, mode)[..., 0]


__all__ = ["OuroForCausalLM"]
