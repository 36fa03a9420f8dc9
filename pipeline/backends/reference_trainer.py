"""Backend "reference": learner.step.LearnerStep over learner.torch_policy.TorchPolicy.

The plain-PyTorch policy (models.engine.chunk replaying each row's latent seed and exit depths,
torch optimizers) runs the learner's one step (learner.step) like the megatron backend; it is
the independent forward that checks megatron (tests/pipeline/test_epochs.py: the same bits in
numerics exact) and a small deterministic backend for CPU runs (same inputs, same thread count
-> the same bits: `looprl replay` relies on it). This adapter maps the run config onto the
learner's typed configs (pipeline.backends.learner_configs), sizes each step's updates by its
rollouts (``objective.minibatches`` equal slices of whole groups), and writes publications and
checkpoints (RUN_DIR/checkpoints/step_<8 digits>/{trainer.pt, pipeline_state.json}).
Policy "keep" (stale rollouts trained) requires ``objective.is_cap`` (the run config refuses it
otherwise), applied to every rollout of the step as the megatron backend does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from learner.batching import sort_rollouts
from learner.lora import apply_lora, frozen_weights, merged_state
from learner.peft_adapter import write_peft
from learner.step import LearnerStep
from learner.torch_policy import TorchPolicy
from models.base import LoopedLM
from models.checkpoint import load_model, read_config, save_checkpoint, state_dict_for_save
from models.errors import ConfigError
from models.exits import resolve_kv
from models.ties import detached_copy, tied_from_module
from pipeline.backends.audit import BehaviourAudit
from pipeline.backends.learner_configs import check_reference, critic_optim, train_config
from pipeline.backends.results import SnapshotResult, StepResult
from pipeline.config.run import RunConfig
from proto.records import Rollout
from weights.adapters import AdapterLine
from weights.digest import check_finite
from weights.publication import Publication

log = logging.getLogger(__name__)

_KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")  # fmt: skip


def _looped(path: Path) -> tuple[Any, LoopedLM]:
    config, model = load_model(path)
    assert isinstance(model, LoopedLM)
    return config, model


class ReferenceTrainer:
    """See the module docstring."""

    def __init__(self, cfg: RunConfig, model_dir: Path) -> None:
        torch.manual_seed(cfg.seed)
        self.model_dir = Path(model_dir)
        self.hf_config = read_config(self.model_dir)
        self.run_cfg = cfg
        tc = train_config(cfg)  # refuses a learner.micro_batch_size that does not divide the batch
        self.config, model = _looped(self.model_dir)
        k = int(getattr(self.config, "mean_backprop_depth", 0) or 0)
        if cfg.learner.backprop_depth == -1 and 0 < k < model.max_depth:
            raise ConfigError(
                f"run config learner.backprop_depth=-1 means the checkpoint's mean_backprop_depth "
                f"({k} of {model.max_depth} iterations), which backend=reference does not "
                "implement (it backpropagates through every iteration): set "
                "learner.backprop_depth=0 or use backend=megatron"
            )
        self.tied = tied_from_module(model)
        lora = cfg.learner.lora
        self.adapters = apply_lora(model, lora, cfg.seed) if lora.on else None
        """learner.lora's adapters (learner.lora.rank > 0): the base frozen, A and B trained."""
        self.line = (AdapterLine(cfg.run_dir, lora.scale)
                     if lora.on and lora.publish == "adapters" else None)  # fmt: skip
        """learner.lora.publish=adapters: each version's adapter set (weights.adapters)."""
        o = cfg.objective
        reference = None
        if o.kl_coef > 0:  # the frozen reference policy of the KL term
            ref_dir = Path(cfg.model.reference_path) if cfg.model.reference_path else self.model_dir
            ref_cfg, reference = _looped(ref_dir)
            check_reference(ref_cfg, self.config, ref_dir)
        c_optim, c_schedule = critic_optim(cfg)
        self.policy = TorchPolicy(
            tc, model, cfg.optimizer, cfg.resolved_schedule(),
            kv=resolve_kv(cfg.rollout.parsed_policy, self.config),  # replay the run's exit KV
            critic=_looped(self.model_dir)[1] if o.uses_critic else None,
            critic_optim=c_optim, critic_schedule=c_schedule, reference=reference,
        )  # fmt: skip
        self.runner = LearnerStep(tc, self.policy)
        self.model = self.policy.model
        self.audits = BehaviourAudit(cfg, cfg.run_dir)

    def audit(self, rollouts: Sequence[Rollout]) -> list[float | None]:
        """Rule logp_mismatch's audit of stale rollouts over their bound (pipeline.backends.audit:
        this backend's forward at the published weights that sampled them)."""
        return self.audits(rollouts)

    @property
    def steps(self) -> int:
        return self.runner.step_count

    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
        logp_bounds: Sequence[float] | None = None,
    ) -> StepResult:  # fmt: skip
        """learner.step's step, with ``objective.minibatches`` updates of whole groups.
        ``logp_bounds``: learner.step's verified rollouts (a rollout over its bound refuses
        the step before any update: ``StepResult.refused``)."""
        if not rollouts:
            raise ValueError("trainer.step: no rollouts")
        rolls = sort_rollouts(rollouts)
        groups, k = len({r.work_id for r in rolls}), self.run_cfg.objective.minibatches
        if groups % k or len(rolls) % k:
            raise ValueError(f"objective.minibatches={k} must divide the step's {groups} groups "
                             f"({len(rolls)} rollouts)")  # fmt: skip
        out = self.runner.step(rollouts, train_config(self.run_cfg, len(rolls) // k),
                               logp_bounds=logp_bounds)  # fmt: skip
        mismatch = [m if m >= 0 else math.nan for m in self.runner.last_mismatch]
        return StepResult(out, list(self.runner.last_refused), mismatch)

    # -- weights and checkpoints ------------------------------------------------------------
    def publish(self, out_dir: Path, version: int) -> Publication:
        return self.snapshot(out_dir, version).finish()

    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult:
        """The weights copied now (ties kept); ``finish()`` writes and reads them back."""
        extra: dict[str, Any] = {
            n: self.model_dir / n for n in _KEEP_FILES if (self.model_dir / n).is_file()
        }
        own = state_dict_for_save(self.model) if self.adapters is None else merged_state(self.model)
        state = detached_copy(own)  # the next step trains on
        check_finite(state, f"weights v{version}")  # nothing non-finite is even written
        line, ad = self.line, self.adapters
        if line is not None:  # learner.lora.publish=adapters: this version's adapter set
            assert ad is not None
            factors, frozen = ad.factor_copies(), frozen_weights(self.model, ad)

        def finish() -> Publication:
            save_checkpoint(state, self.hf_config, out_dir, tied=self.tied, extra_files=extra)
            pub = Publication.from_dir(out_dir, version)
            if line is None:
                return pub
            assert ad is not None
            return line.publication(pub, factors, frozen, list(ad.norms))

        return SnapshotResult(finish)

    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path:
        """RUN_DIR/checkpoints/step_<8 digits>/ {trainer.pt, pipeline_state.json} (and, with
        adapters, adapter/: learner.peft_adapter), written to a temporary directory and renamed; then ``latest`` points at it (atomic rename)."""
        root = run_dir / "checkpoints"
        name = f"step_{self.steps:08d}"
        tmp, final = root / f".tmp-{name}", root / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        pol, run = self.policy, self.runner
        blob = {
            "model": self.model.state_dict(),
            "optim": pol.policy.opt.state_dict(),
            "critic": None if pol.critic is None else pol.critic.state_dict(),
            "steps": run.step_count,
            "updates": pol.policy.updates,
            "update_count": run.update_count,
            "weight_version": run.weight_version,
            "skipped_nonfinite": pol.policy.skipped_nonfinite,
            "rng": torch.get_rng_state(),
            "loop_weights": None if run.loop_weights is None else run.loop_weights.state_dict(),
        }
        torch.save(blob, tmp / "trainer.pt")
        (tmp / "pipeline_state.json").write_text(json.dumps(pipeline_state))
        if self.adapters is not None:  # the adapters for Hugging Face users (PEFT layout)
            write_peft(tmp / "adapter", self.adapters, str(self.model_dir))
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
        pol, run = self.policy, self.runner
        self.model.load_state_dict(blob["model"])
        pol.policy.opt.load_state_dict(blob["optim"])
        run.step_count = int(blob["steps"])
        pol.policy.updates = int(blob.get("updates", run.step_count))
        pol.policy.skipped_nonfinite = int(blob.get("skipped_nonfinite", 0))
        run.update_count = int(blob.get("update_count", pol.policy.updates))
        run.weight_version = int(blob.get("weight_version", run.step_count))
        critic = blob.get("critic")
        if pol.critic is not None and critic is not None:
            if "head" in critic:  # written before learner.torch_policy: trunk and head apart
                heads = {f"head.{k}": v for k, v in critic["head"].items()}
                critic = dict(critic, model={f"model.{k}": v for k, v in critic["model"].items()}
                              | heads)  # fmt: skip
            pol.critic.load_state_dict(critic)
        if run.loop_weights is not None and blob.get("loop_weights") is not None:
            run.loop_weights.load_state_dict(blob["loop_weights"])
        torch.set_rng_state(blob["rng"])
        state: dict[str, Any] = json.loads((ckpt / "pipeline_state.json").read_text())
        return state

    def close(self) -> None:
        pass
