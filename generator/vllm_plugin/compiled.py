"""The FixedDepth decode core of a looped model, compiled by vLLM (`enforce_eager=False`).

`FixedDepthCore` is a pure tensor function of (input_ids, positions, noise): embed, prelude,
s_0, D core iterations without exits, readout. vLLM's `@support_torch_compile` traces it once
(CPU: `DYNAMO_TRACE_ONCE`, inductor); the model's forward (layout, noise, records) stays
eager and calls it when every token of the step runs all D iterations. RMSNorm is opaque to
inductor (`models.numerics.rms_norm` under compilation), so the compiled core computes the
eager bits (benchmarks/compile_numerics.py).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "noise": 0})
class FixedDepthCore(nn.Module):
    """Calls `owner._fixed_core` (the owner is not registered as a submodule)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", owner: Any = None) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)

    def forward(self, input_ids: Tensor, positions: Tensor, noise: Tensor | None) -> Tensor:
        owner: Any = self._owner
        return owner._fixed_core(input_ids, positions, noise)  # type: ignore[no-any-return]


__all__ = ["FixedDepthCore"]
