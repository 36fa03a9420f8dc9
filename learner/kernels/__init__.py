"""Triton kernels of the learner, each checked against the PyTorch code it replaces: the fused
per-token log-prob / entropy / KL of learner.vocab_ops.token_stats (`token_stats.py`). (Huginn's
latent noise on CUDA, shared with the torch engine, is models.kernels.noise.)"""
