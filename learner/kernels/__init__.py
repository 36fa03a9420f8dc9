"""Triton kernels of the learner, each checked against the PyTorch code it replaces: Huginn's
latent noise on CUDA, bit-identical to models.noise (`noise.py`), and the fused per-token
log-prob / entropy / KL of learner.vocab_ops.token_stats (`token_stats.py`)."""
