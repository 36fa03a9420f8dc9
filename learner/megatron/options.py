"""How the learner builds a looped model on megatron-core: `MegatronOptions` (the run-level
choices: numerics, dtype, recompute, truncated depth backprop, exit KV semantics, compile) and
megatron's `TransformerConfig` of a family config (`transformer_config`, `padded_rows`)."""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from torch import nn

from models import numerics as nx
from models.config import HuginnConfig, ModelConfig
from models.exits import check_kv

RECOMPUTE = ("none", "block")


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    """How the learner builds a looped model on megatron-core."""

    numerics: str = "fast"
    """Default numerics mode of forward ('fast' | 'exact'; docs/CONTRACTS.md 5)."""
    params_dtype: torch.dtype = torch.float32
    """Parameter (and activation) dtype; exact mode needs float32."""
    recompute: str = "none"
    """Activation recompute: 'none' or 'block' (megatron `tensor_parallel.checkpoint` around
    every block call of every iteration)."""
    init_seed: int = 0
    """Seed of the reference init used when no HF state is given."""
    vocab_multiple: int = 1
    """Embedding / head rows are padded to a multiple of lcm(vocab_multiple, tp); make it a
    multiple of every TP size a dist checkpoint should reshard to (e.g. 128)."""
    backprop_depth: int | None = None
    """Truncated backprop through depth: gradients flow through each token's last k core
    iterations only (earlier ones are constants); None = the family's `mean_backprop_depth`
    (Huginn; others 0), 0 = all iterations. Log-probs are unchanged."""
    compile: bool = False
    """torch.compile every block (fast numerics only)."""
    compact: bool = True
    """Depth batching in the replay forward: at core iteration d only the positions still
    running (valid, not yet exited) go through the core's projections and MLPs, gathered into
    one [1, M, h] batch (attention keeps the [B, S] layout); False runs every position of the
    batch at every iteration and masks. Same values either way (row-wise operations: bit for
    bit in exact numerics); compact saves the core FLOPs of exited positions and padding, as
    the reference backend's and the torch engine's `models.engine.chunk.run_chunk` do."""
    kv: str | None = None
    """KV semantics of exited tokens replayed by forward (docs/CONTRACTS.md 3): 'full' |
    'last_exited'; None = the family's default (`models.exits.default_kv`). The run's exit
    policy names it; it must be the one the rollouts were generated with."""

    def __post_init__(self) -> None:
        nx.check_mode(self.numerics)
        if self.kv is not None:
            check_kv(self.kv)
        if self.backprop_depth is not None and self.backprop_depth < 0:
            raise ValueError(f"backprop_depth must be None or >= 0, got {self.backprop_depth}")
        if self.compile and self.numerics == "exact":
            raise ValueError("compile needs numerics 'fast' (exact keeps its own kernels)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.numerics == "exact" and self.params_dtype != torch.float32:
            raise ValueError("exact numerics needs params_dtype float32")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")


def padded_rows(config: ModelConfig, tp: int, multiple: int = 1) -> int:
    """Embedding / head rows padded up to a multiple of lcm(multiple, tp) (padding logits are
    never read; padding rows are zeros)."""
    m = math.lcm(tp, multiple)
    return -(-config.rows // m) * m


def transformer_config(config: ModelConfig, options: MegatronOptions) -> TransformerConfig:
    """megatron's TransformerConfig for `config` at the current TP size."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if isinstance(config, HuginnConfig):
        layers = config.n_layers
        heads = groups = config.n_heads
        ffn, dim, h = config.intermediate_size, config.head_dim, config.n_embd
    else:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        groups, ffn = config.num_key_value_heads, config.intermediate_size
        dim, h = config.head_dim, config.hidden_size
    if heads % tp or groups % tp:
        raise ValueError(f"tp={tp} must divide heads ({heads}) and key/value heads ({groups})")
    return TransformerConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        ffn_hidden_size=ffn,
        tensor_model_parallel_size=tp,
        params_dtype=options.params_dtype,
        bf16=options.params_dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method=nn.init.zeros_,
        output_layer_init_method=nn.init.zeros_,
    )


__all__ = ["RECOMPUTE", "MegatronOptions", "padded_rows", "transformer_config"]
