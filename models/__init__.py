"""looprl models package: looped LM configs, exit policies, latent noise, the reference engine.

Where each part lives (see docs/MODELS.md for the semantics):

- configs: `models.config` (`HuginnConfig`, `OuroConfig`, `NanbeigeConfig`, `LlamaConfig`,
  `config_from_hf_dict`, `tiny_config`);
- numerics: `models.numerics` (`NumericsMode`: 'fast' | 'exact');
- latent noise: `models.noise` (`derive_latent_seed`, `latent_noise`);
- exits: `models.exits` (`FixedDepth`, `LatentDiff`, `KL`, `EntropyDiff`, `OuroGate`,
  `SampledGate`, `should_exit`);
- reference engine: `models.reference` (`build_model`, `generate`, `replay`, `SamplingParams`,
  `Generation`, `ReplayItem`, `ReplayResult`, `behaviour_logprobs`) over `models.engine`;
- errors: `models.errors` (`ConfigError`, `CheckpointError`).
"""
