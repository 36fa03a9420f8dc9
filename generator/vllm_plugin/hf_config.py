"""transformers config classes for the looped model types, so vLLM can parse config.json.

transformers 5.x knows none of `huginn_raven`, `ouro`, `nanbeige_looped`; vLLM builds its
`ModelConfig` through `AutoConfig`, so the plugin registers a plain `PretrainedConfig` per type
(every config.json key becomes an attribute). Huginn's keys get aliases for the names vLLM
reads (`hidden_size`, `num_hidden_layers`, `max_position_embeddings`). The looped models
themselves parse config.json strictly with `models.config`, not through these classes.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig


class HuginnRavenHFConfig(PretrainedConfig):
    """config.json of `RavenForCausalLM` (model_type huginn_raven)."""

    model_type = "huginn_raven"
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "block_size",
    }


class OuroHFConfig(PretrainedConfig):
    """config.json of `OuroForCausalLM` (model_type ouro)."""

    model_type = "ouro"


class NanbeigeLoopedHFConfig(PretrainedConfig):
    """config.json of `NanbeigeLoopedForCausalLM` (model_type nanbeige_looped)."""

    model_type = "nanbeige_looped"


HF_CONFIGS: tuple[type[PretrainedConfig], ...] = (
    HuginnRavenHFConfig,
    OuroHFConfig,
    NanbeigeLoopedHFConfig,
)


def register_hf_configs() -> None:
    """Register the classes with `AutoConfig` (idempotent; an existing registration of the
    same model type, e.g. a future transformers release, is kept)."""
    for cls in HF_CONFIGS:
        try:
            AutoConfig.register(cls.model_type, cls)
        except ValueError:
            pass  # already registered


__all__ = ["HF_CONFIGS", "register_hf_configs"]
