"""One learner step, written once, over a small policy interface with two implementations.

Order of calls::

    policy = ...                        # a `Policy`: learner.trainer (megatron-core) or
                                        # learner.torch_policy (plain PyTorch, models.engine.chunk)
    runner = LearnerStep(train_cfg, policy, initial_version=0)
    metrics = runner.step(rollouts)     # k x global_batch_size rollouts -> k x epochs updates
    runner.weight_version, runner.step_count, runner.update_count, runner.last_mismatch

`LearnerStep.step` (docs/LEARNER.md "The step"):

1. rewards: `learner.shaping.shape_rollouts` (failed rewards filled, the overlong penalty;
   the KL penalty joins in step 2), then rows: `learner.batching.build_batch` (the one row
   layout: sorted rollouts, [B, prompt +
   response[:-1]] rows); update u trains the global rows [u g, (u + 1) g), this data-parallel
   rank its share of them.
2. pre-update passes, with the step's starting weights (eval mode, no grad), micro-batch by
   micro-batch, in this order: the proximal log-probs (`TrainConfig.use_prox`, or for a KL
   reward penalty from them: `objective.kl_in_reward_logp` proximal) and flow_dppo's proximal
   logits (kept in host memory, one micro-batch on the device at a time); the frozen
   reference's log-probs (`objective.kl_coef`; with `kl_in_reward` they become the rewards'
   penalty, per sequence or per token: `learner.shaping.penalise_kl`); the critic's values; the advantages
   (`learner.batching.step_advantages`: GAE or the group / REINFORCE estimators, whitening over
   every DP rank's tokens).
3. `objective.epochs` passes over the mini-batches (`learner.batching.update_order`); per
   update: per micro-batch forward, token statistics, `learner.objectives.policy_loss`
   (normalizer: the update's global token or sequence count), backward of loss x dp_size (the
   policy averages gradients over DP); `Net.update(loss_finite)` (a non-finite loss or gradient
   norm on any rank skips the update: weights, optimizer state and LR untouched); then the
   critic's update on the same mini-batch (`value_coef` x `value_loss`).
4. metrics (learner.step_metrics, reduced over DP), the per-rollout behaviour/learner log-prob
   mismatch, `weight_version += 1`.

A `Policy` is what differs between backends: how a micro-batch is forwarded (log-probs and
entropies of the sampled tokens, critic values, the reference's log-probs), how gradients are
applied (`Net`), and over which data-parallel group metrics are reduced. Nothing of the
algorithm lives in an implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from learner.batching import (
    TrainBatch,
    build_batch,
    local_rows,
    mask_stale_tokens,
    pack_updates,
    sort_rollouts,
    step_advantages,
    update_normalizer,
    update_order,
)
from learner.config import TrainConfig
from learner.losses import kl_penalty
from learner.objectives import behaviour_weighted, policy_loss, value_loss
from learner.objectives.batch import LossBatch, ValueBatch
from learner.objectives.correction import rollout_correction
from learner.objectives.loops import (
    LearnedLoopWeights,
    loop_weights,
    response_depths,
    row_full_depths,
)
from learner.policy import Net, Policy
from learner.shaping import depth_fraction, penalise_kl, shape_rollouts
from learner.step_metrics import (
    StepMetrics,
    exit_mismatch,
    record_policy,
    record_value,
    row_mismatch,
)
from models.token_rows import micro_spans
from proto.records import Rollout

__all__ = ["LearnerStep"]  # the interface it drives: learner.policy

Rows = list[tuple[int, int, int, int]]
"""Per mini-batch: (global start, global stop, this rank's start, stop) in the sorted batch."""


def _loop_inputs(lb: LossBatch, obj: Any, mb: TrainBatch, stats: dict[str, Tensor],
                 learned: LearnedLoopWeights | None) -> None:  # fmt: skip
    """Per-loop credit: the loop weights and per-loop inputs of a micro-batch into ``lb``
    (``learned``: loop_weighting learned's logits, whose weights carry their gradient)."""
    lp = stats["loop_logp"]
    lb.loop_logp, lb.loop_entropy = lp, stats.get("loop_entropy")
    lb.loop_prox, lb.loop_ref = mb.extra.get("prox_loops"), mb.extra.get("ref_loops")
    _, e, n_loops = response_depths(mb)
    full = row_full_depths(mb)  # contract 2
    if learned is not None:
        lb.loop_weight = learned.weights(e, n_loops)
        return
    lb.loop_weight = loop_weights(obj, e, full, stats.get("loop_gate"), n_loops)


@contextlib.contextmanager
def _evaluating(*nets: Net | None) -> Iterator[None]:
    """Eval mode and no grad for the pre-update passes; train mode again afterwards."""
    live = [n for n in nets if n is not None]
    for n in live:
        n.module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for n in live:
            n.module.train()


class LearnerStep:
    """The step (module docstring) and the counters a checkpoint keeps."""

    def __init__(self, cfg: TrainConfig, policy: Policy, *, initial_version: int = 0) -> None:
        if cfg.objective.uses_critic != (policy.critic is not None):
            raise ValueError(f"critic: objective {cfg.objective.kind!r} with critic="
                             f"{cfg.objective.critic} but the policy has critic {policy.critic}")  # fmt: skip
        if cfg.objective.kl_coef > 0 and not policy.has_reference:
            raise ValueError("objective.kl_coef > 0 needs a reference policy")
        self.cfg, self.pol = cfg, policy
        self.weight_version = initial_version
        """Version of the current policy weights (+1 per step)."""
        self.step_count = 0
        """Completed `step` calls."""
        self.update_count = 0
        """Applied policy optimizer updates (the schedule's n; skipped ones do not count)."""
        self.last_mismatch: list[float] = []
        """Per rollout of the last `step` (input order): max |learner - behaviour| log-prob over
        its tokens at the pre-update weights; -1.0 where not measured."""
        self.last_refused: list[int] = []
        """The rollouts (input indices) over their ``logp_bounds`` in the last `step`, which
        was then refused (nothing applied); empty when it trained."""
        self.loop_weights = (LearnedLoopWeights(cfg.objective.loop_weight_lr, policy.device)
                             if cfg.objective.loop_weighting == "learned" else None)  # fmt: skip
        """objective.loop_weighting learned: its logits (checkpointed, never published)."""

    # ------------------------------------------------------------------ layout
    def _local_rows(self, batch: TrainBatch, g: int) -> Rows:
        dp = self.pol.dp
        return local_rows(batch, g, dp.size, dp.rank, by_tokens=bool(self.cfg.max_tokens_per_micro))

    def _pack(self, batch: TrainBatch, g: int) -> TrainBatch:
        """learner.batching.pack_updates with this step's budget and data-parallel size."""
        return pack_updates(batch, g, self.pol.dp.size, self.cfg.max_tokens_per_micro)

    def _micro(self, batch: TrainBatch, lo: int, hi: int) -> Iterator[tuple[int, TrainBatch]]:
        """(first row, micro-batch on the policy's device) over rows [lo, hi): micro_batch_size
        rows each, or with max_tokens_per_micro consecutive rows of at most that many tokens
        (models.token_rows.micro_spans), marked packed (learner.batching.packed_inputs)."""
        mbs, pad, budget = (
            self.cfg.micro_batch_size,
            self.cfg.pad_to_multiple,
            self.cfg.max_tokens_per_micro,
        )
        if budget:
            for a, b in micro_spans(batch.seq_lens[lo:hi].numpy(), budget):
                mb = batch.rows(lo + a, lo + b, pad)
                mb.packed, mb.pack_multiple = True, pad
                yield lo + a, mb.to(self.pol.device)
            return
        for a in range(lo, hi, mbs):
            yield a, batch.rows(a, min(a + mbs, hi), pad).to(self.pol.device)

    # ------------------------------------------------------------------ pre-update passes
    def _pre_update(self, batch: TrainBatch, rows: Rows) -> tuple[dict, float | None]:
        """Step 2 of the module docstring, into batch.extra; returns flow_dppo's proximal
        logits per (mini-batch, micro-batch) and the kl_in_reward penalty's mean (kl_ref)."""
        cfg, pol, obj = self.cfg, self.pol, self.cfg.objective
        zeros = torch.zeros(batch.size, batch.length)

        landing: list[tuple[Tensor, int, Tensor]] = []

        def put(dst: Tensor, a: int, x: Tensor) -> None:
            x = x.float()[:, : batch.length]
            if x.is_cuda:  # copied to pinned memory without a wait; placed by `land`
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                landing.append((dst, a, host.copy_(x, non_blocking=True)))
                return
            dst[a : a + x.shape[0], : x.shape[1], ...] = x

        def land() -> None:
            """After a pass: one wait for the card, then its outputs into place."""
            if landing:
                torch.cuda.current_stream().synchronize()
            for dst, a, x in landing:
                dst[a : a + x.shape[0], : x.shape[1], ...] = x
            landing.clear()

        # per-loop credit: [B, L, K] per-loop log-probs of the proximal / reference passes
        loops = obj.loop_weighting != "last"
        k_all = int(batch.exit_depths[batch.mask > 0].max()) if loops else 0
        per_loop = torch.zeros(batch.size, batch.length, k_all)

        def put_loops(dst: Tensor, a: int, x: Tensor) -> None:
            put(dst[..., : x.shape[-1]], a, x)

        kl_ref = None
        kl = pol.has_reference and obj.kl_coef > 0
        # kl_in_reward_logp proximal: the proximal pass runs first, the penalty uses its log-probs
        kl_prox = kl and obj.kl_in_reward and obj.kl_in_reward_logp == "proximal"
        with _evaluating(pol.policy, pol.critic):
            old_logits: dict[tuple[int, int], Tensor] = {}
            if cfg.use_prox or kl_prox:
                prox, prox_loops = zeros.clone(), per_loop.clone()
                exit_prox = zeros.clone() if cfg.exit_min_depth is not None else None
                for j, (_, _, lo, hi) in enumerate(rows):
                    for i, (a, mb) in enumerate(self._micro(batch, lo, hi)):
                        stats = pol.policy_stats(mb, None)
                        if obj.kind == "flow_dppo":
                            if "rows" not in stats:
                                raise ValueError("flow_dppo needs a policy forward with logits")
                            old = stats["rows"].detach()
                            host = torch.empty(old.shape, dtype=old.dtype, device="cpu",
                                               pin_memory=old.is_cuda)  # fmt: skip
                            old_logits[(j, i)] = host.copy_(old)
                        put(prox, a, stats["logp"])
                        if exit_prox is not None:  # a sampled exit's, at the same weights
                            put(exit_prox, a, stats["exit_logp"])
                        if loops:
                            put_loops(prox_loops, a, stats["loop_logp"])
                land()
                batch.extra["prox_logp" if cfg.use_prox else "kl_prox_logp"] = prox
                if exit_prox is not None and cfg.use_prox:
                    batch.extra["exit_prox"] = exit_prox
                if loops:
                    batch.extra["prox_loops"] = prox_loops
            if kl:
                ref, ref_loops = zeros.clone(), per_loop.clone()
                token = obj.kl_in_reward_level == "token"
                pen = torch.zeros((batch.size, batch.length) if token else batch.size,
                                  dtype=torch.float64)  # fmt: skip
                for _, _, lo, hi in rows:
                    for a, mb in self._micro(batch, lo, hi):
                        lp = pol.reference_logp(mb)
                        put(ref, a, lp)
                        if loops and not obj.kl_in_reward:  # the loss's KL at every loop
                            put_loops(ref_loops, a, pol.reference_loop_logp(mb))
                        mine = mb.extra.get("prox_logp", mb.extra.get("kl_prox_logp"))
                        mine = mine if kl_prox and mine is not None else mb.behav_logp
                        k = kl_penalty(mine.float(), lp.float(), obj.kl_estimator, obj.kl_cap)
                        k = torch.where(mb.mask > 0, k, 0.0)
                        if token:
                            pen[a : a + mb.size, : k.shape[1]] = k.double().cpu()
                        else:
                            pen[a : a + mb.size] = k.sum(1).double().cpu()
                land()
                batch.extra.pop("kl_prox_logp", None)
                if obj.kl_in_reward:  # every DP rank's rows, then the same rewards everywhere
                    kl_ref = penalise_kl(batch, pol.dp.all_reduce_(pen), obj.kl_coef,
                                         obj.kl_in_reward_level)  # fmt: skip
                else:
                    batch.extra["ref_logp"] = ref
                    if loops:
                        batch.extra["ref_loops"] = ref_loops
            values = None
            if pol.critic is not None:
                values = zeros.clone()
                for _, _, lo, hi in rows:
                    for a, mb in self._micro(batch, lo, hi):
                        put(values, a, pol.values(mb))
                land()
            local = torch.zeros(batch.size, dtype=torch.bool)
            for _, _, lo, hi in rows:
                local[lo:hi] = True
            # GAE with a critic, else the group/REINFORCE estimators; whitening over every DP
            # rank's tokens (learner.batching.step_advantages: every advantage option)
            adv, ret = step_advantages(
                batch, values, truncated=batch.truncated, local=local,
                reduce=pol.dp.all_reduce_ if pol.dp.active else None, **obj.advantage_options(),
            )  # fmt: skip
            if values is not None and ret is not None:
                batch.extra.update(old_values=values, returns=ret)
            batch.extra["advantages"] = adv
        return old_logits, kl_ref

    # ------------------------------------------------------------------ the step
    def step(self, rollouts: Sequence[Rollout], cfg: TrainConfig | None = None, *,
             logp_bounds: Sequence[float] | None = None) -> dict[str, float]:  # fmt: skip
        """Train on `rollouts` (a positive multiple of global_batch_size of them); returns the
        step's metrics (identical on every rank). ``cfg``: this step's TrainConfig, kept for
        the steps after it (the reference backend sizes its updates by the step's rollouts).

        ``logp_bounds`` (per rollout, input order; the same on every rank): verified rollouts
        before the update. Every rollout's max |learner - behaviour| log-prob is measured at
        the step's starting weights before any optimizer update (`_measure_before`); when one
        exceeds its bound the step is refused: no update is applied (gradients zeroed,
        weights, optimizer, schedule and counters untouched), ``last_refused`` names the
        rollouts (input indices), ``last_mismatch`` holds every measurement, and the returned
        metrics are {"refused_rollouts": k}. The caller takes the liars out and steps again."""
        self.cfg = cfg or self.cfg
        self.last_refused = []
        cfg, pol, g = self.cfg, self.pol, self.cfg.global_batch_size
        if not rollouts or len(rollouts) % g:
            raise ValueError(f"rollouts: expected a positive multiple of global_batch_size ({g}), "
                             f"got {len(rollouts)}")  # fmt: skip
        obj = cfg.objective
        in_reward = obj.depth_cost if obj.depth_cost_in == "reward" else 0.0
        rollouts, _ = shape_rollouts(rollouts, max_tokens=cfg.max_tokens,
                                     overlong_buffer=obj.overlong_buffer,
                                     overlong_penalty=obj.overlong_penalty,
                                     depth_cost=in_reward)  # fmt: skip
        batch = build_batch(rollouts, pad_to_multiple=cfg.pad_to_multiple)
        if obj.depth_cost > 0 and not in_reward:  # objective.depth_cost_in advantage
            frac = torch.tensor([depth_fraction(r) for r in sort_rollouts(rollouts)],
                                dtype=torch.float64)  # fmt: skip
            # per row, laid out [B, L] like every extra (micro-batches slice and pad them)
            batch.extra["depth_fraction"] = frac[:, None].expand(batch.size, batch.length)
        gap = cfg.objective.max_token_version_gap
        live = batch.mask > 0
        assert batch.token_versions is not None
        token_stale = (self.weight_version - batch.token_versions)[live]
        stale_masked = None if gap is None else mask_stale_tokens(batch, self.weight_version, gap)
        rows = self._local_rows(batch, g)
        batch = self._pack(batch, g)  # (rows: the same ranges, reordered within)
        old_logits, kl_ref = self._pre_update(batch, rows)
        # kl_in_reward: the KL went into the rewards, not into the loss
        loss_obj = dataclasses.replace(obj, kl_coef=0.0) if obj.kl_in_reward else obj
        use_prox_logp = cfg.use_prox and obj.kind != "flow_dppo"
        corrected = behaviour_weighted(obj)  # rollout correction (learner.objectives.correction)
        metrics = StepMetrics()
        # per batch row, on the card (read once, at the step's end: `_refused`, below)
        mismatch = torch.full((batch.size,), -1.0, dtype=torch.float64, device=pol.device)
        order = update_order(len(rows), obj.epochs, cfg.seed, self.step_count)
        n_updates, skipped = len(order), 0.0
        bounds = None if logp_bounds is None else self._row_bounds(batch, rollouts, logp_bounds)
        early = "prox_logp" in batch.extra  # every row measured already: judged before the loop
        if bounds is not None:
            self._measure_before(batch, rows, order[0], mismatch)
            if early and self._refused(batch, rollouts, mismatch, bounds):
                return {"refused_rollouts": float(len(self.last_refused))}
        for u, j in enumerate(order):
            g_lo, g_hi, lo, hi = rows[j]
            norm = update_normalizer(batch, g_lo, g_hi, obj.aggregation)
            if corrected and not obj.is_rejected_in_denominator:
                norm = self._kept_normalizer(batch, lo, hi)
            pol.policy.zero_grad()
            if self.loop_weights is not None:
                self.loop_weights.zero_grad()
            finite: list[Tensor] = []  # each micro-batch's loss finite, read once an update
            for i, (a, mb) in enumerate(self._micro(batch, lo, hi)):
                old = old_logits.get((j, i))
                old = None if old is None else old.to(pol.device, non_blocking=True)
                stats = pol.policy_stats(mb, old)
                lb = LossBatch(
                    mask=mb.mask, advantages=mb.extra["advantages"], logp=stats["logp"],
                    entropy=stats.get("entropy"), behav_logp=mb.behav_logp, kl=stats.get("kl"),
                    prox_logp=mb.extra["prox_logp"] if use_prox_logp else stats.get("prox_logp"),
                    ref_logp=mb.extra.get("ref_logp"), normalizer=norm,
                )  # fmt: skip
                if obj.loop_weighting != "last":  # per-loop credit (learner.objectives.loops)
                    _loop_inputs(lb, obj, mb, stats, self.loop_weights)
                if "exit_logp" in stats:  # a sampled exit (learner.objectives.exit_term)
                    lb.exit_logp, lb.exit_entropy = stats["exit_logp"], stats.get("exit_entropy")
                    lb.exit_behav, lb.exit_prox = (
                        mb.extra.get("exit_behav"),
                        mb.extra.get("exit_prox"),
                    )
                loss, m = policy_loss(loss_obj, lb, lazy=True)
                (loss * pol.dp.size).backward()
                finite.append(torch.isfinite(loss.detach()))
                # behaviour vs learner log-probs: the proximal pass when it ran, else the
                # training forward of the step's first update (the same weights)
                learner = mb.extra.get("prox_logp", stats["logp"].detach() if u == 0 else None)
                rejected = None
                if corrected and learner is not None:
                    prox = mb.extra["prox_logp"]
                    rejected = rollout_correction(obj, mb.mask, prox, mb.behav_logp).rejected
                record_policy(metrics, m, mb.mask, mb.behav_logp, learner, n_updates, rejected)
                if learner is not None:
                    row_mismatch(mismatch, a, mb.mask, mb.behav_logp, learner)
                    exit_mismatch(mismatch, a, mb, stats, u == 0)
            if (
                u == 0
                and bounds is not None
                and not early
                and self._refused(batch, rollouts, mismatch, bounds)
            ):
                pol.policy.zero_grad()  # nothing of the liars' (nor anyone's) is applied
                return {"refused_rollouts": float(len(self.last_refused))}
            upd = pol.policy.update(_all(finite))
            skip = upd.pop("skipped_nonfinite")
            skipped += skip
            if self.loop_weights is not None:  # loop_weighting learned: after the policy's
                self.loop_weights.step(pol.dp, apply=not skip)
            for k, v in upd.items():
                metrics.add_mean(k, v, 1.0)
            self.update_count += 0 if skip else 1
            if pol.critic is not None:  # after the policy's update, on the same mini-batch
                self._critic_update(pol.critic, batch, lo, hi, norm, metrics, n_updates)
        self._batch_metrics(batch, metrics)
        mismatch = mismatch.cpu()
        pol.dp.all_reduce_(mismatch, dist.ReduceOp.MAX)  # each DP rank measured its own rows
        by_id = {rid: float(mismatch[i]) for i, rid in enumerate(batch.rollout_ids)}
        self.last_mismatch = [by_id[r.rollout_id] for r in rollouts]
        out = metrics.reduce(pol.dp.group)  # the DP group (None: the world, of one rank here)
        self.step_count += 1
        self.weight_version += 1
        if kl_ref is not None:
            out["kl_ref"] = kl_ref
        # the staleness bound per token (rollout.token_versions), before any masking
        out["token_staleness_max"] = float(token_stale.max()) if token_stale.numel() else 0.0
        if stale_masked is not None:
            out["token_stale_masked_frac"] = stale_masked
        out.update(weight_version=float(self.weight_version), updates=float(n_updates),
                   epochs=float(obj.epochs), skipped_nonfinite=skipped,
                   skipped_nonfinite_total=float(pol.policy.skipped_nonfinite),
                   logprob_mismatch=out.get("logp_mismatch_max", math.nan))  # fmt: skip
        return out

    # ------------------------------------------------------------------ verified rollouts
    def _row_bounds(self, batch: TrainBatch, rollouts: Sequence[Rollout],
                    bounds: Sequence[float]) -> Tensor:  # fmt: skip
        """The bounds of `step` per batch row (the rows follow sort_rollouts, then `_pack`)."""
        if len(bounds) != len(rollouts):
            raise ValueError(f"logp_bounds: expected one bound per rollout ({len(rollouts)}), "
                             f"got {len(bounds)}")  # fmt: skip
        by_id = {r.rollout_id: float(b) for r, b in zip(rollouts, bounds, strict=True)}
        return torch.tensor([by_id[rid] for rid in batch.rollout_ids], dtype=torch.float64)

    def _measure_before(self, batch: TrainBatch, rows: Rows, first: int, out: Tensor) -> None:
        """Every local row's mismatch at the starting weights, before any update: from the
        proximal pass when it ran (no extra forward), else a no-grad forward of the rows that
        the first update does not train (the first update's training forward measures its
        own rows before its optimizer step: with one mini-batch, no extra forward at all)."""
        prox = batch.extra.get("prox_logp")
        if prox is not None:
            eprox, ebehav = batch.extra.get("exit_prox"), batch.extra.get("exit_behav")
            for _, _, lo, hi in rows:
                row_mismatch(out, lo, batch.mask[lo:hi], batch.behav_logp[lo:hi], prox[lo:hi])
                if eprox is not None and ebehav is not None:  # a sampled exit's claim too
                    row_mismatch(out, lo, batch.mask[lo:hi], ebehav[lo:hi], eprox[lo:hi])
            return
        with _evaluating(self.pol.policy):
            for j, (_, _, lo, hi) in enumerate(rows):
                if j == first:
                    continue
                for a, mb in self._micro(batch, lo, hi):
                    st = self.pol.policy_stats(mb, None)
                    row_mismatch(out, a, mb.mask, mb.behav_logp, st["logp"].detach())
                    exit_mismatch(out, a, mb, st, True)

    def _refused(self, batch: TrainBatch, rollouts: Sequence[Rollout], mismatch: Tensor,
                 bounds: Tensor) -> bool:  # fmt: skip
        """Every rank's measurements (max over DP; per batch row), against the bounds: the
        liars, if any, in ``last_refused`` (input indices; the same decision on every rank)."""
        m = self.pol.dp.all_reduce_(mismatch.to("cpu", copy=True), dist.ReduceOp.MAX)
        bad = (m >= 0) & (m > bounds)
        if not bool(bad.any()):
            return False
        ids = batch.rollout_ids
        by_id = {rid: float(m[i]) for i, rid in enumerate(ids)}
        liars = {ids[i] for i in torch.nonzero(bad).flatten().tolist()}
        self.last_mismatch = [by_id[r.rollout_id] for r in rollouts]
        self.last_refused = [i for i, r in enumerate(rollouts) if r.rollout_id in liars]
        return True

    def _kept_normalizer(self, batch: TrainBatch, lo: int, hi: int) -> float:
        """objective.is_rejected_in_denominator false: the update's global count of response
        tokens (token_mean) or rows with one (seq_*) the rollout correction keeps, from the
        same micro-batches and function as the loss (learner.objectives.correction)."""
        obj = self.cfg.objective
        kept_n: list[Tensor] = []
        for _, mb in self._micro(batch, lo, hi):
            rej = rollout_correction(obj, mb.mask, mb.extra["prox_logp"], mb.behav_logp).rejected
            kept = (mb.mask > 0) & ~rej
            kept_n.append(kept.sum() if obj.aggregation == "token_mean" else kept.any(1).sum())
        # (integer counts: their sum exact; one read of the card)
        total = float(torch.stack(kept_n).sum()) if kept_n else 0.0
        n = torch.tensor([total], dtype=torch.float64)
        return float(self.pol.dp.all_reduce_(n)[0])

    def _critic_update(self, critic: Net, batch: TrainBatch, lo: int, hi: int, norm: float,
                       metrics: StepMetrics, n_updates: int) -> None:  # fmt: skip
        obj, dp = self.cfg.objective, self.pol.dp
        critic.zero_grad()
        finite: list[Tensor] = []
        for _, mb in self._micro(batch, lo, hi):
            vb = ValueBatch(values=self.pol.values(mb), old_values=mb.extra["old_values"],
                            returns=mb.extra["returns"], mask=mb.mask, normalizer=norm)  # fmt: skip
            loss, m = value_loss(obj, vb, lazy=True)
            (loss * (obj.value_coef * dp.size)).backward()
            finite.append(torch.isfinite(loss.detach()))
            record_value(metrics, m, mb.mask, n_updates)
        upd = critic.update(_all(finite))
        metrics.add_max("critic_skipped_nonfinite", upd.pop("skipped_nonfinite"))
        for k, v in upd.items():
            metrics.add_mean(f"critic_{k}", v, 1.0)

    def _batch_metrics(self, batch: TrainBatch, metrics: StepMetrics) -> None:
        """Per-step quantities every rank knows in full (added on DP rank 0 only)."""
        if self.pol.dp.rank != 0:
            metrics.add_sum("reward_mean", 0.0)
            metrics.add_sum("staleness_mean", 0.0)
            metrics.add_max("staleness_max", -math.inf)
            return
        stale = (self.weight_version - batch.weight_versions).float()
        metrics.add_sum("reward_mean", float(batch.rewards.mean()))
        metrics.add_sum("staleness_mean", float(stale.mean()))
        metrics.add_max("staleness_max", float(stale.max()))


def _all(flags: list[Tensor]) -> bool:
    """Whether every 0-d bool tensor holds (one read of the card for all of them)."""
    return bool(torch.stack(flags).all()) if flags else True
