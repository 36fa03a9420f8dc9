"""The interface `learner.step.LearnerStep` trains through: `Policy` (what a backend gives the
step: learner.trainer's megatron policy, learner.torch_policy's PyTorch one), the `Net` it
updates and the `DataParallel` place of this rank."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from learner.batching import TrainBatch
from learner.step_metrics import all_reduce_

__all__ = ["DataParallel", "Net", "Policy"]


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel ranks (size 1: no collectives)."""

    size: int = 1
    rank: int = 0
    group: Any = None

    @property
    def active(self) -> bool:
        return self.size > 1 and dist.is_initialized()

    def all_reduce_(self, t: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        """In place over the group (a no-op with one rank)."""
        return all_reduce_(t, self.group, op) if self.active else t


class Net(Protocol):
    """One trained network and its optimizer (learner.network.Network, learner.torch_policy.
    TorchNet). Per update: `zero_grad()`, the micro-batches' backward, `update(loss_finite)`."""

    @property
    def module(self) -> nn.Module: ...
    @property
    def skipped_nonfinite(self) -> int: ...

    def zero_grad(self) -> None: ...

    def update(self, loss_finite: bool) -> dict[str, float]:
        """Apply the accumulated gradients unless the loss (this rank's micro-batches) or the
        global gradient norm is not finite; {"grad_norm", "lr", "skipped_nonfinite": 0 or 1}."""
        ...


class Policy(Protocol):
    """What a backend gives the step. Every forward takes a micro-batch already on `device`
    (`TrainBatch` rows, learner.batching's layout) and returns [B, L] tensors, 0 off the
    response. `policy_stats` and `values` are differentiable; the step wraps the pre-update
    passes in no_grad and eval mode itself."""

    @property
    def dp(self) -> DataParallel: ...
    @property
    def policy(self) -> Net: ...
    @property
    def critic(self) -> Net | None: ...
    @property
    def has_reference(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...

    def policy_stats(self, mb: TrainBatch, old: Tensor | None) -> dict[str, Tensor]:
        """{"logp", "entropy"} of the sampled tokens under the policy at the sampling
        temperature / top_p; "rows": the response positions' logits [N, V] when the forward
        has them (flow_dppo needs them); with the proximal logits `old` [N, V]: "kl" and
        "prox_logp" too."""
        ...

    def reference_logp(self, mb: TrainBatch) -> Tensor:
        """Log-probs of the sampled tokens under the frozen reference policy (no grad)."""
        ...

    def values(self, mb: TrainBatch) -> Tensor:
        """The critic's values at every input position (differentiable)."""
        ...

    def reference_loop_logp(self, mb: TrainBatch) -> Tensor:
        """[B, L, K] the reference's per-loop log-probs (objective.loop_weighting not last:
        `policy_stats` then also gives "loop_logp", "loop_entropy" [B, L, K] and, for
        exit_pdf, "loop_gate"; learner.loop_forward)."""
        ...
