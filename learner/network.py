"""One trained network (module, Megatron DDP, megatron optimizer, LR schedule) and its update.

Order of calls per optimizer update (learner.trainer.Trainer drives it):

    net.zero_grad()
    ... backward of every micro-batch ...
    out = net.update(loss_finite)     # {"grad_norm", "lr", "skipped_nonfinite"}

Invariant: non-finite weights are never produced. `update` reduces the gradients over DP
(`finalize_model_grads`), then asks the megatron optimizer for the global gradient norm
(`prepare_grads` + `get_grad_norm`: the same collective over the grad-stats group that its
clipping uses) and all-reduces one "bad" flag (norm or loss not finite on any rank) over the
whole world, so every TP/DP rank takes the same branch. A bad update is skipped: gradients
zeroed, weights, optimizer state and LR schedule untouched (megatron's found-inf handling does
the same, but only runs with a loss scaler, and its own grad norm arrives after the weights
moved: clipping by a NaN norm is a no-op in `clip_grad_by_total_norm_fp32`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from learner.config import OptimConfig, ScheduleConfig

__all__ = ["Network", "adam_step_tensor", "seed_all", "use_fused_adam"]

log = logging.getLogger(__name__)


class Network:
    """One trained network: module, Megatron DDP wrapper, optimizer, LR scheduler."""

    def __init__(
        self,
        module: nn.Module,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        *,
        exact: bool = False,
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if schedule.min_lr > optim.lr:
            raise ValueError(f"min_lr: expected <= lr ({optim.lr}), got {schedule.min_lr}")
        if schedule.style != "constant" and not schedule.decay_steps:
            raise ValueError("schedule.decay_steps=0: resolve it first (ScheduleConfig.resolved)")
        self.module, self.optim_cfg, self.schedule_cfg = module, optim, schedule
        bf16 = any(p.dtype == torch.bfloat16 for p in module.parameters())
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=optim.distributed, grad_reduce_in_fp32=True
        )
        self.ddp = DistributedDataParallel(module.config, ddp_cfg, module)  # type: ignore[arg-type]
        opt_cfg = OptimizerConfig(
            optimizer=optim.name,
            lr=optim.lr,
            min_lr=schedule.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.beta1,
            adam_beta2=optim.beta2,
            adam_eps=optim.eps,
            sgd_momentum=optim.sgd_momentum,
            clip_grad=optim.grad_clip,
            use_distributed_optimizer=optim.distributed,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        self.opt = get_megatron_optimizer(opt_cfg, [self.ddp])
        self.fused_adam = use_fused_adam(self.opt)
        """torch's fused Adam kernel steps the main weights (CUDA, megatron without TE/Apex)."""
        if self.fused_adam:
            _sync_free_fallbacks()
        # numerics exact: the gradient norm as the reference backend computes it; otherwise
        # megatron's own (a module-level setting: an exact trainer built earlier in the same
        # process must not leave it to a fast one)
        _exact_grad_norm() if exact else _megatron_grad_norm()
        warm = schedule.warmup_steps
        self.sched = OptimizerParamScheduler(
            self.opt,
            init_lr=0.0 if warm else optim.lr,
            max_lr=optim.lr,
            min_lr=schedule.min_lr,
            lr_warmup_steps=warm,
            lr_decay_steps=max(schedule.decay_steps, warm + 1),
            lr_decay_style=schedule.style,
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        self.skipped_nonfinite = 0
        """Updates skipped so far because the loss or the gradients were not finite."""

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def _all_finite(self, loss_finite: bool) -> tuple[bool, float]:
        """(every rank's loss and the global grad norm finite, that norm); a collective."""
        # Copies the grads to the optimizer's main grads; opt.step() repeats it (idempotent: no
        # loss scaler is configured, so nothing is unscaled twice; found_inf stays False).
        found_inf = bool(self.opt.prepare_grads())
        norm = float(self.opt.get_grad_norm() or 0.0)
        bad = found_inf or not loss_finite or not math.isfinite(norm)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = next(self.module.parameters()).device
            flag = torch.tensor([1.0 if bad else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item() > 0)
        return not bad, norm

    def update(self, loss_finite: bool = True) -> dict[str, float]:
        """DP gradient all-reduce, finiteness check (module docstring), next LR, optimizer
        step (clipping inside). `loss_finite`: this rank's micro-batch losses were finite."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        ok, norm = self._all_finite(loss_finite)
        if ok:
            self.sched.step(1)  # the n-th update uses lr(n): ScheduleConfig docstring
            ok, grad_norm, _ = self.opt.step()
            if ok:
                lr = float(self.opt.param_groups[0]["lr"])
                gn = float(grad_norm) if grad_norm is not None else norm
                return {"grad_norm": gn, "lr": lr, "skipped_nonfinite": 0.0}
            self.sched.step(-1)  # megatron's own found-inf skip (loss scaler): undo the LR step
        self.zero_grad()
        self.skipped_nonfinite += 1
        log.warning(
            "non-finite loss or gradients (grad norm %s, loss finite on this rank: %s): update "
            "skipped, weights and optimizer state unchanged (%d skipped so far)",
            norm, loss_finite, self.skipped_nonfinite,
        )  # fmt: skip
        lr = float(self.opt.param_groups[0]["lr"])
        return {"grad_norm": norm, "lr": lr, "skipped_nonfinite": 1.0}


def use_fused_adam(opt: object) -> bool:
    """Switch the torch Adam / AdamW that megatron-core 0.16.1 falls back to without
    Transformer Engine or Apex to torch's fused kernel, when all its parameters (the fp32 main
    weights) are on CUDA; returns whether it did. Megatron builds the fallback with torch's
    default, the multi-tensor (foreach) implementation: about ten passes over the fp32 weights,
    grads and Adam state per step (~80 bytes a parameter) against the fused kernel's one
    (~28 bytes): the same update up to fp32 rounding. CPU runs keep the default."""
    from megatron.core import optimizer as mcore_opt

    if not getattr(mcore_opt, "USING_PYTORCH_OPTIMIZER", False):
        return False  # TE / Apex FusedAdam: already fused
    inner = [getattr(sub, "optimizer", None) for sub in getattr(opt, "chained_optimizers", [opt])]
    adams = [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]
    params = [p for o in adams for g in o.param_groups for p in g["params"]]
    if not params or not all(p.is_cuda and p.dtype == torch.float32 for p in params):
        return False
    for o in adams:
        if any(o.state.get(p) for g in o.param_groups for p in g["params"]):
            return False  # states made for the foreach kernel (CPU steps): leave it as built
        for g in o.param_groups:
            g["fused"], g["foreach"] = True, False
    return True


def adam_step_tensor(value: float, group: dict, param: torch.Tensor) -> torch.Tensor:
    """A torch Adam `step` state as torch's `_init_group` makes it for `group`: a 0-d fp32
    tensor on the parameter's device for the fused kernel, else on the CPU (fp32, or fp64
    under a float64 default dtype)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(value), dtype=torch.float32, device=param.device)
    f64 = torch.get_default_dtype() == torch.float64
    return torch.tensor(float(value), dtype=torch.float64 if f64 else torch.float32)


def exact_l2_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``tensors`` summed in fp64 and rounded to fp32 ([1]): the same bits
    whatever the order of the tensors (numerics exact: both trainer backends clip by it)."""
    if not tensors:
        return torch.zeros(1, dtype=torch.float32)
    total = torch.stack([t.detach().double().square().sum() for t in tensors]).sum()
    return total.sqrt().float().reshape(1).to(tensors[0].device)


def exact_clip_coeff(norm: torch.Tensor, max_norm: float) -> float:
    """megatron's clip factor from an fp32 norm [1] (get_grad_norm_fp32 squares it in fp32,
    takes the square root of the Python float, clip_grad_by_total_norm_fp32 divides): the
    reference backend scales its gradients by the same float when it is < 1."""
    total = float((norm**2.0).item()) ** 0.5
    return max_norm / (total + 1.0e-6)


_MEGATRON_L2: dict[str, Any] = {}  # module name -> megatron's own l2_norm_impl (before ours)


def _exact_l2(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool,
              *args: object) -> tuple[torch.Tensor, None]:  # fmt: skip
    return exact_l2_norm(list(tensor_lists[0])), None


def _exact_grad_norm() -> None:
    """megatron's gradient norm (for clipping and the grad_norm metric) through exact_l2_norm."""
    from megatron.core.optimizer import clip_grads, optimizer

    for mod in (clip_grads, optimizer):
        impl = getattr(mod, "l2_norm_impl", None)
        if impl is not None and impl is not _exact_l2:
            _MEGATRON_L2.setdefault(mod.__name__, impl)
            mod.l2_norm_impl = _exact_l2  # type: ignore[attr-defined]


def _megatron_grad_norm() -> None:
    """Undo `_exact_grad_norm` (fast numerics after an exact trainer in this process)."""
    from megatron.core.optimizer import clip_grads, optimizer

    for mod in (clip_grads, optimizer):
        if getattr(mod, "l2_norm_impl", None) is _exact_l2:
            mod.l2_norm_impl = _MEGATRON_L2[mod.__name__]  # type: ignore[attr-defined]


def _sync_free_fallbacks() -> None:
    """On CUDA, megatron 0.16.1 without Apex computes the gradient norm with
    `local_multi_tensor_l2_norm`, which copies every tensor's norm to the host (one device
    sync per parameter, twice per update: our finiteness check and the clipping), and scales
    with one `copy_(src * scale)` per tensor. Replace both (in `megatron.core.optimizer.
    clip_grads` and `.optimizer`, only where they are megatron's local fallbacks) by
    multi-tensor versions that stay on the device; the norm's one sync stays in megatron."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer

    for mod in (clip_grads, optimizer):
        if getattr(mod, "l2_norm_impl", None) is mcore_utils.local_multi_tensor_l2_norm:
            mod.l2_norm_impl = _l2_norm  # type: ignore[attr-defined]
        if getattr(mod, "multi_tensor_scale_impl", None) is mcore_utils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = _scale  # type: ignore[attr-defined]


def _l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool, *args: object
) -> tuple[torch.Tensor, None]:
    """amp_C.multi_tensor_l2norm's contract (total norm, fp32 [1] on the device), no sync."""
    norm = torch.nn.utils.get_total_norm(tensor_lists[0], 2.0, foreach=True)
    return norm.float().reshape(1), None


def _scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, scale: float) -> None:
    """amp_C.multi_tensor_scale's contract: dst = src * scale, per pair of tensors."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def seed_all(seed: int) -> None:
    """torch (CPU and CUDA), megatron's RNG tracker, numpy and python RNGs from one seed."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
