"""A pure-PyTorch trainer on models.reference (backend "reference"): CPU runs and tests.

It implements pipeline.backends.trainer_api.Trainer with the reference forward (models.engine.run_chunk
replaying each rollout's latent seed and exit depths) and learner.objectives,
objective.epochs x objective.minibatches optimizer updates per call. It stands in until the megatron trainer (learner.trainer) is available and
stays useful as a small, deterministic baseline: same inputs, same thread count -> the same
bits, which is what `looprl replay` relies on.

step(rollouts, flags) runs learner.trainer.Trainer.step's sequence on the same layout, so that
in numerics exact the two backends' losses, metrics and weights are the same bits
(tests/pipeline/test_epochs.py):
    layout      learner.batching.build_batch: rollouts sorted, [B, prompt + response] rows;
                mini-batches = ``objective.minibatches`` row ranges of whole groups, each cut
                into micro-batches of learner.micro_batch_size rows (0: the group size if it
                divides, at most 16; megatron_adapter.train_config).
    advantages  grpo/dppo/flow_dppo: group-relative (learner.batching.group_token_advantages);
                with a critic (ppo, objective.critic): GAE on the values of a separate critic
                network (pipeline.backends.reference_critic, as the megatron backend's);
                objective.whiten: learner.advantages.whiten_tokens.
    proximal    with the step's starting weights, micro-batch by micro-batch, when the objective
                needs it (TrainConfig.use_prox): prox_logp and flow_dppo's proximal logits (the
                first mini-batch's from its first update's forward: the same weights).
    update      per micro-batch: forward, token statistics (learner.vocab_ops.
                contract_token_stats), policy_loss with the update's token count as normalizer,
                backward (gradients accumulate in fp32 over the micro-batches, as megatron's
                main_grad); then grad clip, optimizer step, and the critic's own update
                (value_coef x value_loss, critic_lr) likewise; an update whose loss or gradient
                norm is not finite is skipped (no update; counted as ``skipped_nonfinite``), as
                megatron does on found-inf. Metrics through learner.step_metrics.
Policy "keep" (stale rollouts trained) requires ``objective.is_cap`` (the run config refuses it
otherwise), applied to every rollout of the step as the megatron backend does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.publication import Publication
from pipeline.backends.megatron_adapter import train_config
from pipeline.backends.reference_critic import ReferenceCritic, clip_and_step, make_optimizer
from proto import Rollout

log = logging.getLogger(__name__)

_KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")  # fmt: skip


class ReferenceTrainer:
    """See the module docstring. ``cfg`` is the whole RunConfig (reads model-independent
    sections: objective, optimizer, rollout, numerics, seed)."""

    def __init__(self, cfg: Any, model_dir: Path) -> None:
        from models.checkpoint import load_model, read_config, tied_from_module
        from models.exits import resolve_kv

        torch.manual_seed(cfg.seed)
        self.model_dir = Path(model_dir)
        self.hf_config = read_config(self.model_dir)
        from models.base import LoopedLM

        self.run_cfg = cfg
        train_config(cfg)  # refuses a learner.micro_batch_size that does not divide the batch
        self.config, model = load_model(self.model_dir)
        assert isinstance(model, LoopedLM)
        k = int(getattr(self.config, "mean_backprop_depth", 0) or 0)
        if cfg.learner.backprop_depth == -1 and 0 < k < model.max_depth:
            from pipeline.config import ConfigError

            raise ConfigError(
                f"run config learner.backprop_depth=-1 means the checkpoint's mean_backprop_depth "
                f"({k} of {model.max_depth} iterations), which backend=reference does not "
                "implement (it backpropagates through every iteration): set "
                "learner.backprop_depth=0 or use backend=megatron"
            )
        self.model: LoopedLM = model
        self.model.train()
        self.tied = tied_from_module(self.model)
        o, r = cfg.objective, cfg.rollout
        self.kind = o.kind
        self.obj = o  # learner.config.ObjectiveConfig, as the megatron backend gets it
        self.normalize_std, self.gamma, self.lam = o.normalize_std, o.gamma, o.lam
        self.temperature, self.top_p, self.numerics = r.temperature, r.top_p, cfg.numerics
        self.kv = resolve_kv(r.policy(), self.config)  # replay the run's exit KV semantics
        p = cfg.optimizer
        self.critic: ReferenceCritic | None = None  # its own network, as megatron's critic
        if o.uses_critic:
            self.critic = ReferenceCritic(self.model_dir, p, cfg.resolved_schedule(), o,
                                          exact=cfg.numerics == "exact")  # fmt: skip
        self.whiten = o.whiten
        self.sched, self.updates = cfg.resolved_schedule(), 0  # the LR of the n-th applied update
        self.ref: LoopedLM | None = None  # frozen reference policy of objective.kl_coef
        self.kl_in_reward = o.kl_in_reward
        if o.kl_coef > 0:
            from pipeline.backends.megatron_adapter import check_reference

            ref_dir = Path(cfg.model.reference_path) if cfg.model.reference_path else self.model_dir
            ref_cfg, ref = load_model(ref_dir)
            check_reference(ref_cfg, self.config, ref_dir)
            self.ref = ref  # type: ignore[assignment]
            ref.eval()
            ref.requires_grad_(False)
        self.grad_clip = p.grad_clip
        self.optim = make_optimizer(self.model.parameters(), p)
        self.steps = 0
        self.epochs, self.minibatches, self.seed = o.epochs, o.minibatches, cfg.seed
        self.skipped = 0  # steps skipped because the loss or the gradient was not finite
        self.last_mismatch: list[float] = []  # per rollout of the last step: max |prox - behav|

    # -- forward ----------------------------------------------------------------------------
    def _forward(self, rolls: Sequence[Rollout], model: Any = None) -> tuple[Tensor, Tensor]:
        """(logits [B, L, V], hidden [B, L, H]) of the policy (or of ``model``) at every input
        position of ``rolls`` (prompt + response[:-1], right-padded: learner.batching's rows)."""
        from models.contract import position_depths
        from models.engine import KVCache, run_chunk

        m = self.model if model is None else model
        full = [int(r.exit_depths[0]) if r.num_tokens else m.max_depth for r in rolls]
        seqs = [[int(t) for t in r.prompt_tokens] + [int(t) for t in r.tokens[:-1]] for r in rolls]
        bsz, length = len(rolls), max(len(s) for s in seqs)
        toks = torch.zeros(bsz, length, dtype=torch.int64)
        deps = torch.ones(bsz, length, dtype=torch.int64)
        for b, (r, s) in enumerate(zip(rolls, seqs)):
            toks[b, : len(s)] = torch.tensor(s, dtype=torch.int64)
            if r.num_tokens:
                deps[b, : len(s)] = torch.from_numpy(
                    position_depths(r.prompt_tokens.shape[0], r.exit_depths)
                )
            else:
                deps[b, : len(s)] = full[b]
        positions = torch.arange(length).expand(bsz, -1)
        valid = positions < torch.tensor([len(s) for s in seqs])[:, None]
        cache = KVCache.empty(m, bsz, length, max(full))
        out = run_chunk(
            m, cache, toks, positions, valid, [int(r.latent_seed) for r in rolls],
            max_depth=max(full), depths=deps, mode=self.numerics, kv=self.kv,
            row_depths=full if self.kv == "full" else None,
        )  # fmt: skip
        return out.logits[..., : m.vocab_size], out.hidden

    def _stats(self, logits: Tensor, mb: Any, old: Tensor | None) -> dict[str, Tensor]:
        """logp, entropy (with the proximal rows ``old``: kl, prox_logp) [B, L], 0 off the
        response, and "rows": the response positions' logits [N, V]; as the megatron learner
        lays them out (learner.vocab_ops.contract_token_stats on the mask's rows)."""
        from learner.vocab_ops import contract_token_stats

        sel = mb.mask > 0
        rows = logits[sel]
        st = contract_token_stats(rows, old, mb.targets[sel], self.temperature, self.top_p,
                                  self.numerics)  # fmt: skip
        out = {k: torch.zeros(sel.shape, dtype=v.dtype).masked_scatter(sel, v)
               for k, v in st.items()}  # fmt: skip
        return out | {"rows": rows}

    # -- training ---------------------------------------------------------------------------
    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool]
    ) -> Mapping[str, float]:
        """One step, as learner.trainer.Trainer.step runs it (module docstring)."""
        from learner.batching import build_batch, sort_rollouts, update_normalizer, update_order
        from learner.objectives import policy_loss
        from learner.step_metrics import StepMetrics, record_policy, row_mismatch

        if not rollouts:
            raise ValueError("trainer.step: no rollouts")
        rolls = sort_rollouts(rollouts)
        batch = build_batch(rolls)
        ranges = self._ranges(rolls)
        tc = train_config(self.run_cfg, ranges[0][1])
        micro = [[(a, min(a + tc.micro_batch_size, hi))
                  for a in range(lo, hi, tc.micro_batch_size)] for lo, hi in ranges]  # fmt: skip
        flow, use_prox = self.kind == "flow_dppo", tc.use_prox
        old_rows, kl_ref = self._pre_update(batch, rolls, micro, use_prox)
        cfg = self.obj  # policy keep requires objective.is_cap (pipeline.config)
        if self.kl_in_reward:  # the KL went into the rewards, not into the loss
            cfg = dataclasses.replace(cfg, kl_coef=0.0)
        metrics = StepMetrics()  # reduced as the megatron trainer reduces its step's metrics
        mismatch = torch.full((batch.size,), -1.0, dtype=torch.float64)
        order = update_order(len(ranges), self.epochs, self.seed, self.steps)
        n_updates, skipped = len(order), 0
        for u, j in enumerate(order):
            lo, hi = ranges[j]
            norm = update_normalizer(batch, lo, hi, cfg.aggregation)
            self.optim.zero_grad(set_to_none=True)
            finite = True
            for i, (a, b) in enumerate(micro[j]):
                logits, _ = self._forward(rolls[a:b])
                mb = batch.rows(a, b)
                first = u == 0 and use_prox  # pre-update weights: this forward is the proximal
                old = logits[mb.mask > 0].detach() if first and flow else old_rows.get((j, i))
                st = self._stats(logits, mb, old)
                rows = st.pop("rows")
                if first:
                    lp0 = st["logp"].detach()
                    batch.extra["prox_logp"][a:b, : lp0.shape[1]] = lp0
                    mb.extra["prox_logp"] = lp0
                    if flow:
                        old_rows[(j, i)] = rows.detach()
                lb: dict[str, Any] = dict(st, mask=mb.mask, behav_logp=mb.behav_logp)
                lb.update(advantages=mb.extra["advantages"], normalizer=norm)
                if use_prox and not flow:
                    lb["prox_logp"] = mb.extra["prox_logp"]
                if "ref_logp" in mb.extra:
                    lb["ref_logp"] = mb.extra["ref_logp"]
                loss, m = policy_loss(cfg, lb)
                loss.backward()
                finite = finite and bool(torch.isfinite(loss.detach()))
                learner = mb.extra.get("prox_logp", st["logp"].detach() if u == 0 else None)
                record_policy(metrics, m, mb.mask, mb.behav_logp, learner, n_updates)
                if learner is not None:
                    row_mismatch(mismatch, a, mb.mask, mb.behav_logp, learner)
            norm_g, ok = clip_and_step(self.optim, finite, self.grad_clip, self.sched,
                                       self.updates + 1, exact=self.numerics == "exact")  # fmt: skip
            self.updates += 1 if ok else 0
            skipped += 0 if ok else 1
            if not ok:  # like megatron's found-inf: no update, weights and optimizer untouched
                log.warning("step %d: an update skipped: loss or grad norm %s not finite; "
                            "weights unchanged", self.steps + 1, norm_g)  # fmt: skip
            metrics.add_mean("grad_norm", norm_g, 1.0)
            metrics.add_mean("lr", float(self.optim.param_groups[0]["lr"]), 1.0)
            if self.critic is not None:  # after the policy's update, as megatron's trainer
                self.critic.update(self._forward, rolls, batch, micro[j], norm, metrics, n_updates)
        self.skipped += skipped
        self.steps += 1
        out: dict[str, float] = metrics.reduce(None)
        out.update(skipped_nonfinite=float(skipped), skipped_nonfinite_total=float(self.skipped),
                   updates=float(n_updates), epochs=float(self.epochs))  # fmt: skip
        if kl_ref is not None:
            out["kl_ref"] = kl_ref
        by_id = {r.rollout_id: float(x) for r, x in zip(rolls, mismatch.tolist())}
        self.last_mismatch = [by_id[r.rollout_id] if by_id[r.rollout_id] >= 0 else float("nan")
                              for r in rollouts]  # fmt: skip
        out["logprob_mismatch"] = out.get("logp_mismatch_max", float("nan"))
        return out

    @torch.no_grad()
    def _pre_update(
        self, batch: Any, rolls: list[Rollout], micro: list[list[tuple[int, int]]], use_prox: bool
    ) -> tuple[dict[tuple[int, int], Tensor], float | None]:
        """With the step's starting weights, in batch.extra (as learner.trainer's pre-update
        passes, micro-batch by micro-batch): the frozen reference's log-probs (or, with
        kl_in_reward, the rewards' penalty), the critic's values and GAE, the advantages
        (whitened with objective.whiten) and the proximal log-probs; returns the proximal
        logits of flow_dppo per (mini-batch, micro-batch) and kl_ref of kl_in_reward. The first
        mini-batch's proximal values come from its first update's forward (the same weights)."""
        from learner.advantages import whiten_tokens
        from learner.batching import gae_advantages, group_token_advantages, penalise_rewards
        from learner.losses import kl_penalty

        zeros = torch.zeros(batch.size, batch.length)
        kl_ref, old_rows = None, {}
        if self.ref is not None:
            ref_lp, pen = zeros.clone(), torch.zeros(batch.size, dtype=torch.float64)
            for a, b in (ab for mbs in micro for ab in mbs):
                mb = batch.rows(a, b)
                lp = self._stats(self._forward(rolls[a:b], model=self.ref)[0], mb, None)["logp"]
                ref_lp[a:b, : lp.shape[1]] = lp
                k = kl_penalty(mb.behav_logp.float(), lp.float(), self.obj.kl_estimator)
                pen[a:b] = torch.where(mb.mask > 0, k, 0.0).sum(dim=1).double()
            if self.kl_in_reward:
                kl_ref = penalise_rewards(batch, pen, self.obj.kl_coef)
            else:
                batch.extra["ref_logp"] = ref_lp
        if self.critic is not None:
            values = zeros.clone()
            for a, b in (ab for mbs in micro for ab in mbs):
                v = self.critic.values(self._forward, rolls[a:b])
                values[a:b, : v.shape[1]] = v
            adv, ret = gae_advantages(batch, values, self.gamma, self.lam)
            batch.extra.update(old_values=values, returns=ret)
        else:
            adv = group_token_advantages(batch, self.normalize_std)
        batch.extra["advantages"] = whiten_tokens(adv, batch.mask) if self.whiten else adv
        if use_prox:
            prox = zeros.clone()
            for j, mbs in enumerate(micro[1:], start=1):
                for i, (a, b) in enumerate(mbs):
                    st = self._stats(self._forward(rolls[a:b])[0], batch.rows(a, b), None)
                    prox[a:b, : st["logp"].shape[1]] = st["logp"]
                    if self.kind == "flow_dppo":
                        old_rows[(j, i)] = st["rows"]
            batch.extra["prox_logp"] = prox
        return old_rows, kl_ref

    def _ranges(self, rolls: list[Rollout]) -> list[tuple[int, int]]:
        """Rows [lo, hi) of the sorted batch per mini-batch: ``minibatches`` equal slices of
        whole groups (work ids), as the megatron trainer's global batches."""
        groups = len({r.work_id for r in rolls})
        k = self.minibatches
        if groups % k or len(rolls) % k:
            raise ValueError(f"objective.minibatches={k} must divide the step's {groups} groups "
                             f"({len(rolls)} rollouts)")  # fmt: skip
        g = len(rolls) // k
        return [(j * g, (j + 1) * g) for j in range(k)]

    # -- weights and checkpoints ------------------------------------------------------------
    def publish(self, out_dir: Path, version: int) -> Publication:
        from models.checkpoint import save_checkpoint, state_dict_for_save
        from models.digest import check_finite

        extra: dict[str, Any] = {
            n: self.model_dir / n for n in _KEEP_FILES if (self.model_dir / n).is_file()
        }
        state = state_dict_for_save(self.model)
        check_finite(state, f"weights v{version}")  # nothing non-finite is even written
        save_checkpoint(state, self.hf_config, out_dir, tied=self.tied, extra_files=extra)
        return Publication.from_dir(out_dir, version)

    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path:
        """RUN_DIR/checkpoints/step_<8 digits>/ {trainer.pt, pipeline_state.json}, written to
        a temporary directory and renamed; then ``latest`` points at it (atomic rename)."""
        root = run_dir / "checkpoints"
        name = f"step_{self.steps:08d}"
        tmp, final = root / f".tmp-{name}", root / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        blob = {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "critic": None if self.critic is None else self.critic.state_dict(),
            "steps": self.steps,
            "updates": self.updates,
            "rng": torch.get_rng_state(),
        }
        torch.save(blob, tmp / "trainer.pt")
        (tmp / "pipeline_state.json").write_text(json.dumps(pipeline_state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(name)
        os.replace(root / "latest.tmp", root / "latest")
        if keep:
            done = sorted(p for p in root.glob("step_*") if p.is_dir())
            for p in done[:-keep]:
                shutil.rmtree(p, ignore_errors=True)
        return final

    def latest(self, run_dir: Path) -> Path | None:
        ptr = run_dir / "checkpoints" / "latest"
        if not ptr.is_file():
            return None
        path = run_dir / "checkpoints" / ptr.read_text().strip()
        return path if (path / "pipeline_state.json").is_file() else None

    def load(self, ckpt: Path) -> dict[str, Any]:
        blob = torch.load(ckpt / "trainer.pt", weights_only=False)
        self.model.load_state_dict(blob["model"])
        self.optim.load_state_dict(blob["optim"])
        if self.critic is not None and blob.get("critic") is not None:
            self.critic.load_state_dict(blob["critic"])
        self.steps = int(blob["steps"])
        self.updates = int(blob.get("updates", self.steps))
        torch.set_rng_state(blob["rng"])
        state: dict[str, Any] = json.loads((ckpt / "pipeline_state.json").read_text())
        return state

    def close(self) -> None:
        pass
