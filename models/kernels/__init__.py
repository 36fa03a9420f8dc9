"""Triton kernels of the model contract's random numbers on CUDA, each bit-identical to (noise)
or a fast-numerics form of (draw) its PyTorch spec, shared by the learner and the torch engine:
Huginn's latent noise (`noise.py`, models.noise) and a decode step's draw (`draw.py`,
models.sampling)."""
