"""The reference backend's critic and optimizers, built as the megatron backend builds them.

The critic is its own network (learner.mcore_model.build_critic's counterpart): a copy of the
starting checkpoint's trunk with a zero-initialised value head Linear(hidden -> 1) in place of
the LM head, trained by its own optimizer (``optimizer.critic_lr``, its own gradient clip)
after each policy update, on the same mini-batch, with the value loss x ``value_coef``. Its
values are read at the positions that sampled each response token, with the rollout's latent
seed and exit depths, as the policy's log-probs are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from learner.config import ObjectiveConfig, OptimConfig, ScheduleConfig


def make_optimizer(params: Iterable[Any], p: OptimConfig) -> torch.optim.Optimizer:
    """torch's counterpart of megatron's optimizer for ``p``: AdamW, or SGD with momentum
    and L2 weight decay."""
    if p.name == "sgd":
        return torch.optim.SGD(params, lr=p.lr, momentum=p.sgd_momentum,
                               weight_decay=p.weight_decay)  # fmt: skip
    return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps,
                             weight_decay=p.weight_decay)  # fmt: skip


def clip_and_step(
    optim: torch.optim.Optimizer, loss_finite: bool, grad_clip: float, schedule: ScheduleConfig,
    n: int, *, exact: bool = False,
) -> tuple[float, bool]:  # fmt: skip
    """Clip the gradients (accumulated over the micro-batches, by their global norm; 0: no
    clip) and apply update ``n`` at the schedule's LR, unless a micro-batch's loss
    (``loss_finite`` False) or the norm is not finite (then nothing changes, as on
    megatron's found-inf). ``exact`` (numerics exact): the norm and the clip factor as the
    megatron backend computes them there (learner.network.exact_l2_norm). Returns (grad norm,
    applied)."""
    params = [p for g in optim.param_groups for p in g["params"]]
    if exact:
        from learner.network import exact_clip_coeff, exact_l2_norm

        grads = [p.grad for p in params if p.grad is not None]
        n32 = exact_l2_norm(grads)
        norm = float((n32**2.0).item()) ** 0.5  # the norm megatron reports
        coeff = exact_clip_coeff(n32, grad_clip) if grad_clip > 0 else 1.0
        if coeff < 1.0 and math.isfinite(norm):
            for g in grads:
                g.copy_(g * coeff)
    else:
        clip = grad_clip if grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    ok = loss_finite and math.isfinite(norm)
    if ok:
        for g in optim.param_groups:
            g["lr"] = schedule.lr_at(g.setdefault("peak_lr", g["lr"]), n)
        optim.step()
    optim.zero_grad(set_to_none=True)
    return norm, ok


class ReferenceCritic:
    """See the module docstring. ``forward(rolls, model)`` is the trainer's forward: (log-probs,
    hidden [B, T, H], mask) of the response positions."""

    def __init__(self, model_dir: Path, optim: OptimConfig, schedule: ScheduleConfig,
                 objective: ObjectiveConfig, *, exact: bool = False) -> None:  # fmt: skip
        from models.base import LoopedLM
        from models.checkpoint import load_model

        _, model = load_model(model_dir)
        assert isinstance(model, LoopedLM)
        self.model: LoopedLM = model
        self.model.train()
        self.head = torch.nn.Linear(self.model.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.opt_cfg = optim.for_critic()
        self.schedule = dataclasses.replace(schedule, min_lr=min(schedule.min_lr, self.opt_cfg.lr))
        self.objective = objective
        self.optim = make_optimizer(
            [{"params": list(self.model.parameters()) + list(self.head.parameters())}],
            self.opt_cfg,
        )
        self.updates, self.exact = 0, exact

    def values(self, forward: Callable[..., Any], rolls: list[Any]) -> Tensor:
        """[B, L] values at every input position of ``rolls`` (differentiable)."""
        from models import numerics as nx

        _, hid = forward(rolls, model=self.model)
        mode = "exact" if self.exact else "fast"  # megatron's value head: numerics.linear too
        out: Tensor = nx.linear(hid, self.head.weight, self.head.bias, mode)[..., 0]
        return out

    def update(self, forward: Callable[..., Any], rolls: list[Any], batch: Any,
               micro: list[tuple[int, int]], norm: float, metrics: Any, n_updates: int
               ) -> None:  # fmt: skip
        """One critic update on a mini-batch (after the policy's), micro-batch by micro-batch
        with gradient accumulation and ``norm`` the update's loss denominator (as learner.
        trainer's critic update); its metrics into the StepMetrics ``metrics``."""
        from learner.objectives import value_loss
        from learner.step_metrics import record_value

        self.optim.zero_grad(set_to_none=True)
        finite = True
        for a, b in micro:
            mb = batch.rows(a, b)
            vb = {"mask": mb.mask, "values": self.values(forward, rolls[a:b]), "normalizer": norm,
                  "old_values": mb.extra["old_values"], "returns": mb.extra["returns"]}  # fmt: skip
            loss, m = value_loss(self.objective, vb)
            (loss * self.objective.value_coef).backward()
            finite = finite and bool(torch.isfinite(loss.detach()))
            record_value(metrics, m, mb.mask, n_updates)
        gn, ok = clip_and_step(self.optim, finite, self.opt_cfg.grad_clip, self.schedule,
                               self.updates + 1, exact=self.exact)  # fmt: skip
        self.updates += 1 if ok else 0
        metrics.add_max("critic_skipped_nonfinite", 0.0 if ok else 1.0)
        metrics.add_mean("critic_grad_norm", gn, 1.0)
        metrics.add_mean("critic_lr", float(self.optim.param_groups[0]["lr"]), 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "head": self.head.state_dict(),
                "optim": self.optim.state_dict(), "updates": self.updates}  # fmt: skip

    def load_state_dict(self, blob: dict[str, Any]) -> None:
        self.model.load_state_dict(blob["model"])
        self.head.load_state_dict(blob["head"])
        self.optim.load_state_dict(blob["optim"])
        self.updates = int(blob["updates"])
