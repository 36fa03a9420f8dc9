"""vLLM general plugin: registers the looped model classes, their transformers configs and
the model-runner hook.

vLLM calls `register()` in every process that builds an engine or a worker (entry point group
`vllm.general_plugins`, declared in pyproject.toml), possibly several times: it is idempotent.

Architectures (config.json `architectures`, see models/config.py):

| architecture                | family   | vLLM class                                              |
|-----------------------------|----------|---------------------------------------------------------|
| RavenForCausalLM            | huginn   | generator.vllm_plugin.models:RavenForCausalLM           |
| OuroForCausalLM             | ouro     | generator.vllm_plugin.models:OuroForCausalLM            |
| NanbeigeLoopedForCausalLM   | nanbeige | generator.vllm_plugin.models:NanbeigeLoopedForCausalLM  |

LlamaForCausalLM is left to vLLM's own class (the depth-1 case needs no plugin).
"""

from __future__ import annotations

ARCHITECTURES: dict[str, str] = {
    "RavenForCausalLM": "generator.vllm_plugin.models:RavenForCausalLM",
    "OuroForCausalLM": "generator.vllm_plugin.models:OuroForCausalLM",
    "NanbeigeLoopedForCausalLM": "generator.vllm_plugin.models:NanbeigeLoopedForCausalLM",
}
"""Architecture name -> lazily imported vLLM model class."""

_registered = False


def register() -> None:
    """Register the looped architectures with vLLM and install the model-runner hook."""
    from vllm import ModelRegistry

    from generator.vllm_plugin.context import install_runner_hook
    from generator.vllm_plugin.hf_config import register_hf_configs

    global _registered
    if not _registered:
        for arch, target in ARCHITECTURES.items():
            ModelRegistry.register_model(arch, target)
        _registered = True
    register_hf_configs()
    install_runner_hook()


__all__ = ["ARCHITECTURES", "register"]
