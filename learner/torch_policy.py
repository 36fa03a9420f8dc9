"""learner.policy.Policy in plain PyTorch: the models.reference forward
(models.engine.chunk.run_chunk replaying each row's latent seed and exit depths) and torch
optimizers.

It is the independent forward that checks the megatron policy (tests/pipeline/test_epochs.py:
in numerics exact the two give the same bits; in fast within 1e-6) and a small deterministic
backend for CPU runs (same inputs, same thread count -> the same bits: `looprl replay`).

- `TorchNet`: a module and its optimizer (AdamW, or SGD with momentum), the counterpart of
  learner.network.Network: gradients accumulate over the micro-batches in fp32, then clip by
  the global norm (in numerics exact the norm and the clip factor as megatron computes them
  there: learner.network.exact_l2_norm / exact_clip_coeff), the n-th applied update at
  ScheduleConfig.lr_at(n); a non-finite loss or norm skips the update (megatron's found-inf).
- The critic: a copy of the starting checkpoint's trunk with a zero-initialised value head
  Linear(hidden -> 1) in place of the LM head (learner.megatron.model.build_critic's
  counterpart), its own optimizer (optimizer.critic_lr) and clip.
- Token statistics: learner.vocab_ops.contract_token_stats, the contract's own operations, in
  both numerics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from learner.batching import TrainBatch
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.network import exact_clip_coeff, exact_l2_norm
from learner.objectives.loops import (
    ExitSum,
    add_loop_columns,
    check_gate,
    response_depths,
    row_full_depths,
    spread,
    tap,
)
from learner.policy import DataParallel
from learner.vocab_ops import contract_token_stats
from models import numerics as nx
from models.base import LoopedLM
from models.engine.chunk import KVCache, run_chunk

__all__ = ["TorchCritic", "TorchNet", "TorchPolicy", "make_optimizer"]


def make_optimizer(params: Iterable[Any], p: OptimConfig) -> torch.optim.Optimizer:
    """torch's counterpart of megatron's optimizer for ``p``: AdamW, or SGD with momentum
    and L2 weight decay."""
    if p.name == "sgd":
        return torch.optim.SGD(params, lr=p.lr, momentum=p.sgd_momentum,
                               weight_decay=p.weight_decay)  # fmt: skip
    return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps,
                             weight_decay=p.weight_decay)  # fmt: skip


class TorchNet:
    """learner.policy.Net on a torch optimizer (module docstring)."""

    def __init__(self, module: nn.Module, optim: OptimConfig, schedule: ScheduleConfig, *,
                 exact: bool = False) -> None:  # fmt: skip
        self.module, self.schedule, self.exact = module, schedule, exact
        self.grad_clip = optim.grad_clip
        # frozen parameters (a LoRA base: learner.lora) never enter the optimizer
        self.opt = make_optimizer([p for p in module.parameters() if p.requires_grad], optim)
        self.updates = 0
        """Applied updates (the schedule's n)."""
        self.skipped_nonfinite = 0
        """Updates skipped so far because the loss or the gradients were not finite."""

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def update(self, loss_finite: bool) -> dict[str, float]:
        params = [p for g in self.opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if self.exact:
            n32 = exact_l2_norm(grads)
            norm = float((n32**2.0).item()) ** 0.5  # the norm megatron reports
            coeff = exact_clip_coeff(n32, self.grad_clip) if self.grad_clip > 0 else 1.0
            if coeff < 1.0 and math.isfinite(norm):
                for g in grads:
                    g.copy_(g * coeff)
        else:
            clip = self.grad_clip if self.grad_clip > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        ok = loss_finite and math.isfinite(norm)
        if ok:
            self.updates += 1
            for g in self.opt.param_groups:
                g["lr"] = self.schedule.lr_at(g.setdefault("peak_lr", g["lr"]), self.updates)
            self.opt.step()
        else:
            self.skipped_nonfinite += 1
        self.zero_grad()
        lr = float(self.opt.param_groups[0]["lr"])
        return {"grad_norm": norm, "lr": lr, "skipped_nonfinite": 0.0 if ok else 1.0}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optim": self.opt.state_dict(),
                "updates": self.updates, "skipped_nonfinite": self.skipped_nonfinite}  # fmt: skip

    def load_state_dict(self, blob: dict[str, Any]) -> None:
        self.module.load_state_dict(blob["model"])
        self.opt.load_state_dict(blob["optim"])
        self.updates = int(blob["updates"])
        self.skipped_nonfinite = int(blob.get("skipped_nonfinite", 0))


class TorchCritic(nn.Module):
    """The critic network: a looped trunk and a value head Linear(hidden -> 1), zero-initialised."""

    def __init__(self, trunk: LoopedLM) -> None:
        super().__init__()
        self.model = trunk
        self.head = nn.Linear(trunk.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


class TorchPolicy:
    """learner.policy.Policy on models.engine.chunk (module docstring). ``kv``: the run's exit KV
    semantics (models.exits.resolve_kv); ``critic``: a trunk for the critic (the starting
    checkpoint's, loaded again), ``reference``: the frozen reference policy of
    objective.kl_coef."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: LoopedLM,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        *,
        kv: str,
        critic: LoopedLM | None = None,
        critic_optim: OptimConfig | None = None,
        critic_schedule: ScheduleConfig | None = None,
        reference: LoopedLM | None = None,
    ) -> None:
        self.cfg, self.kv = cfg, kv
        self.dp = DataParallel()
        self.device = torch.device("cpu")
        exact = cfg.numerics == "exact"
        model.train()
        self.policy = TorchNet(model, optim, schedule, exact=exact)
        self.critic: TorchNet | None = None
        if critic is not None:
            critic.train()
            self.critic = TorchNet(TorchCritic(critic), critic_optim or optim,
                                   critic_schedule or schedule, exact=exact)  # fmt: skip
        self.ref = reference
        if reference is not None:
            reference.eval()
            reference.requires_grad_(False)
        self.has_reference = reference is not None
        self.loops = cfg.objective.loop_weighting != "last"
        """Per-loop credit: the forwards add per-loop statistics (`_loop_stats`)."""
        if self.loops:
            has_gate = model.gate_logit(torch.zeros(1, model.hidden_size), "fast") is not None
            check_gate(cfg.objective.loop_weighting, has_gate, type(model).__name__)

    @property
    def model(self) -> LoopedLM:
        m = self.policy.module
        assert isinstance(m, LoopedLM)
        return m

    def forward(
        self, model: LoopedLM, mb: TrainBatch, depths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B, L, V], hidden [B, L, H]) at every input position of the micro-batch's
        rows, each row at its recorded depths (or ``depths``) with its latent seed (full depth:
        its deepest position: the prompt's D, docs/CONTRACTS.md 2; with a one-token prompt a
        smaller one, which no read-out depends on: learner.megatron.model's rule)."""
        depths = mb.exit_depths if depths is None else depths
        valid = mb.position_ids < mb.seq_lens[:, None]
        full = [int(d) for d in torch.where(valid, depths, 0).amax(dim=1).tolist()]
        cache = KVCache.empty(model, mb.size, mb.length, max(full))
        # adapters (learner.lora's parametrizations) merged once per forward, not at each
        # access (a looped core block's linears are read at every iteration): as the megatron
        # policy's learner.megatron.lora.merged_once
        with parametrize.cached():
            out = run_chunk(
                model, cache, mb.input_ids, mb.position_ids, valid, mb.seeds,
                max_depth=max(full), depths=depths, mode=self.cfg.numerics, kv=self.kv,
                row_depths=full if self.kv == "full" else None,
            )  # fmt: skip
        return out.logits[..., : model.vocab_size], out.hidden

    def _loop_stats(self, model: LoopedLM, mb: TrainBatch, gate: bool,
                    exit_min_depth: int | None = None,
                    gate_grad: bool = False) -> dict[str, Tensor]:  # fmt: skip
        """Per-loop credit: {"logp", "entropy"} [B, L] of the exit readout (no grad) and
        {"loop_logp", "loop_entropy"(, "loop_gate")} [B, L, K] (0 where k > e_t): one replay
        (`_replay_loops`, models.engine.chunk.run_chunk's replay with a hook after each iteration)
        whose state after iteration k is read out through the family's readout (a fresh coda
        cache per loop) and head, under activation checkpointing (one loop's logits at a time):
        learner.loop_forward's computation, in the same order, so in numerics exact the two
        policies give the same bits, gradients included. ``exit_min_depth`` (a sampled exit):
        also {"exit_logp", "exit_entropy"} [B, L] from the gate after each iteration (ExitSum,
        as learner.loop_forward). ``gate_grad``: "loop_gate" carries its gradient
        (objective.exit_pdf_gradient)."""
        smp, mode = self.cfg.sampling, self.cfg.numerics
        sel, e, n_loops = response_depths(mb)
        cols: dict[str, list[Tensor]] = {"loop_logp": [], "loop_entropy": [], "loop_gate": []}
        exits = (None if exit_min_depth is None
                 else ExitSum(sel, e, row_full_depths(mb), exit_min_depth, mode))  # fmt: skip

        def rows_stats(logits: Tensor, sel_k: Tensor) -> tuple[Tensor, Tensor]:
            st = contract_token_stats(logits[..., : model.vocab_size][sel_k], None,
                                      mb.targets[sel_k], smp.temperature, smp.top_p, mode)  # fmt: skip
            return st["logp"], st["entropy"]

        def at_loop(k: int, state: Tensor, readout: Any) -> Tensor | None:
            if k > n_loops:
                return None
            state, side = tap(state)
            sel_k = sel & (e >= k)

            def stats(s: Tensor) -> tuple[Tensor, Tensor]:
                return rows_stats(readout(s)[0], sel_k)

            def gate_logit(s: Tensor) -> Tensor:
                g = model.gate_logit(s, mode)
                assert g is not None
                return g.view(sel.shape)

            add_loop_columns(cols, sel_k, side, stats, gate_logit if gate else None, gate_grad)
            if exits is not None:
                exits.add(k, gate_logit(side))
            return state

        logits = _replay_loops(model, mb, mode, self.kv, at_loop)
        with torch.no_grad():
            lp, ent = rows_stats(logits.detach(), sel)
        out = {"logp": spread(sel, lp), "entropy": spread(sel, ent)}
        out |= {k: torch.stack(v, dim=-1) for k, v in cols.items() if v}
        return out | ({} if exits is None else exits.result())

    def _stats(self, logits: Tensor, mb: TrainBatch, old: Tensor | None) -> dict[str, Tensor]:
        sel = mb.mask > 0
        rows = logits[sel]
        smp = self.cfg.sampling
        st = contract_token_stats(rows, old, mb.targets[sel], smp.temperature, smp.top_p,
                                  self.cfg.numerics)  # fmt: skip
        out = {k: torch.zeros(sel.shape, dtype=v.dtype).masked_scatter(sel, v)
               for k, v in st.items()}  # fmt: skip
        return out | {"rows": rows}

    def policy_stats(self, mb: TrainBatch, old: Tensor | None) -> dict[str, Tensor]:
        if self.loops:  # per-loop credit (flow_dppo is refused with it)
            gate = self.cfg.objective.loop_weighting == "exit_pdf"
            return self._loop_stats(
                self.model, mb, gate, self.cfg.exit_min_depth, self.cfg.objective.exit_pdf_gradient
            )
        if self.cfg.exit_min_depth is None:
            return self._stats(self.forward(self.model, mb)[0], mb, old)
        return self._exit_stats(self.model, mb, old, self.cfg.exit_min_depth)

    def _exit_stats(self, model: LoopedLM, mb: TrainBatch, old: Tensor | None,
                    min_depth: int) -> dict[str, Tensor]:  # fmt: skip
        """A sampled exit: `_stats` of the exit readout plus {"exit_logp", "exit_entropy"}
        [B, L] from the gate after each iteration (ExitSum) in `_replay_loops`' hook, as
        learner.loop_forward.exit_forward computes them in LoopedGPT's: the same graph, so
        the same gradient bits in exact numerics (models.engine.chunk.run_chunk's exit_lp gives the
        same values, the generator's claims, but reads the gate before the state's update)."""
        sel, e, n_loops = response_depths(mb)
        exits = ExitSum(sel, e, row_full_depths(mb), min_depth, self.cfg.numerics)

        def at_loop(k: int, state: Tensor, readout: Any) -> Tensor | None:
            if k > n_loops:
                return None
            state, side = tap(state)
            g = model.gate_logit(side, self.cfg.numerics)
            assert g is not None, "sampled exits need a model with an exit gate"
            exits.add(k, g)
            return state

        logits = _replay_loops(model, mb, self.cfg.numerics, self.kv, at_loop)
        return self._stats(logits[..., : model.vocab_size], mb, old) | exits.result()

    @torch.no_grad()
    def reference_logp(self, mb: TrainBatch) -> Tensor:
        assert self.ref is not None
        return self._stats(self.forward(self.ref, mb)[0], mb, None)["logp"]

    @torch.no_grad()
    def reference_loop_logp(self, mb: TrainBatch) -> Tensor:
        """[B, L, K] the reference's per-loop log-probs (per-loop credit with kl_coef > 0)."""
        assert self.ref is not None
        return self._loop_stats(self.ref, mb, False)["loop_logp"]

    def values(self, mb: TrainBatch) -> Tensor:
        assert self.critic is not None
        net = self.critic.module
        assert isinstance(net, TorchCritic)
        _, hid = self.forward(net.model, mb)
        mode = "exact" if self.cfg.numerics == "exact" else "fast"  # as megatron's value head
        out: Tensor = nx.linear(hid, net.head.weight, net.head.bias, mode)[..., 0]
        return out


def _replay_loops(model: LoopedLM, mb: TrainBatch, mode: str, kv: str, hook: Any) -> Tensor:
    """models.engine.chunk.run_chunk's replay of a micro-batch at its recorded depths (the same
    operations in the same order), calling hook(k, state [B, L, h], readout) after core
    iteration k; readout(state) -> (logits, hidden) [B, L, ...] through the coda with a fresh
    coda cache. Returns the exit readout's logits [B, L, V_pad]. Adapters merged once for it
    (as ``forward``)."""
    with parametrize.cached():
        return _replayed_loops(model, mb, mode, kv, hook)


def _replayed_loops(model: LoopedLM, mb: TrainBatch, mode: str, kv: str, hook: Any) -> Tensor:
    from models.engine.chunk import _key_mask, _readout, _Rows, _stack

    depths = mb.exit_depths
    deepest = torch.where(mb.position_ids < mb.seq_lens[:, None], depths, 0).amax(dim=1)
    full_d = [int(d) for d in deepest.tolist()]  # a row's full depth: as `forward`
    max_depth = max(full_d)
    full = kv == "full"
    bsz, seq = mb.input_ids.shape
    n = bsz * seq
    cache = KVCache.empty(model, bsz, seq, max_depth)
    pos = mb.position_ids.reshape(n)
    val = (mb.position_ids < mb.seq_lens[:, None]).reshape(n)
    rows = torch.arange(bsz).repeat_interleave(seq)
    dep = depths.reshape(n)
    cache.filled[rows[val], pos[val]] = True
    r = _Rows(bsz, seq, rows, pos, _key_mask(cache.filled, mb.position_ids), model.rope(pos, mode),
              mode)  # fmt: skip
    row_seeds = [int(mb.seeds[b]) for b in rows.tolist()]
    e = _stack(model.prelude_blocks(), cache.prelude, model.embed(mb.input_ids.reshape(n)), val, r)
    state = model.initial_state(e, pos, row_seeds)
    done = ~val
    run_to = torch.as_tensor(full_d, dtype=torch.int64)[rows] if full else None
    out_state = state

    def readout(s: Tensor) -> tuple[Tensor, Tensor]:
        fresh = dataclasses.replace(cache, coda=torch.zeros_like(cache.coda))
        logits, hidden = _readout(model, fresh, s.reshape(n, -1), val, r)
        return logits.view(bsz, seq, -1), hidden.view(bsz, seq, -1)

    for i in range(max_depth):
        active = ~done
        running = val & (run_to > i) if run_to is not None else active
        if not running.any():
            break
        x = _stack(model.core_blocks(), cache.core[i], model.core_in(state, e, mode), running, r)
        new = model.core_out(x, mode)
        state = torch.where(running[:, None], new, state)
        stop = active & (dep == i + 1)
        if full:
            out_state = torch.where(stop[:, None], state, out_state)
        elif stop.any() and i + 1 < max_depth:
            sb, sp = rows[stop], pos[stop]
            cache.core[i + 1 :, :, :, sb, sp] = cache.core[i, :, :, sb, sp].unsqueeze(0)
        done = done | stop
        after = hook(i + 1, state.view(bsz, seq, -1), readout)
        state = state if after is None else after.reshape(n, -1)
    logits, _ = _readout(model, cache, out_state if full else state, val, r)
    return logits.view(bsz, seq, -1)
