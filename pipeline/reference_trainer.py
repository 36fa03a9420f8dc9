"""A pure-PyTorch trainer on models.reference (backend "reference"): CPU runs and tests.

It implements pipeline.trainer_api.Trainer with the reference forward (models.engine.run_chunk
replaying each rollout's latent seed and exit depths) and learner.objectives, one optimizer
step per call. It stands in until the megatron trainer (learner.trainer) is available and
stays useful as a small, deterministic baseline: same inputs, same thread count -> the same
bits, which is what `looprl replay` relies on.

step(rollouts, flags):
    advantages  grpo/dppo/flow_dppo: group-relative (learner.advantages.group_advantages) over
                the batch's groups (work_id); ppo: GAE on a value head over the sampling
                positions' hidden states, reward on the last token.
    proximal    the pre-update weights are the current ones (one step per batch): prox_logp,
                the KL reference of flow_dppo and ppo's old values are the detached forward.
    update      policy_loss (+ value_coef x value_loss for ppo), grad clip, Adam; a step whose
                loss or gradient norm is not finite is skipped (no update; counted as
                ``skipped_nonfinite``), as megatron does on found-inf.
Rollouts flagged ``needs_correction`` (stale, kept) get ``is_cap`` truncation even for kinds
that only apply it when set (the off-policy correction of policy "keep").
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.publication import Publication
from proto import Rollout

log = logging.getLogger(__name__)

_KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")  # fmt: skip


class ReferenceTrainer:
    """See the module docstring. ``cfg`` is the whole RunConfig (reads model-independent
    sections: objective, optimizer, rollout, numerics, seed)."""

    def __init__(self, cfg: Any, model_dir: Path) -> None:
        from learner.objectives import ObjectiveConfig, ValueLossConfig
        from models.checkpoint import load_model, read_config, tied_from_module

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
        self.obj = ObjectiveConfig(
            kind=o.kind, eps_low=o.eps_low, eps_high=o.eps_high, dual_clip=o.dual_clip,
            is_cap=o.is_cap, is_mode=o.is_mode, kl_threshold=o.kl_threshold,
            kl_coef=o.kl_coef, kl_estimator=o.kl_estimator, entropy_coef=o.entropy_coef,
            aggregation=o.aggregation, temperature=r.temperature,
        )  # fmt: skip
        self.vobj = ValueLossConfig(value_clip=o.value_clip, aggregation=o.aggregation)
        self.normalize_std, self.gamma, self.lam = o.normalize_std, o.gamma, o.lam
        self.value_coef = o.value_coef
        self.temperature, self.top_p, self.numerics = r.temperature, r.top_p, cfg.numerics
        params = list(self.model.parameters())
        self.value_head: torch.nn.Linear | None = None
        if o.kind == "ppo":
            self.value_head = torch.nn.Linear(self.model.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            params += list(self.value_head.parameters())
        p = cfg.optimizer
        self.grad_clip = p.grad_clip
        self.optim = torch.optim.AdamW(
            params, lr=p.lr, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay
        )
        self.steps = 0
        self.skipped = 0  # steps skipped because the loss or the gradient was not finite
        self.last_mismatch: list[float] = []  # per rollout of the last step: max |prox - behav|

    # -- forward ----------------------------------------------------------------------------
    def _forward(self, rolls: Sequence[Rollout]) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs [B, T, V] of the sampled-from distributions, hidden [B, T, H], mask)."""
        from models.contract import position_depths
        from models.engine import KVCache, run_chunk
        from models.reference import behaviour_logprobs

        m = self.model
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
            max_depth=max(full), depths=deps, mode=self.numerics,
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
        from learner.objectives import policy_loss, value_loss

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
        # One optimizer step per batch: the proximal (pre-update) policy is the current one,
        # so a single forward serves both (prox = detached logp; old values detached too).
        lp_all, hid, mask = self._forward(rolls)
        old_lp = lp_all.detach()
        logp = lp_all.gather(-1, targets[..., None])[..., 0]
        prox = logp.detach()
        old_values = None
        if self.value_head is not None:
            old_values = self.value_head(hid)[..., 0].detach()
        batch: dict[str, Any] = {"mask": mask, "logp": logp, "behav_logp": behav,
                                 "prox_logp": prox}  # fmt: skip
        if self.kind == "ppo":
            assert old_values is not None and self.value_head is not None
            tok_r = torch.zeros(bsz, tmax)
            for b, r in enumerate(rolls):
                tok_r[b, max(r.num_tokens - 1, 0)] = rewards[b]
            adv, returns = gae(tok_r, old_values, mask, self.gamma, self.lam)
            batch["advantages"] = adv
        else:
            ids: dict[str, int] = {}
            gid = torch.tensor([ids.setdefault(r.work_id, len(ids)) for r in rolls])
            adv_b = group_advantages(rewards, gid, self.normalize_std)
            batch["advantages"] = adv_b if self.kind == "grpo" else broadcast_to_tokens(adv_b, mask)
        if self.kind == "flow_dppo":
            p_old = old_lp.exp()
            fin = torch.isfinite(old_lp) & torch.isfinite(lp_all)
            diff = torch.where(fin, old_lp - lp_all, 0.0)
            batch["kl"] = (torch.where(fin, p_old, 0.0) * diff).sum(-1)
        if self.obj.entropy_coef > 0:
            p = lp_all.exp()
            batch["entropy"] = -torch.where(torch.isfinite(lp_all), p * lp_all, 0.0).sum(-1)
        cfg = self.obj
        if any(needs_correction) and cfg.is_cap is None:
            from dataclasses import replace

            cfg = replace(cfg, is_cap=2.0)
        loss, metrics = policy_loss(cfg, batch)
        out = dict(metrics)
        if self.kind == "ppo":
            assert self.value_head is not None and old_values is not None
            vbatch = {"mask": mask, "values": self.value_head(hid)[..., 0],
                      "old_values": old_values, "returns": returns}  # fmt: skip
            vloss, vm = value_loss(self.vobj, vbatch)
            loss = loss + self.value_coef * vloss
            out.update(vm)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optim.param_groups for p in g["params"]]
        clip = self.grad_clip if self.grad_clip > 0 else float("inf")
        out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, clip))
        finite = bool(torch.isfinite(loss.detach())) and math.isfinite(out["grad_norm"])
        if finite:
            self.optim.step()
        else:  # like megatron's found-inf: no update, weights and optimizer state untouched
            self.optim.zero_grad(set_to_none=True)
            self.skipped += 1
            log.warning("step %d skipped: loss %s, grad norm %s (not finite); weights unchanged",
                        self.steps + 1, float(loss.detach()), out["grad_norm"])  # fmt: skip
        out["skipped_nonfinite"] = 0.0 if finite else 1.0
        out["skipped_nonfinite_total"] = float(self.skipped)
        self.steps += 1
        live = mask > 0
        diff = torch.where(live, (prox - behav).abs(), 0.0)
        self.last_mismatch = [float(x) for x in diff.max(dim=1).values]
        out["logprob_mismatch"] = float(diff.max())
        out["total_loss"] = float(loss.detach())
        return out

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
            "value_head": None if self.value_head is None else self.value_head.state_dict(),
            "steps": self.steps,
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
        if self.value_head is not None and blob["value_head"] is not None:
            self.value_head.load_state_dict(blob["value_head"])
        self.steps = int(blob["steps"])
        torch.set_rng_state(blob["rng"])
        state: dict[str, Any] = json.loads((ckpt / "pipeline_state.json").read_text())
        return state

    def close(self) -> None:
        pass
