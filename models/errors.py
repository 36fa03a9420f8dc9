"""Error types of the models package."""


class ConfigError(ValueError):
    """A model configuration is invalid, incomplete or of an unknown family."""


class CheckpointError(ValueError):
    """A checkpoint on disk, or a state dict, does not match what is expected."""


class NonFiniteWeightsError(ValueError):
    """A weight set holds NaN or inf values: it must never be published (DESIGN invariant)."""
