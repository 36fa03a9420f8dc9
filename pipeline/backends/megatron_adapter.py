"""Backend "megatron": learner.trainer.Trainer behind the coordinator's Trainer protocol.

Hands the run config's learner-owned sections (objective, optimizer, schedule, learner: they
are learner.config's classes) to the Trainer, with the step's TrainConfig and, from the
``learner`` section, MegatronOptions (precision, backprop depth, compile; `build_learner_trainer`,
shared with benchmarks/trainer_gpu.py), builds the looped policy (and, for ppo, the critic) on megatron-core from the starting HF checkpoint,
and forwards step / publish / checkpoint calls to learner.trainer, learner.publish and
learner.checkpoint (which stores the coordinator's pipeline_state in its meta.json).

With several ranks (torchrun) every rank must run the same calls with the same rollouts:
pipeline.backends.ranks wraps rank 0's trainer (``Leader``) and runs the others (``follow``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from learner import checkpoint as learner_checkpoint
from learner.hf_convert import gather_hf_state
from learner.megatron.lora import frozen_hf_weights, megatron_adapters
from learner.megatron.options import MegatronOptions
from learner.model_specs import looped_critic_spec, looped_policy_spec
from learner.parallel import destroy_distributed, init_distributed
from learner.peft_adapter import write_peft
from learner.publish import looped_exporter, publication_state, snapshot_publication
from learner.replay import unwrap
from learner.trainer import Trainer
from models.checkpoint import json_bytes, load_checkpoint, load_config
from models.exits import resolve_kv
from pipeline.backends.audit import BehaviourAudit
from pipeline.backends.learner_configs import check_reference, critic_optim, train_config
from pipeline.backends.results import SnapshotResult, StepResult
from pipeline.config.run import RunConfig
from proto.records import Rollout
from weights.adapters import AdapterLine
from weights.digest import check_finite
from weights.publication import DeviceAdapter, DeviceSnapshot, Publication

log = logging.getLogger(__name__)


class MegatronTrainer:
    """See the module docstring."""

    def __init__(self, cfg: RunConfig, model_dir: Path) -> None:
        if not ps.model_parallel_is_initialized():
            init_distributed(cfg.tp, seed=cfg.seed)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model_config = load_config(model_dir)
        _, hf_state = load_checkpoint(model_dir)
        ref_state = None
        if cfg.objective.kl_coef > 0:  # the frozen reference policy of the KL term
            ref_dir = Path(cfg.model.reference_path) if cfg.model.reference_path else model_dir
            check_reference(load_config(ref_dir), self.model_config, ref_dir)
            ref_state = load_checkpoint(ref_dir)[1]
        self.trainer = build_learner_trainer(cfg, self.model_config, hf_state, ref_state=ref_state)
        self.lora, self.model_dir = cfg.learner.lora, Path(model_dir)
        self.line = (AdapterLine(cfg.run_dir, self.lora.scale)
                     if self.lora.on and self.lora.publish == "adapters" else None)  # fmt: skip
        self.device_adapters = (cfg.publish.transport == "cuda_ipc"
                                and cfg.publish.directories == "when_free"
                                and torch.cuda.is_available())  # fmt: skip
        """Adapter versions announced from the card (``_adapter_snapshot``)."""
        """learner.lora.publish=adapters: each version's adapter set (weights.adapters)."""
        self.is_cap = cfg.objective.is_cap
        self.audits = BehaviourAudit(cfg, cfg.run_dir)

    def audit(self, rollouts: Sequence[Rollout]) -> list[float | None]:
        """Rule logp_mismatch's audit of stale rollouts over their bound (pipeline.backends.audit:
        the reference forward at the published weights that sampled them, on rank 0 alone;
        no collective)."""
        return self.audits(rollouts)

    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
        logp_bounds: Sequence[float] | None = None,
    ) -> StepResult:  # fmt: skip
        """learner.step's step; ``logp_bounds``: its verified rollouts (a rollout over its
        bound refuses the step before any update: ``StepResult.refused``)."""
        # policy keep requires objective.is_cap (pipeline.config.run), applied to every rollout
        out = dict(self.trainer.step(list(rollouts), logp_bounds=logp_bounds))
        # per rollout: the numerics mismatch (the coordinator's fresh-rollout metric, its checks)
        mismatch = [m if m >= 0 else float("nan") for m in self.trainer.last_mismatch]
        return StepResult(out, list(self.trainer.last_refused), mismatch)

    def publish(self, out_dir: Path, version: int) -> Publication | None:
        """The Publication on learner rank 0 (None on the other ranks, which only take part);
        the gather's seconds join its ``stage_s`` (``time/publish_gather``)."""
        taken = self.snapshot(out_dir, version)
        if taken is None:
            return None
        pub = taken.finish()
        pub.stage_s.update(taken.stage_s)
        return pub

    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult | None:
        """The gather now (every rank), the hash and write as rank 0's ``finish()``; the
        gather's seconds in ``stage_s["gather"]`` (the HF state gathered over TP; the rest of
        ``time/publish`` casts, hashes, writes)."""
        stages: dict[str, float] = {}

        def timed_export(model: Any) -> Any:
            t0 = time.perf_counter()
            out = looped_exporter(model)
            stages["gather"] = time.perf_counter() - t0
            return out

        if self.line is not None and self.device_adapters:
            return self._adapter_snapshot(out_dir, version, stages)
        finish = snapshot_publication(self.trainer.policy_model, out_dir, version,
                                      config=self.model_config.to_hf_dict(),
                                      exporter=timed_export)  # fmt: skip
        if finish is None:
            if self.rank == 0:
                raise RuntimeError("publish: learner rank 0 got no Publication")
            return None
        line = self.line
        if line is None:  # the GPU copy too (cuda_ipc announces from it: weights.cuda_ipc)
            return SnapshotResult(finish, stages, getattr(finish, "device", None))
        # learner.lora.publish=adapters: this version's adapter set (weights.adapters)
        model = unwrap(self.trainer.policy_model)
        ad = megatron_adapters(model, self.lora)
        factors, norms = ad.factor_copies(), list(ad.norms)
        frozen = frozen_hf_weights(model, list(ad.factors)) if line.base is None else {}
        # (the host's path, publish.directories every; the device's takes the base once itself)
        full = finish

        def with_adapters() -> Publication:
            return line.publication(full(), factors, frozen, norms)

        return SnapshotResult(with_adapters, stages)

    def _adapter_snapshot(
        self, out_dir: Path, version: int, stages: dict[str, float]
    ) -> SnapshotResult | None:
        """An adapter version announced from the card (publish.transport cuda_ipc, directories
        when_free: weights.cuda_ipc "Adapters"): the factors and the tensors trained in full
        copied now (megabytes), the whole set exported only when the publisher packs its base
        (its first version), each adapted module's frozen weight when it packs it; no copy of
        the set. NonFiniteWeightsError for factors or norms that are not finite."""
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_rank() != 0 or self.rank != 0:
            return None
        model = unwrap(self.trainer.policy_model)
        t0 = time.perf_counter()
        ad = megatron_adapters(model, self.lora)
        factors = ad.factor_copies()
        full = {n: t.detach().clone() for n, t in gather_hf_state(model, only=list(ad.norms)).items()
                if n in ad.norms}  # fmt: skip
        check_finite({**{f"{m}.lora_{k}": t for m, (a, b) in factors.items()
                         for k, t in (("A", a), ("B", b))}, **full})  # fmt: skip
        ready = torch.cuda.Event() if torch.cuda.is_available() else None
        if ready is not None:
            ready.record()  # after the copies, on the trainer's stream
        stages["gather"] = time.perf_counter() - t0

        def base_weight(m: str) -> torch.Tensor:
            return frozen_hf_weights(model, [m])[f"{m}.weight"]

        def whole() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            return publication_state(model, on_device=True)

        config = json_bytes(self.model_config.to_hf_dict()).decode("utf-8")
        snap = DeviceSnapshot(version, full, {}, config, Path(out_dir), ready, adapter=DeviceAdapter(
            factors, list(ad.norms), base_weight, self.lora.scale, whole))  # fmt: skip

        def host() -> Publication:
            raise RuntimeError(f"weights v{version}: an adapter version under publish."
                               "directories=when_free is announced from the device only")  # fmt: skip

        return SnapshotResult(host, stages, snap)

    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path:
        """learner.checkpoint's; with adapters, rank 0 then adds adapter/ (learner.peft_adapter:
        the PEFT layout, for Hugging Face users; resuming reads the checkpoint only)."""
        path = learner_checkpoint.save(
            self.trainer, run_dir, pipeline_state=pipeline_state, keep_last=max(keep, 1)
        )
        if self.lora.on and self.rank == 0:
            adapters = megatron_adapters(unwrap(self.trainer.policy_model), self.lora)
            write_peft(path / "adapter", adapters, str(self.model_dir))
        return path

    def latest(self, run_dir: Path) -> Path | None:
        return learner_checkpoint.latest(run_dir)

    def load(self, ckpt: Path) -> dict[str, Any]:
        return dict(learner_checkpoint.load(self.trainer, ckpt).pipeline_state)

    def close(self) -> None:
        destroy_distributed()


def build_learner_trainer(
    cfg: RunConfig, model_config: Any, hf_state: Any, *, ref_state: Any = None
) -> Trainer:
    """learner.trainer.Trainer of the RunConfig `cfg` (distributed already initialised):
    the mapping of the run config onto learner.config and MegatronOptions. hf_state: the
    starting HF state dict (None: the reference init). benchmarks/trainer_gpu.py uses it too."""
    o, r, p, lr = cfg.objective, cfg.rollout, cfg.optimizer, cfg.learner
    critic = o.uses_critic
    train = train_config(cfg)
    options = MegatronOptions(
        numerics=cfg.numerics,
        params_dtype=torch.bfloat16 if lr.precision == "bf16" else torch.float32,
        backprop_depth=None if lr.backprop_depth < 0 else lr.backprop_depth,
        compile=lr.compiled,
        kv=resolve_kv(r.parsed_policy, model_config),  # replay the run's exit KV semantics
    )
    schedule = cfg.resolved_schedule()
    c_optim, c_schedule = critic_optim(cfg)
    return Trainer(
        train, p, schedule,
        looped_policy_spec(model_config, options, hf_state, lora=lr.lora, lora_seed=cfg.seed),
        critic=looped_critic_spec(model_config, options, hf_state) if critic else None,
        critic_optim=c_optim, critic_schedule=c_schedule,
        reference=looped_policy_spec(model_config, options, ref_state)
        if o.kl_coef > 0 else None,
    )  # fmt: skip
