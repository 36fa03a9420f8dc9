"""The learner's trainer on megatron-core: `learner.step.LearnerStep` over `MegatronPolicy`.

Order of calls (every rank runs the same calls with the same rollouts):

    info = learner.parallel.init_distributed(tp)
    trainer = Trainer(train_cfg, optim_cfg, schedule_cfg, looped_policy_spec(model_config),
                      critic=..., critic_optim=..., critic_schedule=...)
    learner.checkpoint.load(trainer, path)      # optional: resume
    metrics = trainer.step(rollouts)            # k x global_batch_size rollouts -> k updates
    learner.publish.publish(trainer.policy_model, weights_dir(run_dir, v), v)
    learner.checkpoint.save(trainer, run_dir, ...)

The step itself (advantages, proximal pass, epochs x mini-batches x micro-batches, the
finiteness skip, the critic update, metrics) is learner.step's, shared with the plain-PyTorch
policy (learner.torch_policy). What is megatron's here: the networks (`learner.network.Network`:
Megatron DDP, the megatron optimizer, the LR schedule, the DP gradient all-reduce and the
every-rank finiteness check), the data-parallel group, and the token statistics of a
`PolicyForward`'s output (the fused Triton kernel on CUDA in fast numerics; the contract's own
operations in exact numerics).

The model hides behind `PolicySpec` / `CriticSpec` (build + forward): the looped families of
learner/megatron/model.py (`looped_policy_spec`) and a plain megatron GPTModel plug in alike.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from learner.batching import TrainBatch
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.kernels.token_stats import token_stats_auto
from learner.loop_forward import exit_forward, loop_forward
from learner.model_specs import CriticSpec, PolicySpec
from learner.network import Network, seed_all
from learner.objectives.loops import check_gate
from learner.policy import DataParallel
from learner.replay import unwrap
from learner.step import LearnerStep
from learner.vocab_ops import contract_token_stats, nucleus_rows, token_stats

__all__ = [
    "MegatronPolicy",
    "Trainer",
]


class MegatronPolicy:
    """learner.policy.Policy on megatron-core: the policy (and critic) as `Network`s (Megatron
    DDP + optimizer + LR schedule), forwarded through their `PolicySpec` / `CriticSpec`."""

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
        reference: PolicySpec | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.dp = DataParallel(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
                               ps.get_data_parallel_group())  # fmt: skip
        self.policy_spec, self.critic_spec = policy, critic
        seed_all(cfg.seed)
        exact = cfg.numerics == "exact"
        self.policy = Network(policy.build(cfg.recompute), optim, schedule, exact=exact)
        self.critic: Network | None = None
        if critic is not None:
            self.critic = Network(critic.build(cfg.recompute), critic_optim or optim,
                                  critic_schedule or schedule, exact=exact)  # fmt: skip
        self.ref_module: nn.Module | None = None
        """Frozen reference policy of objective.kl_coef (no optimizer, no grad)."""
        if reference is not None:
            self.ref_module = reference.build(False)
            self.ref_module.eval()
            self.ref_module.requires_grad_(False)
        self.has_reference = self.ref_module is not None
        self.device = next(self.policy.module.parameters()).device
        self.loops = cfg.objective.loop_weighting != "last"
        """Per-loop credit: the forwards add per-loop statistics (learner.loop_forward)."""
        if self.loops:
            core = unwrap(self.policy.module)
            check_gate(cfg.objective.loop_weighting, hasattr(core, "exit_gate"),
                       type(core.family_config).__name__)  # fmt: skip

    def _stats(self, out: dict[str, Tensor], mb: TrainBatch, old: Tensor | None) -> dict:
        """logp / entropy (/ kl, prox_logp from old logits) [B, L] from a PolicyForward;
        full-vocabulary statistics are computed on the response rows only."""
        smp = self.cfg.sampling
        if "logits" not in out and "mask_logits" not in out:
            if old is not None:
                raise ValueError("flow_dppo needs a PolicyForward that returns logits")
            return {"logp": out["logp"], "entropy": out["entropy"]}
        # the response rows (mask > 0) by their flat index, found on the host: no device read
        at = mb.mask_rows()
        if "mask_logits" in out:
            rows = out["mask_logits"]
        else:
            rows = out["logits"].reshape(-1, out["logits"].shape[-1]).index_select(0, at)
        targets = mb.targets.reshape(-1).index_select(0, at)

        def spread(x: Tensor) -> Tensor:
            flat = torch.zeros(mb.mask.numel(), dtype=x.dtype, device=x.device)
            return flat.index_copy(0, at, x).view(mb.mask.shape)

        if self.cfg.numerics == "exact":  # the contract's own log-probs, op for op
            st = contract_token_stats(rows, old, targets, smp.temperature, smp.top_p, "exact")
            return {k: spread(v) for k, v in st.items()} | {"rows": rows}
        if smp.top_p < 1.0:  # the generator sampled from the nucleus: renormalise over it
            rows = nucleus_rows(rows, smp.temperature, smp.top_p)
        stats_fn = token_stats_auto if self.cfg.fused_token_stats else token_stats
        stats = stats_fn(rows, old, targets, smp.temperature, self.cfg.vocab_chunk)
        res = {"logp": spread(stats.logp), "entropy": spread(stats.entropy), "rows": rows}
        if stats.kl is not None and stats.logp_old is not None:
            res["kl"] = spread(stats.kl)
            res["prox_logp"] = spread(stats.logp_old)
        return res

    def _row_stats(self, rows: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """{"logp", "entropy"} [N] of full-vocabulary rows, as `_stats` computes them."""
        smp = self.cfg.sampling
        if self.cfg.numerics == "exact":
            return contract_token_stats(rows, None, targets, smp.temperature, smp.top_p, "exact")
        if smp.top_p < 1.0:
            rows = nucleus_rows(rows, smp.temperature, smp.top_p)
        stats_fn = token_stats_auto if self.cfg.fused_token_stats else token_stats
        st = stats_fn(rows, None, targets, smp.temperature, self.cfg.vocab_chunk)
        return {"logp": st.logp, "entropy": st.entropy}

    def policy_stats(self, mb: TrainBatch, old: Tensor | None) -> dict[str, Tensor]:
        if self.loops:  # per-loop credit (flow_dppo refused), a sampled exit's terms with it
            gate = self.cfg.objective.loop_weighting == "exit_pdf"
            return loop_forward(self.policy.module, mb, self._row_stats, gate=gate,
                                exit_min_depth=self.cfg.exit_min_depth,
                                gate_grad=self.cfg.objective.exit_pdf_gradient)  # fmt: skip
        if self.cfg.exit_min_depth is not None:  # a sampled exit: its log-prob and entropy
            out = exit_forward(self.policy.module, mb, self.cfg.exit_min_depth)
            st = self._stats({"mask_logits": out["mask_logits"]}, mb, old)
            return st | {"exit_logp": out["exit_logp"], "exit_entropy": out["exit_entropy"]}
        return self._stats(self.policy_spec.forward(self.policy.module, mb), mb, old)

    @torch.no_grad()
    def reference_logp(self, mb: TrainBatch) -> Tensor:
        assert self.ref_module is not None
        return self._stats(self.policy_spec.forward(self.ref_module, mb), mb, None)["logp"]

    @torch.no_grad()
    def reference_loop_logp(self, mb: TrainBatch) -> Tensor:
        """[B, L, K] the reference's per-loop log-probs (per-loop credit with kl_coef > 0)."""
        assert self.ref_module is not None
        out: Tensor = loop_forward(self.ref_module, mb, self._row_stats, gate=False)["loop_logp"]
        return out

    def values(self, mb: TrainBatch) -> Tensor:
        assert self.critic is not None and self.critic_spec is not None
        return self.critic_spec.forward(self.critic.module, mb)


class Trainer(LearnerStep):
    """learner.step.LearnerStep over a `MegatronPolicy`; see the module docstring."""

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
        self.megatron = MegatronPolicy(cfg, optim, schedule, policy, critic=critic,
                                       critic_optim=critic_optim, critic_schedule=critic_schedule,
                                       reference=reference)  # fmt: skip
        super().__init__(cfg, self.megatron, initial_version=initial_version)
        self.grad_accum = cfg.grad_accum_steps(self.dp_size)
        self.policy, self.critic = self.megatron.policy, self.megatron.critic
        self.ref_module = self.megatron.ref_module

    @property
    def dp_size(self) -> int:
        return self.megatron.dp.size

    @property
    def dp_rank(self) -> int:
        return self.megatron.dp.rank

    @property
    def policy_model(self) -> nn.Module:
        """The unwrapped policy module (this rank's TP shard)."""
        return self.policy.module

    def networks(self) -> dict[str, Network]:
        """{"policy": ..., "critic": ...} (critic only when configured)."""
        return {"policy": self.policy} | ({"critic": self.critic} if self.critic else {})
