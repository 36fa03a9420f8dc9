"""A pure-PyTorch trainer on models.reference (backend "reference"): CPU runs and tests.

It implements pipeline.backends.trainer_api.Trainer with the reference forward (models.engine.run_chunk
replaying each rollout's latent seed and exit depths) and learner.objectives, one optimizer
step per call. It stands in until the megatron trainer (learner.trainer) is available and
stays useful as a small, deterministic baseline: same inputs, same thread count -> the same
bits, which is what `looprl replay` relies on.

step(rollouts, flags):
    advantages  grpo/dppo/flow_dppo: group-relative (learner.advantages.group_advantages) over
                the batch's groups (work_id); with a critic (ppo, objective.critic): GAE on
                the values of a separate critic network (pipeline.backends.reference_critic, as the
                megatron backend's), reward on the last token.
    proximal    the pre-update weights are the current ones (one step per batch): prox_logp,
                the KL reference of flow_dppo and ppo's old values are the detached forward.
    update      policy_loss, grad clip, optimizer step; then the critic's own update
                (value_coef x value_loss, critic_lr); an update whose
                loss or gradient norm is not finite is skipped (no update; counted as
                ``skipped_nonfinite``), as megatron does on found-inf.
Policy "keep" (stale rollouts trained) requires ``objective.is_cap`` (the run config refuses it
otherwise), applied to every rollout of the step as the megatron backend does.
"""

from __future__ import annotations

import contextlib
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
from pipeline.backends.reference_critic import ReferenceCritic, clip_and_step, make_optimizer
from proto import Rollout

log = logging.getLogger(__name__)
_PER_UPDATE = ("grad_norm", "lr", "critic_grad_norm", "critic_lr")
_SHARES = ("loss", "pg_loss", "num_tokens", "value_loss", "total_loss")

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
    def _forward(
        self, rolls: Sequence[Rollout], model: Any = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs [B, T, V] of the sampled-from distributions, hidden [B, T, H], mask) of
        the policy (or of ``model``: the frozen reference policy)."""
        from models.contract import position_depths
        from models.engine import KVCache, run_chunk
        from models.reference import behaviour_logprobs

        m = self.model if model is None else model
        full = [int(r.exit_depths[0]) if r.num_tokens else m.max_depth for r in rolls]
        seqs = [[int(t) for t in r.prompt_tokens] + [int(t) for t in r.tokens[:-1]] for r in rolls]
        bsz, length = len(rolls), max(len(s) for s in seqs)
        tmax = max(max(r.num_tokens for r in rolls), 1)
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
        vocab = m.vocab_size
        mask = torch.zeros(bsz, tmax)
        rows_lp, rows_h = [], []
        for b, r in enumerate(rolls):
            plen, n = r.prompt_tokens.shape[0], r.num_tokens
            rows = slice(plen - 1, plen - 1 + n)
            pad = tmax - n
            x = behaviour_logprobs(out.logits[b, rows], vocab, self.temperature, self.top_p,
                                   self.numerics)  # fmt: skip
            rows_lp.append(torch.nn.functional.pad(x, (0, 0, 0, pad)))
            rows_h.append(torch.nn.functional.pad(out.hidden[b, rows], (0, 0, 0, pad)))
            mask[b, :n] = 1.0
        lp = torch.stack(rows_lp)
        hid = torch.stack(rows_h)
        return lp, hid, mask

    # -- training ---------------------------------------------------------------------------
    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool]
    ) -> Mapping[str, float]:
        from learner.advantages import broadcast_to_tokens, gae, group_advantages

        rolls = list(rollouts)
        if not rolls:
            raise ValueError("trainer.step: no rollouts")
        bsz = len(rolls)
        tmax = max(max(r.num_tokens for r in rolls), 1)
        targets = torch.zeros(bsz, tmax, dtype=torch.int64)
        behav = torch.zeros(bsz, tmax)
        for b, r in enumerate(rolls):
            targets[b, : r.num_tokens] = torch.from_numpy(r.tokens.astype("int64"))
            behav[b, : r.num_tokens] = torch.from_numpy(r.logprobs.astype("float32"))
        rewards = torch.tensor([float(r.reward or 0.0) for r in rolls], dtype=torch.float32)
        # The step's starting weights give the proximal log-probs, the flow_dppo reference
        # and the critic's old values. One update per step: that forward is also the training
        # forward (prox = its detached log-probs); several: a no-grad pass first.
        multi = self.epochs > 1 or self.minibatches > 1
        with torch.no_grad() if multi else contextlib.nullcontext():
            lp0, _, mask = self._forward(rolls)
        old_lp = lp0.detach()
        prox = old_lp.gather(-1, targets[..., None])[..., 0]
        old_values = None
        if self.critic is not None:  # the pre-update critic's values (no grad)
            with torch.no_grad():
                old_values = self.critic.values(self._forward, rolls)
        ref_logp, kl_ref = None, None
        if self.ref is not None:
            from learner.losses import kl_penalty

            with torch.no_grad():
                lpr, _, _ = self._forward(rolls, model=self.ref)
            ref_logp = lpr.gather(-1, targets[..., None])[..., 0]
            if self.kl_in_reward:  # per-sequence penalty on the sampled tokens' estimate
                kl_tok = torch.where(
                    mask > 0, kl_penalty(behav, ref_logp, self.obj.kl_estimator), 0.0
                )
                pen = kl_tok.sum(dim=1)
                kl_ref = float((pen / (mask > 0).sum(dim=1).clamp_min(1)).mean())
                rewards = rewards - self.obj.kl_coef * pen
        returns = None
        if old_values is not None:  # a critic: GAE advantages (ppo, or objective.critic)
            tok_r = torch.zeros(bsz, tmax)
            for b, r in enumerate(rolls):
                tok_r[b, max(r.num_tokens - 1, 0)] = rewards[b]
            adv, returns = gae(tok_r, old_values, mask, self.gamma, self.lam)
        else:
            ids: dict[str, int] = {}
            gid = torch.tensor([ids.setdefault(r.work_id, len(ids)) for r in rolls])
            adv_b = group_advantages(rewards, gid, self.normalize_std)
            adv = adv_b if self.kind == "grpo" else broadcast_to_tokens(adv_b, mask)
        if self.whiten:  # over the step's response tokens, as the megatron trainer does
            tok = adv if adv.dim() == 2 else broadcast_to_tokens(adv, mask)
            w = (mask > 0).to(torch.float64)
            total = w.sum().clamp_min(torch.finfo(torch.float64).tiny)
            mean = (tok.double() * w).sum() / total
            var = ((tok.double() ** 2) * w).sum() / total - mean * mean
            std = var.clamp_min(0).sqrt()
            adv = torch.where(mask > 0, (tok.double() - mean) / (std + 1e-6), 0.0).float()
        cfg = self.obj  # policy keep requires objective.is_cap (pipeline.config)
        if self.kl_in_reward:  # the KL went into the rewards, not into the loss
            from dataclasses import replace

            cfg = replace(cfg, kl_coef=0.0)
        from learner.step_metrics import StepMetrics

        metrics = StepMetrics()  # reduced as the megatron trainer reduces its step's metrics
        schedule = self._schedule(rolls)
        skipped = 0
        for idx in schedule:
            if multi:
                lp, _, _ = self._forward([rolls[i] for i in idx])
            else:
                lp = lp0
            t = lp.shape[1]
            rows = torch.tensor(idx)
            sub = {"mask": mask[rows, :t], "targets": targets[rows, :t],
                   "behav": behav[rows, :t], "prox": prox[rows, :t], "old_lp": old_lp[rows, :t],
                   "adv": adv[rows] if adv.dim() == 1 else adv[rows, :t]}  # fmt: skip
            if old_values is not None and returns is not None:
                sub.update(old_values=old_values[rows, :t], returns=returns[rows, :t])
            if ref_logp is not None and not self.kl_in_reward:
                sub["ref_logp"] = ref_logp[rows, :t]
            m, finite = self._update(cfg, lp, sub)
            if self.critic is not None:  # after the policy's update, as megatron's trainer
                m.update(self.critic.update(self._forward, [rolls[i] for i in idx], sub))
            skipped += 0 if finite else 1
            tokens = float((sub["mask"] > 0).sum())
            for k, v in m.items():
                if k in _PER_UPDATE:  # the optimizer's own numbers: a mean over updates
                    metrics.add_mean(k, float(v), 1.0)
                elif k in _SHARES:  # shares of a global sum: a mean per update
                    metrics.add_sum(k, float(v) / len(schedule))
                else:  # token means
                    metrics.add_mean(k, float(v), tokens)
        self.skipped += skipped
        self.steps += 1
        out: dict[str, float] = metrics.reduce(None)
        out["skipped_nonfinite"] = float(skipped)
        out["skipped_nonfinite_total"] = float(self.skipped)
        out["updates"] = float(len(schedule))
        if kl_ref is not None:
            out["kl_ref"] = kl_ref
        live = mask > 0
        diff = torch.where(live, (prox - behav).abs(), 0.0)
        self.last_mismatch = [float(x) for x in diff.max(dim=1).values]
        out["logprob_mismatch"] = float(diff.max())
        return out

    def _schedule(self, rolls: list[Rollout]) -> list[list[int]]:
        """Row indices of every update: ``epochs`` passes over ``minibatches`` mini-batches
        of whole groups (work ids in batch order), the first pass in order, later passes in
        an order shuffled by (seed, step, epoch)."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(rolls):
            groups.setdefault(r.work_id, []).append(i)
        glist = list(groups.values())
        k = self.minibatches
        if len(glist) % k:
            raise ValueError(
                f"objective.minibatches={k} must divide the step's {len(glist)} groups"
            )
        per = len(glist) // k
        mbs = [[i for g in glist[j * per : (j + 1) * per] for i in g] for j in range(k)]
        out = list(mbs)
        for e in range(1, self.epochs):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps * 101 + e)
            out += [mbs[j] for j in torch.randperm(k, generator=gen).tolist()]
        return out

    def _update(
        self, cfg: Any, lp_all: Tensor, sub: dict[str, Tensor]
    ) -> tuple[dict[str, float], bool]:
        """One policy update on a mini-batch: policy loss, grad clip, optimizer step; skipped
        (weights untouched) when the loss or grad norm is not finite."""
        from learner.objectives import policy_loss

        mask = sub["mask"]
        logp = lp_all.gather(-1, sub["targets"][..., None])[..., 0]
        batch: dict[str, Any] = {"mask": mask, "logp": logp, "behav_logp": sub["behav"],
                                 "prox_logp": sub["prox"], "advantages": sub["adv"]}  # fmt: skip
        if "ref_logp" in sub:
            batch["ref_logp"] = sub["ref_logp"]
        if self.kind == "flow_dppo":
            old_lp = sub["old_lp"]
            p_old = old_lp.exp()
            fin = torch.isfinite(old_lp) & torch.isfinite(lp_all)
            diff = torch.where(fin, old_lp - lp_all, 0.0)
            batch["kl"] = (torch.where(fin, p_old, 0.0) * diff).sum(-1)
        if self.obj.entropy_coef > 0:
            p = lp_all.exp()
            batch["entropy"] = -torch.where(torch.isfinite(lp_all), p * lp_all, 0.0).sum(-1)
        loss, metrics = policy_loss(cfg, batch)
        out = {k: float(v) for k, v in metrics.items()}
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        out["grad_norm"], finite = clip_and_step(self.optim, loss, self.grad_clip, self.sched,
                                                 self.updates + 1,
                                                 exact=self.numerics == "exact")  # fmt: skip
        if finite:
            self.updates += 1
        else:  # like megatron's found-inf: no update, weights and optimizer state untouched
            log.warning("step %d: an update skipped: loss %s, grad norm %s (not finite); "
                        "weights unchanged", self.steps + 1, float(loss.detach()),
                        out["grad_norm"])  # fmt: skip
        out["total_loss"] = float(loss.detach())
        out["lr"] = float(self.optim.param_groups[0]["lr"])
        return out, finite

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
