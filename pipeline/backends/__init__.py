"""Trainer backends behind the coordinator's Trainer protocol: megatron (learner.trainer), the pure-PyTorch reference, several ranks."""
