"""The learner's training step on megatron-core: policy (and optional critic) updates.

Order of calls (every rank runs the same calls with the same rollouts):

    info = learner.parallel.init_distributed(tp)
    trainer = Trainer(train_cfg, optim_cfg, schedule_cfg, looped_policy_spec(model_config),
                      critic=..., critic_optim=..., critic_schedule=...)
    learner.checkpoint.load(trainer, path)      # optional: resume
    metrics = trainer.step(rollouts)            # k x global_batch_size rollouts -> k updates
    learner.publish.publish(trainer.policy_model, run_dir, trainer.weight_version)
    learner.checkpoint.save(trainer, run_dir, ...)

`step(rollouts)` (details: docs/LEARNER.md): sorted padded batch -> advantages over the whole
step (GRPO groups, or GAE with the pre-update critic's values) -> proximal pass with the
pre-update weights when needed -> per update and micro-batch: forward, `token_stats`,
`policy_loss` (normalizer: the update's global token or sequence count), backward of
loss x dp_size (megatron DDP averages over DP; the normalizer already gives each rank its
share of one global mean) -> `finalize_model_grads`, finiteness check, LR step,
`optimizer.step()` (clipping inside); critic likewise -> `weight_version += 1`, metrics reduced
over DP. An update whose loss or gradient norm is not finite on any rank is skipped on every
rank (learner.network.Network.update): weights, optimizer state and LR schedule stay as they
were; the step's metrics say so (`skipped_nonfinite`: skipped policy updates of this step,
`skipped_nonfinite_total`: so far, `critic_skipped_nonfinite`).

The model hides behind `PolicySpec` / `CriticSpec` (build + forward): the looped families of
learner/mcore_model.py (`looped_policy_spec`) and a plain megatron GPTModel plug in alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from learner.advantages import whiten_tokens
from learner.batching import (
    TrainBatch,
    build_batch,
    gae_advantages,
    group_token_advantages,
    penalise_rewards,
    sort_rollouts,
    update_normalizer,
    update_order,
)
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.losses import kl_penalty
from learner.network import Network, seed_all
from learner.objectives import policy_loss, value_loss
from learner.specs import (  # noqa: F401  (the looped families' specs: part of this API)
    CriticSpec,
    PolicySpec,
    looped_critic_spec,
    looped_policy_spec,
)
from learner.step_metrics import (
    StepMetrics,
    all_reduce_,
    record_policy,
    record_value,
    row_mismatch,
)
from learner.triton_token_stats import token_stats_auto
from learner.vocab_ops import contract_token_stats, nucleus_rows, token_stats
from proto.records import Rollout

__all__ = [
    "CriticSpec",
    "Network",
    "PolicySpec",
    "Trainer",
    "looped_critic_spec",
    "looped_policy_spec",
]


class Trainer:
    """Policy (+ critic) training on megatron-core; see the module docstring for the step."""

    def __init__(
        self,
        cfg: TrainConfig,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        policy: PolicySpec,
        *,
        critic: CriticSpec | None = None,
        critic_optim: OptimConfig | None = None,
        critic_schedule: ScheduleConfig | None = None,
        initial_version: int = 0,
        reference: PolicySpec | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        if cfg.objective.uses_critic != (critic is not None):
            raise ValueError(f"critic: objective {cfg.objective.kind!r} with critic="
                             f"{cfg.objective.critic} but critic spec {critic}")  # fmt: skip
        self.cfg = cfg
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.grad_accum = cfg.grad_accum_steps(self.dp_size)
        self.policy_spec, self.critic_spec = policy, critic
        seed_all(cfg.seed)
        exact = cfg.numerics == "exact"
        self.policy = Network(policy.build(cfg.recompute), optim, schedule, exact=exact)
        self.critic: Network | None = None
        if critic is not None:
            self.critic = Network(
                critic.build(cfg.recompute),
                critic_optim or optim,
                critic_schedule or schedule,
                exact=exact,
            )
        self.ref_module: nn.Module | None = None
        """Frozen reference policy of objective.kl_coef (no optimizer, no grad)."""
        if reference is not None:
            self.ref_module = reference.build(False)
            self.ref_module.eval()
            self.ref_module.requires_grad_(False)
        if cfg.objective.kl_coef > 0 and self.ref_module is None:
            raise ValueError("objective.kl_coef > 0 needs a reference PolicySpec")
        self.weight_version = initial_version
        """Version of the current policy weights (+1 per step)."""
        self.last_mismatch: list[float] = []
        """Per rollout of the last `step` (input order): max |learner - behaviour| log-prob."""
        self.step_count = 0
        """Completed `step` calls."""
        self.update_count = 0
        """Applied policy optimizer updates (the schedule's n; skipped ones do not count)."""

    @property
    def policy_model(self) -> nn.Module:
        """The unwrapped policy module (this rank's TP shard)."""
        return self.policy.module

    def networks(self) -> dict[str, Network]:
        """{"policy": ..., "critic": ...} (critic only when configured)."""
        return {"policy": self.policy} | ({"critic": self.critic} if self.critic else {})

    # ---------------------------------------------------------------- step helpers
    def _local_rows(self, n_rows: int) -> list[tuple[int, int, int, int]]:
        """(update start, update stop, this rank's start, stop) per update."""
        g, share = self.cfg.global_batch_size, self.cfg.global_batch_size // self.dp_size
        return [
            (u * g, (u + 1) * g, u * g + self.dp_rank * share, u * g + (self.dp_rank + 1) * share)
            for u in range(n_rows // g)
        ]

    def _micro(self, batch: TrainBatch, lo: int, hi: int) -> list[TrainBatch]:
        mbs, pad = self.cfg.micro_batch_size, self.cfg.pad_to_multiple
        return list(batch.micro_batches(mbs, lo, hi, pad))

    def _stats(self, out: dict[str, Tensor], mb: TrainBatch, old: Tensor | None) -> dict:
        """logp / entropy (/ kl, prox_logp from old logits) [B, L] from a PolicyForward;
        full-vocabulary statistics are computed on the response rows only."""
        smp = self.cfg.sampling
        if "logits" not in out and "mask_logits" not in out:
            if old is not None:
                raise ValueError("flow_dppo needs a PolicyForward that returns logits")
            return {"logp": out["logp"], "entropy": out["entropy"]}
        sel = mb.mask > 0
        rows = out["mask_logits"] if "mask_logits" in out else out["logits"][sel]

        def spread(x: Tensor) -> Tensor:
            return torch.zeros(sel.shape, dtype=x.dtype, device=x.device).masked_scatter(sel, x)

        if self.cfg.numerics == "exact":  # the contract's own log-probs, op for op
            return self._exact_stats(rows, old, mb.targets[sel], spread)
        if smp.top_p < 1.0:  # the generator sampled from the nucleus: renormalise over it
            rows = nucleus_rows(rows, smp.temperature, smp.top_p)
        stats_fn = token_stats_auto if self.cfg.fused_token_stats else token_stats
        stats = stats_fn(rows, old, mb.targets[sel], smp.temperature, self.cfg.vocab_chunk)

        res = {"logp": spread(stats.logp), "entropy": spread(stats.entropy), "rows": rows}
        if stats.kl is not None and stats.logp_old is not None:
            res["kl"] = spread(stats.kl)
            res["prox_logp"] = spread(stats.logp_old)
        return res

    def _exact_stats(self, rows: Tensor, old: Tensor | None, targets: Tensor, spread: Any) -> dict:
        """numerics exact: logp / entropy (/ kl, prox_logp) from the sampled-from distribution
        exactly as the contract defines it (learner.vocab_ops.contract_token_stats), the
        operations the reference backend and the generator run: the same bits."""
        smp = self.cfg.sampling
        st = contract_token_stats(rows, old, targets, smp.temperature, smp.top_p, "exact")
        return {k: spread(v) for k, v in st.items()} | {"rows": rows}

    @torch.no_grad()
    def _ref_logp(self, mb: TrainBatch) -> Tensor:
        """[B, L] log-probs of the sampled tokens under the frozen reference policy."""
        assert self.ref_module is not None
        return self._stats(self.policy_spec.forward(self.ref_module, mb), mb, None)["logp"]

    @torch.no_grad()
    def _kl_reward_penalty(self, batch: TrainBatch, rows: list[tuple[int, int, int, int]]) -> None:
        """kl_in_reward: reward -= kl_coef x sum over the response of the estimator of
        KL(behaviour || reference) at the sampled tokens (all data-parallel ranks' rows)."""
        obj = self.cfg.objective
        device = next(self.policy.module.parameters()).device
        pen = torch.zeros(batch.size, dtype=torch.float64)
        for _, _, lo, hi in rows:
            start = lo
            for mb_cpu in self._micro(batch, lo, hi):
                mb = mb_cpu.to(device)
                ref = self._ref_logp(mb)
                live = mb.mask > 0
                k = torch.where(
                    live, kl_penalty(mb.behav_logp.float(), ref.float(), obj.kl_estimator), 0.0
                )
                pen[start : start + mb.size] = k.sum(dim=1).double().cpu()
                start += mb.size
        if dist.is_initialized() and self.dp_size > 1:
            all_reduce_(pen, self.dp_group)
        self._kl_reward_mean = penalise_rewards(batch, pen, obj.kl_coef)

    @torch.no_grad()
    def _pre_update_passes(
        self, batch: TrainBatch, rows: list[tuple[int, int, int, int]]
    ) -> dict[tuple[int, int], Tensor]:
        """Critic values (+ GAE) and proximal log-probs / logits with pre-update weights."""
        cfg, flow = self.cfg, self.cfg.objective.kind == "flow_dppo"
        device = next(self.policy.module.parameters()).device
        old_logits: dict[tuple[int, int], Tensor] = {}
        length = batch.length
        zeros = torch.zeros(batch.size, length)
        if self.ref_module is not None and cfg.objective.kl_in_reward:
            self._kl_reward_penalty(batch, rows)
        if self.critic is not None:
            assert self.critic_spec is not None
            values = zeros.clone()
            self.critic.module.eval()
            for _, _, lo, hi in rows:
                start = lo
                for mb in self._micro(batch, lo, hi):
                    mb = mb.to(device)
                    v = self.critic_spec.forward(self.critic.module, mb).float().cpu()
                    values[start : start + mb.size, : v.shape[1]] = v[:, :length]
                    start += mb.size
            self.critic.module.train()
            adv, ret = gae_advantages(batch, values, cfg.objective.gamma, cfg.objective.lam)
            batch.extra.update(old_values=values, returns=ret)
        else:
            adv = group_token_advantages(batch, cfg.objective.normalize_std)
        local = torch.zeros(batch.size, dtype=torch.bool)
        for _, _, lo, hi in rows:
            local[lo:hi] = True
        adv = torch.where(local[:, None], adv, 0.0)
        if cfg.objective.whiten:
            adv = self._whiten(adv, torch.where(local[:, None], batch.mask, 0.0))
        batch.extra["advantages"] = adv
        if cfg.use_prox:
            prox = zeros.clone()
            self.policy.module.eval()
            for u, (_, _, lo, hi) in enumerate(rows):
                start = lo
                for i, mb_cpu in enumerate(self._micro(batch, lo, hi)):
                    mb = mb_cpu.to(device)
                    stats = self._stats(self.policy_spec.forward(self.policy.module, mb), mb, None)
                    if flow:
                        if "rows" not in stats:
                            raise ValueError("flow_dppo needs a PolicyForward that returns logits")
                        # host memory (pinned on CUDA): one micro-batch of full-vocabulary
                        # old logits is on the device at a time, not the whole step's
                        rows_old = stats["rows"].detach()
                        host = torch.empty(rows_old.shape, dtype=rows_old.dtype, device="cpu",
                                           pin_memory=rows_old.is_cuda)  # fmt: skip
                        old_logits[(u, i)] = host.copy_(rows_old)
                    lp = stats["logp"].float().cpu()
                    prox[start : start + mb.size, : lp.shape[1]] = lp[:, :length]
                    start += mb.size
            self.policy.module.train()
            batch.extra["prox_logp"] = prox
        return old_logits

    def _whiten(self, adv: Tensor, mask: Tensor) -> Tensor:
        """learner.advantages.whiten_tokens over the masked tokens of all DP ranks."""
        multi = dist.is_initialized() and self.dp_size > 1
        return whiten_tokens(
            adv, mask, (lambda t: all_reduce_(t, self.dp_group)) if multi else None
        )

    # ---------------------------------------------------------------- the step
    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Train on `rollouts` (a multiple of global_batch_size of them): one optimizer
        update per global batch; returns metrics (identical on every rank)."""
        cfg, g = self.cfg, self.cfg.global_batch_size
        if not rollouts or len(rollouts) % g:
            raise ValueError(
                f"rollouts: expected a positive multiple of global_batch_size ({g}), "
                f"got {len(rollouts)}"
            )
        batch = build_batch(rollouts, pad_to_multiple=cfg.pad_to_multiple)
        rows = self._local_rows(batch.size)
        old_logits = self._pre_update_passes(batch, rows)
        metrics = StepMetrics()
        device = next(self.policy.module.parameters()).device
        use_prox_logp = cfg.use_prox and cfg.objective.kind != "flow_dppo"
        # Per batch row: max |learner - behaviour| log-prob (-1 where not measured).
        mismatch_rows = torch.full((batch.size,), -1.0, dtype=torch.float64)
        skipped = 0.0  # policy updates of this step skipped as non-finite (same on every rank)
        n_updates = len(rows) * cfg.objective.epochs
        # kl_in_reward: the KL went into the rewards, not into the loss
        loss_obj = (
            dataclasses.replace(cfg.objective, kl_coef=0.0)
            if cfg.objective.kl_in_reward
            else cfg.objective
        )
        # epochs passes over the global batches, the first in order, later ones shuffled by
        # (seed, step, epoch): the same order on every rank (learner.batching.update_order)
        order = update_order(len(rows), cfg.objective.epochs, cfg.seed, self.step_count)
        for u, j in enumerate(order):
            g_lo, g_hi, lo, hi = rows[j]
            norm = update_normalizer(batch, g_lo, g_hi, cfg.objective.aggregation)
            self.policy.zero_grad()
            row0, loss_finite = lo, True
            for i, mb_cpu in enumerate(self._micro(batch, lo, hi)):
                mb = mb_cpu.to(device)
                old = old_logits.get((j, i))
                stats = self._stats(
                    self.policy_spec.forward(self.policy.module, mb), mb,
                    None if old is None else old.to(device, non_blocking=True),
                )  # fmt: skip
                stats.pop("rows", None)
                lb: dict[str, Any] = dict(stats, mask=mb.mask, behav_logp=mb.behav_logp)
                lb.update(advantages=mb.extra["advantages"], normalizer=norm)
                if use_prox_logp:
                    lb["prox_logp"] = mb.extra["prox_logp"]
                if self.ref_module is not None and not cfg.objective.kl_in_reward:
                    lb["ref_logp"] = self._ref_logp(mb)
                loss, m = policy_loss(loss_obj, lb)
                (loss * self.dp_size).backward()
                loss_finite = loss_finite and bool(torch.isfinite(loss.detach()))
                # behaviour vs learner log-probs: the proximal pass when it ran, else the
                # training forward of the step's first update
                learner = mb.extra.get("prox_logp", stats["logp"].detach() if u == 0 else None)
                record_policy(metrics, m, mb.mask, mb.behav_logp, learner, n_updates)
                if learner is not None:
                    row_mismatch(mismatch_rows, row0, mb.mask, mb.behav_logp, learner)
                row0 += mb.size
            upd = self.policy.update(loss_finite)  # skips a non-finite update (learner.network)
            skip = upd.pop("skipped_nonfinite")
            skipped += skip
            for k, v in upd.items():
                metrics.add_mean(k, v, 1.0)
            self.update_count += 0 if skip else 1
            if self.critic is not None:
                vnorm = update_normalizer(batch, g_lo, g_hi, cfg.objective.aggregation)
                self._critic_update(batch, lo, hi, vnorm, metrics, n_updates)
        self._batch_metrics(batch, metrics)
        if self.dp_size > 1:  # each DP rank measured its own rows
            all_reduce_(mismatch_rows, self.dp_group, dist.ReduceOp.MAX)
        by_id = {
            r.rollout_id: float(mismatch_rows[i]) for i, r in enumerate(sort_rollouts(rollouts))
        }
        # Per input rollout: max over its tokens at the pre-update weights; -1.0 = not measured.
        self.last_mismatch = [by_id[r.rollout_id] for r in rollouts]
        out = metrics.reduce(self.dp_group)
        self.step_count += 1
        self.weight_version += 1
        if self.ref_module is not None and cfg.objective.kl_in_reward:
            out["kl_ref"] = self._kl_reward_mean
        out.update(weight_version=float(self.weight_version), updates=float(n_updates),
                   epochs=float(cfg.objective.epochs))  # fmt: skip
        out.update(
            skipped_nonfinite=skipped, skipped_nonfinite_total=float(self.policy.skipped_nonfinite)
        )
        return out

    def _critic_update(
        self, batch: TrainBatch, lo: int, hi: int, norm: float, metrics: StepMetrics, n_updates: int
    ) -> None:
        assert self.critic is not None and self.critic_spec is not None
        device = next(self.critic.module.parameters()).device
        vcfg = self.cfg.objective
        self.critic.zero_grad()
        loss_finite = True
        for mb_cpu in self._micro(batch, lo, hi):
            mb = mb_cpu.to(device)
            values = self.critic_spec.forward(self.critic.module, mb)
            vb = {"values": values, "mask": mb.mask, "normalizer": norm}
            vb.update(old_values=mb.extra["old_values"], returns=mb.extra["returns"])
            loss, m = value_loss(vcfg, vb)
            (loss * (vcfg.value_coef * self.dp_size)).backward()
            loss_finite = loss_finite and bool(torch.isfinite(loss.detach()))
            record_value(metrics, m, mb.mask, n_updates)
        upd = self.critic.update(loss_finite)
        metrics.add_max("critic_skipped_nonfinite", upd.pop("skipped_nonfinite"))
        for k, v in upd.items():
            metrics.add_mean(f"critic_{k}", v, 1.0)

    def _batch_metrics(self, batch: TrainBatch, metrics: StepMetrics) -> None:
        """Per-step quantities every rank knows in full (added on rank 0 of DP only)."""
        if self.dp_rank != 0:
            metrics.add_sum("reward_mean", 0.0)
            metrics.add_sum("staleness_mean", 0.0)
            metrics.add_max("staleness_max", -math.inf)
            return
        stale = (self.weight_version - batch.weight_versions).float()
        metrics.add_sum("reward_mean", float(batch.rewards.mean()))
        metrics.add_sum("staleness_mean", float(stale.mean()))
        metrics.add_max("staleness_max", float(stale.max()))
