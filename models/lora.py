"""A low-rank adapter's merged weight: the one formula every process that applies adapters uses.

For a linear W [out, in] with factors A [r, in], B [out, r] and scale s = alpha / r:

    delta = s * (B A)             in fp64 (`lora_delta`)
    W'    = W + delta             in fp64, rounded once to W's dtype (`merged_weight`)

The learner trains with W' (its forwards read the merged weight), publishes W', and a process
that merges the same tensors gets the same bits, so the exact numerics contract
(docs/CONTRACTS.md 5) holds for adapters as for full weights. B = 0 gives W' = W bit for bit
(W + 0 in fp64 rounds back to W). ``delta`` is an elementwise term: a layout that stores several
adapted weights side by side (a fused projection) merges each of its elements alike.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["lora_delta", "merged_weight"]


def lora_delta(lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """s * (B A) [out, in] in fp64 (differentiable in A and B)."""
    return (lora_b.double() @ lora_a.double()) * scale


def merged_weight(weight: Tensor, delta: Tensor) -> Tensor:
    """W + delta (fp64 ``delta``, `lora_delta`) rounded once to W's dtype."""
    return (weight.double() + delta).to(weight.dtype)
