"""Error types of the models package."""


class ConfigError(ValueError):
    """A configuration is invalid: a model's config.json, a run config, a generator config or
    a command-line setting; the message names the key and what is expected. The one
    ConfigError of the project: every config loader raises it (models.settings, learner.config,
    generator.config, pipeline.config)."""


class CheckpointError(ValueError):
    """A checkpoint on disk, or a state dict, does not match what is expected."""


class NonFiniteWeightsError(ValueError):
    """A weight set holds NaN or inf values: it must never be published (docs/CONTRACTS.md,
    invariants).
    ``name`` is the first such tensor (sorted by name), ``count`` its number of non-finite
    elements, ``numel`` its size; ``where`` says which weight set (may be empty)."""

    def __init__(self, name: str, count: int, numel: int, where: str = "") -> None:
        self.name, self.count, self.numel = name, count, numel
        super().__init__(
            f"{where + ': ' if where else ''}refusing to publish non-finite weights: tensor "
            f"{name!r} has {count} non-finite (NaN/inf) elements of {numel}"
        )
