"""The error of megatron-core on CPU (learner.megatron.cpu and its RNG tracker,
learner.megatron.rng, raise it)."""


class CpuCompatError(RuntimeError):
    """A patch does not match the installed megatron-core, or a CUDA-only feature was asked for."""
