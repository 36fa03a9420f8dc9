"""Typed, frozen configs of the looped model families, read from and written to HF config.json.

Every family config is a frozen dataclass whose field names are the official config.json keys.
`from_hf_dict` is strict: a key that is neither a field nor a harmless HF bookkeeping key (see
`HF_BOOKKEEPING_KEYS`), a missing required key, a value of the wrong type, or a setting this
package does not implement raises `ConfigError` naming the field and what is expected.
Bookkeeping keys are kept (in `hf_extra`) and written back by `to_hf_dict`.

Families (`.family`) and their `model_type` / vLLM architecture:

| family   | model_type        | architecture               | depth (`.max_depth`)     |
|----------|-------------------|----------------------------|--------------------------|
| huginn   | huginn_raven      | RavenForCausalLM           | mean_recurrence          |
| ouro     | ouro              | OuroForCausalLM            | total_ut_steps           |
| nanbeige | nanbeige_looped   | NanbeigeLoopedForCausalLM  | num_loops                |
| llama    | llama             | LlamaForCausalLM           | 1                        |

Sources: Huginn = seal-rg/recurrent-pretraining `raven_config_minimal.py` (derived keys
`effective_expected_depth`, `head_dim`, `init_values`, `num_key_value_heads`,
`num_attention_heads` are accepted when consistent and written back); Ouro = ByteDance
`configuration_ouro.py` (Qwen2-like keys + `total_ut_steps`, `early_exit_threshold`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from models.errors import ConfigError
from models.hf_config import HFConfig


@dataclasses.dataclass(frozen=True)
class HuginnConfig(HFConfig):
    """Huginn-0125 (`RavenForCausalLM`): prelude, core block looped, coda; sandwich norms."""

    model_type: ClassVar[str] = "huginn_raven"
    architecture: ClassVar[str] = "RavenForCausalLM"
    family_name: ClassVar[str] = "huginn"
    derived_keys: ClassVar[frozenset[str]] = frozenset(
        {
            "effective_expected_depth",
            "head_dim",
            "init_values",
            "num_key_value_heads",
            "num_attention_heads",
            "tie_word_embeddings",
        }
    )

    n_embd: int
    """Hidden size h."""
    n_heads: int
    """Attention heads (= key/value heads: Huginn has no GQA)."""
    n_layers: int
    """Total blocks: prelude + core + coda."""
    n_layers_in_prelude: int
    """Blocks run once before the recurrence."""
    n_layers_in_recurrent_block: int
    """Blocks of the core, run once per core iteration."""
    n_layers_in_coda: int
    """Blocks run once after the recurrence."""
    mean_recurrence: int
    """Core iterations of a full-depth token (the model's max_depth here)."""
    vocab_size: int
    """Vocabulary size (embedding rows)."""
    intermediate_size: int
    """GatedMLP inner width (fc has 2 * intermediate_size outputs)."""
    block_size: int
    """Rows of the persistent RoPE table `freqs_cis` (max positions)."""
    rope_base: float
    """RoPE theta."""
    norm_eps: float
    """RMSNorm epsilon."""
    qk_bias: bool
    """Learned q/k bias `attn.qk_bias` [2, 1, heads, head_dim], added before RoPE."""
    tie_embeddings: bool
    """lm_head.weight is transformer.wte.weight."""
    padded_vocab_size: int | None = None
    """Rows of wte / lm_head; null = vocab_size (the official config sets them equal)."""
    bias: bool = False
    """Bias of the adapter Linear(2h -> h)."""
    mean_backprop_depth: int = 8
    """Training-only: iterations with gradient (kept for round trips)."""
    padding_multiple: int = 4096
    """Bookkeeping of the official config."""
    architecture_class_name: str = "RecurrentGPT"
    """Bookkeeping of the official config."""
    block_class_name: str = "SandwichBlock"
    """Must be SandwichBlock."""
    norm_class_name: str = "RMSNorm_llama"
    """Bookkeeping (the norm is RMSNorm)."""
    mlp_class_name: str = "GatedMLP"
    """Must be GatedMLP."""
    nonlin_name: str = "SiLU"
    """Must be SiLU."""
    init_strategy: str = "takase"
    """Training-only init name."""
    init_orthogonal: bool = False
    """Training-only init flag."""
    state_init: str = "like-init"
    """Must be like-init: truncated normal (std, +-3 std) times embed_scale."""
    injection_type: str = "linear"
    """Must be linear: adapter(cat[state, prelude output])."""
    sampling_scheme: str = "poisson-lognormal-filling"
    """Training-only depth sampler."""
    activation_checkpoint_impl: str = "per-iteration"
    """Training-only."""
    test_time_noise: float = 0.0
    """Must be 0: noise injection between iterations is not supported."""
    test_time_noise_type: str = "fixed"
    """Ignored (test_time_noise is 0)."""
    hf_extra: tuple = ()
    """HF bookkeeping keys kept verbatim, as sorted (key, value) pairs."""

    def __post_init__(self) -> None:
        self._positive("n_embd", "n_heads", "n_layers_in_recurrent_block", "mean_recurrence")
        self._positive("vocab_size", "intermediate_size", "block_size", "rope_base", "norm_eps")
        for name in ("n_layers_in_prelude", "n_layers_in_coda"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config field {name!r} must be >= 0")
        if self.n_embd % self.n_heads or (self.n_embd // self.n_heads) % 2:
            raise ConfigError(
                f"config field 'n_embd' ({self.n_embd}) must be n_heads ({self.n_heads}) times "
                "an even head_dim"
            )
        total = self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda
        if self.n_layers != total:
            raise ConfigError(
                f"config field 'n_layers' must be prelude + core + coda = {total}, "
                f"got {self.n_layers}"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError("config field 'padded_vocab_size' must be >= vocab_size")
        self._require("block_class_name", ("SandwichBlock",))
        self._require("mlp_class_name", ("GatedMLP",))
        self._require("nonlin_name", ("SiLU",))
        self._require("state_init", ("like-init",))
        self._require("injection_type", ("linear",))
        self._require("test_time_noise", (0.0,))

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.n_heads

    @property
    def max_depth(self) -> int:
        return self.mean_recurrence

    @property
    def rows(self) -> int:
        """Embedding / head rows (padded vocab)."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def effective_expected_depth(self) -> int:
        return (
            self.n_layers_in_prelude
            + self.n_layers_in_coda
            + self.n_layers_in_recurrent_block * self.mean_recurrence
        )

    @property
    def init_std(self) -> float:
        """Official init_values['std'] = sqrt(2 / (5 h)); also the latent-state std."""
        return math.sqrt(2 / (5 * self.n_embd))

    @property
    def embed_scale(self) -> float:
        """Official init_values['embed_scale'] = sqrt(h)."""
        return math.sqrt(self.n_embd)

    @property
    def init_values(self) -> dict[str, float]:
        std = self.init_std
        return {
            "std": std,
            "out_proj": std / math.sqrt(2 * self.effective_expected_depth),
            "embedding": std,
            "embed_scale": self.embed_scale,
        }

    def _derived(self) -> dict[str, Any]:
        return {
            "effective_expected_depth": self.effective_expected_depth,
            "head_dim": self.head_dim,
            "init_values": self.init_values,
            "num_key_value_heads": self.n_heads,
            "num_attention_heads": self.n_heads,
            "tie_word_embeddings": self.tie_embeddings,
        }


@dataclasses.dataclass(frozen=True)
class LlamaConfig(HFConfig):
    """Llama decoder (depth 1): pre-norm RMSNorm, GQA, SwiGLU, split-half RoPE."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    family_name: ClassVar[str] = "llama"

    vocab_size: int
    """Vocabulary size."""
    hidden_size: int
    """Hidden size h."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_hidden_layers: int
    """Layers of the stack."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA: query head j reads kv head j // (heads / kv_heads))."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE theta."""
    max_position_embeddings: int
    """Max positions."""
    head_dim: int = 0
    """Per-head width; 0 / missing = hidden_size // num_attention_heads."""
    hidden_act: str = "silu"
    """Must be silu."""
    tie_word_embeddings: bool = False
    """lm_head.weight is model.embed_tokens.weight."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections."""
    mlp_bias: bool = False
    """Must be false."""
    rope_scaling: None = None
    """Must be null (no RoPE scaling implemented)."""
    hf_extra: tuple = ()
    """HF bookkeeping keys kept verbatim, as sorted (key, value) pairs."""

    @classmethod
    def _from_parsed(cls, kwargs: dict[str, Any], extra: tuple) -> Any:
        if kwargs.get("head_dim", 0) == 0 and "hidden_size" in kwargs:
            heads = kwargs.get("num_attention_heads") or 1
            kwargs["head_dim"] = kwargs["hidden_size"] // heads
        return cls(**kwargs, hf_extra=extra)

    def __post_init__(self) -> None:
        self._positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        self._positive("num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta")
        self._positive("max_position_embeddings")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even and > 0, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config field 'num_key_value_heads' must divide num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}"
            )
        self._require("hidden_act", ("silu",))
        self._require("mlp_bias", (False,))
        self._require("rope_scaling", (None,))

    @property
    def max_depth(self) -> int:
        return 1

    @property
    def rows(self) -> int:
        return self.vocab_size


@dataclasses.dataclass(frozen=True)
class NanbeigeConfig(LlamaConfig):
    """Nanbeige4.2-style: the whole Llama stack looped `num_loops` times, `model.norm` after
    every loop (the normed output feeds the next loop), untied head by default."""

    model_type: ClassVar[str] = "nanbeige_looped"
    architecture: ClassVar[str] = "NanbeigeLoopedForCausalLM"
    family_name: ClassVar[str] = "nanbeige"

    num_loops: int = 0
    """Loops of the whole stack (required)."""

    @classmethod
    def _from_parsed(cls, kwargs: dict[str, Any], extra: tuple) -> Any:
        if "num_loops" not in kwargs:
            raise ConfigError("config field 'num_loops' is missing (expected an integer)")
        return super()._from_parsed(kwargs, extra)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._positive("num_loops")

    @property
    def max_depth(self) -> int:
        return self.num_loops


@dataclasses.dataclass(frozen=True)
class OuroConfig(LlamaConfig):
    """Ouro LoopLM: Llama-like stack with sandwich norms looped `total_ut_steps` times,
    `model.norm` after every step, early-exit gate sigmoid(Linear(h -> 1))."""

    model_type: ClassVar[str] = "ouro"
    architecture: ClassVar[str] = "OuroForCausalLM"
    family_name: ClassVar[str] = "ouro"

    total_ut_steps: int = 4
    """Loops of the whole stack (the model's max_depth)."""
    early_exit_threshold: float | None = None
    """The official code's default q of the exit gate (exit when the cumulative exit
    probability >= q); kept for round trips: looprl's exit is the generator's exit policy."""
    early_exit_step: int | None = None
    """The official code's forced exit step (0-based UT step, null: none); kept for round
    trips: looprl's exit is the generator's exit policy (FixedDepth(early_exit_step + 1))."""
    use_sliding_window: bool = False
    """Must be false."""
    sliding_window: int | None = None
    """Ignored (use_sliding_window is false)."""
    max_window_layers: int = 0
    """Ignored (use_sliding_window is false)."""
    layer_types: tuple[str, ...] = ()
    """Each 'full_attention' (empty = all full attention)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._positive("total_ut_steps")
        self._require("use_sliding_window", (False,))
        if any(t != "full_attention" for t in self.layer_types):
            raise ConfigError("config field 'layer_types' must list only 'full_attention'")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError("config field 'layer_types' must have num_hidden_layers entries")
        object.__setattr__(self, "layer_types", ())  # canonical: all full attention
        q = self.early_exit_threshold
        if q is not None and not 0.0 < q <= 1.0:
            raise ConfigError(f"config field 'early_exit_threshold' must be in (0, 1], got {q}")
        e = self.early_exit_step
        if e is not None and not 0 <= e < self.total_ut_steps:
            raise ConfigError(
                f"config field 'early_exit_step' must be null or in [0, total_ut_steps = "
                f"{self.total_ut_steps}), got {e}"
            )

    @property
    def max_depth(self) -> int:
        return self.total_ut_steps

    def to_hf_dict(self) -> dict[str, Any]:
        out = super().to_hf_dict()
        # transformers' generic config loader rejects an empty list: one entry per layer.
        out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        return out


ModelConfig = HuginnConfig | OuroConfig | NanbeigeConfig | LlamaConfig
CONFIG_CLASSES: dict[str, type] = {
    c.model_type: c for c in (HuginnConfig, OuroConfig, NanbeigeConfig, LlamaConfig)
}
_FAMILY_ALIASES = {"huginn": "huginn_raven", "nanbeige": "nanbeige_looped"}


def config_from_hf_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Dispatch on d['model_type'] (ConfigError listing the known types if unknown)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"a model config must be a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt not in CONFIG_CLASSES:
        raise ConfigError(
            f"unknown model_type {mt!r}; known model types: {', '.join(sorted(CONFIG_CLASSES))}"
        )
    return CONFIG_CLASSES[mt].from_hf_dict(d)  # type: ignore[attr-defined,no-any-return]


def tiny_config(family: str) -> ModelConfig:
    """A tiny test model of `family` (a family name or a model_type): hidden 64, 2 heads of
    head_dim 32 (vLLM's CPU attention needs >= 32), vocab 512, max depth 4-6."""
    mt = _FAMILY_ALIASES.get(family, family)
    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    if mt == "huginn_raven":
        return HuginnConfig.from_hf_dict(
            dict(
                model_type=mt,
                n_embd=64,
                n_heads=2,
                n_layers=4,
                n_layers_in_prelude=1,
                n_layers_in_recurrent_block=2,
                n_layers_in_coda=1,
                mean_recurrence=6,
                vocab_size=512,
                padded_vocab_size=512,
                intermediate_size=128,
                block_size=512,
                rope_base=50000.0,
                norm_eps=1e-6,
                qk_bias=True,
                tie_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    if mt == "ouro":
        return OuroConfig.from_hf_dict(dict(common, model_type=mt, total_ut_steps=4))
    if mt == "nanbeige_looped":
        return NanbeigeConfig.from_hf_dict(dict(common, model_type=mt, num_loops=4))
    if mt == "llama":
        return LlamaConfig.from_hf_dict(dict(common, model_type=mt))
    raise ConfigError(f"unknown family {family!r}; known: huginn, ouro, nanbeige, llama")


__all__ = [
    "CONFIG_CLASSES",
    "HuginnConfig",
    "LlamaConfig",
    "ModelConfig",
    "NanbeigeConfig",
    "OuroConfig",
    "config_from_hf_dict",
    "tiny_config",
]
