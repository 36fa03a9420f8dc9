"""looprl models package: looped LM configs, exit policies, latent noise, the reference engine.

The public API (see docs/MODELS.md for the semantics):

- configs: `HuginnConfig`, `OuroConfig`, `NanbeigeConfig`, `LlamaConfig`,
  `config_from_hf_dict`, `tiny_config`;
- numerics: `NumericsMode` ('fast' | 'exact'), module `models.numerics`;
- latent noise: `derive_latent_seed`, `latent_noise`;
- exits: `FixedDepth`, `LatentDiff`, `KL`, `EntropyDiff`, `OuroGate`, `should_exit`;
- reference engine: `build_model`, `generate`, `replay`, `SamplingParams`, `Generation`,
  `ReplayItem`, `ReplayResult`, `behaviour_logprobs`.
"""

from models.config import (
    HuginnConfig,
    LlamaConfig,
    ModelConfig,
    NanbeigeConfig,
    OuroConfig,
    config_from_hf_dict,
    tiny_config,
)
from models.errors import CheckpointError, ConfigError
from models.exits import (
    KL,
    EntropyDiff,
    ExitPolicy,
    FixedDepth,
    LatentDiff,
    OuroGate,
    StepInfo,
    resolve_max_depth,
    should_exit,
)
from models.noise import derive_latent_seed, latent_noise
from models.numerics import NumericsMode
from models.reference import (
    Generation,
    ReplayItem,
    ReplayResult,
    SamplingParams,
    behaviour_logprobs,
    build_model,
    generate,
    replay,
)

__all__ = [
    "KL",
    "CheckpointError",
    "ConfigError",
    "EntropyDiff",
    "ExitPolicy",
    "FixedDepth",
    "Generation",
    "HuginnConfig",
    "LatentDiff",
    "LlamaConfig",
    "ModelConfig",
    "NanbeigeConfig",
    "NumericsMode",
    "OuroConfig",
    "OuroGate",
    "ReplayItem",
    "ReplayResult",
    "SamplingParams",
    "StepInfo",
    "behaviour_logprobs",
    "build_model",
    "config_from_hf_dict",
    "derive_latent_seed",
    "generate",
    "latent_noise",
    "replay",
    "resolve_max_depth",
    "should_exit",
    "tiny_config",
]
