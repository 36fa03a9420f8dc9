"""Per-loop credit (objective.loop_weighting; docs/OBJECTIVES.md "Per-loop credit"): the loop
weights w_tk of each response token t over its loops k = 1..e_t.

    w = loop_weights(cfg, exit_depths, full_depths, gate)     # [B, T, K], sum_k w_tk = 1

`learner.objectives.policy_loss` applies the objective's per-token term at every loop with the
loop's log-probs (`LossBatch.loop_logp`, `loop_prox`, `loop_ref`, `loop_entropy`) and sums the
terms with these weights. These weights carry no gradient (a fixed credit assignment per
token), except ``learned`` (`LearnedLoopWeights`, whose logits are trained by the loss) and
exit_pdf with objective.exit_pdf_gradient (as RLTT's: the exit gate's logits, and through them
the gate and the state it reads, get the same policy-gradient term as learned's logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from learner.objective_config import ObjectiveConfig
from models.exits import exit_step_entropy, exit_step_logprob

if TYPE_CHECKING:
    from learner.batching import TrainBatch

__all__ = ["MAX_LOOPS", "ExitSum", "LearnedLoopWeights", "check_gate", "loop_weights",
           "response_depths", "row_full_depths", "spread", "tap"]  # fmt: skip

MAX_LOOPS = 255
"""Logits a `LearnedLoopWeights` holds: one per loop an exit depth (uint8) can name."""


def loop_weights(
    cfg: ObjectiveConfig,
    exit_depths: Tensor,
    full_depths: Tensor,
    gate: Tensor | None,
    n_loops: int,
) -> Tensor:
    """[B, T, K] fp32 weights, K = ``n_loops``, 0 for k > e_t and off the response.

    exit_depths [B, T]: e_t of each response token (<= 0 off the response); full_depths [B]:
    each row's full depth D_b (the run's depth: Ouro's last loop takes the remaining exit
    mass); gate [B, T, K]: the exit-gate logits at every loop (exit_pdf).

        uniform:      w_tk = 1 / e_t
        progressive:  w_tk = k^alpha / sum_{j <= e_t} j^alpha                  (RLTT option B)
        exit_pdf:     p_k = lambda_k prod_{j < k} (1 - lambda_j)  (k < D),  p_D = prod_{j < D}
                      (1 - lambda_j),  lambda_k = sigmoid(gate_k);  w_tk = p_k / sum_{j <= e_t} p_j
                      (a token whose renormalising sum underflows to 0 gets w = 1 at e_t)

    No gradient, except exit_pdf with ``cfg.exit_pdf_gradient`` (grad mode on): then w is
    differentiable in ``gate`` (the same values, bit for bit).
    """
    grad = cfg.loop_weighting == "exit_pdf" and cfg.exit_pdf_gradient
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return _loop_weights(cfg, exit_depths, full_depths, gate, n_loops)


def _loop_weights(cfg: ObjectiveConfig, exit_depths: Tensor, full_depths: Tensor,
                  gate: Tensor | None, n_loops: int) -> Tensor:  # fmt: skip
    """`loop_weights`'s formulas, under the caller's grad mode."""
    e = exit_depths.long()
    k = torch.arange(1, n_loops + 1, device=e.device)
    inside = (k <= e[..., None]) & (e[..., None] > 0)
    kind = cfg.loop_weighting
    if kind == "uniform":
        raw = inside.float()
    elif kind == "progressive":
        raw = torch.where(inside, k.float() ** cfg.progressive_alpha, 0.0)
    elif kind == "exit_pdf":
        if gate is None:
            raise ValueError("objective.loop_weighting=exit_pdf: needs the exit gate's logits")
        lam = torch.sigmoid(gate.float())
        survive = torch.cumprod(1.0 - lam, dim=-1)
        before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
        last = k == full_depths.to(e.device)[:, None, None]
        p = torch.where(last, before, lam * before)
        raw = torch.where(inside, p, 0.0)
    else:
        raise ValueError(f"objective.loop_weighting: no per-loop weights for {kind!r}")
    total = raw.sum(-1, keepdim=True)
    at_exit = (k == e[..., None]).float()
    w = torch.where(total > 0, raw / total.clamp_min(1e-30), at_exit)
    return torch.where(inside, w, 0.0)


class LearnedLoopWeights:
    """objective.loop_weighting learned: per-loop logits theta_1..theta_255, and

        w_tk = exp(theta_k) / sum_{j <= e_t} exp(theta_j)   (k <= e_t; 0 beyond and off the response)

    RLTT's learned weighting (a softmax over trainable per-loop logits optimised jointly with
    the policy by the same loss), renormalised over each token's own loops 1..e_t as uniform
    is. theta starts at 0 (w = uniform's 1/e_t, the same bits) and is trained by its own Adam
    (lr objective.loop_weight_lr, constant, no weight decay or clipping): the policy's
    optimizer and its schedule are the backend's (megatron's distributed optimizer), this is
    shared code, so both policies train theta with the same bits given the same losses. A loop
    no token has reached keeps theta_k = 0 exactly (zero gradient, zero Adam moments).

    Per update (learner.step): `zero_grad` with the policy's; `weights` in each micro-batch's
    loss (autograd reaches theta through it); `step` after the policy's update: the gradient
    summed over DP ranks / dp_size (the policy's rule for its backward of loss x dp_size), an
    Adam step unless the policy skipped its update. Checkpointed with the learner
    (`state_dict`); never published: the weights shape the learner's loss only, the
    generators' models have no use for them."""

    def __init__(self, lr: float, device: torch.device | str = "cpu") -> None:
        self.logits = torch.zeros(MAX_LOOPS, dtype=torch.float32, device=device,
                                  requires_grad=True)  # fmt: skip
        self.opt = torch.optim.Adam([self.logits], lr=lr, weight_decay=0.0, foreach=False)

    def weights(self, exit_depths: Tensor, n_loops: int) -> Tensor:
        """[B, T, K] fp32 weights (K = ``n_loops``) of the tokens' exit depths [B, T] (<= 0
        off the response), differentiable in `logits`."""
        e = exit_depths.long().to(self.logits.device)
        k = torch.arange(1, n_loops + 1, device=e.device)
        inside = (k <= e[..., None]) & (e[..., None] > 0)
        # off the response: the softmax over every loop, then zeroed (keeps it finite)
        span = k <= torch.where(e > 0, e, n_loops)[..., None]
        w = torch.softmax(torch.where(span, self.logits[:n_loops], -math.inf), dim=-1)
        return torch.where(inside, w, 0.0)

    def current(self, n_loops: int) -> list[float]:
        """The weights of a token that ran ``n_loops`` loops (for metrics and docs)."""
        with torch.no_grad():
            return torch.softmax(self.logits[:n_loops].float(), dim=0).tolist()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self, dp: Any, apply: bool) -> None:
        """The update's end: DP-sum the gradient, / dp.size, and step unless ``apply`` is
        False (the policy skipped a non-finite update) or the gradient is not finite."""
        g = self.logits.grad
        if g is not None and dp.active:
            dp.all_reduce_(g)
            g.div_(dp.size)
        if apply and g is not None and bool(torch.isfinite(g).all()):
            self.opt.step()
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {"logits": self.logits.detach().cpu().clone(), "optim": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        logits = state["logits"]
        if tuple(logits.shape) != (MAX_LOOPS,):
            raise ValueError(f"loop weights: logits of shape {tuple(logits.shape)}, expected "
                             f"({MAX_LOOPS},)")  # fmt: skip
        with torch.no_grad():
            self.logits.copy_(logits)
        self.opt.load_state_dict(state["optim"])


def check_gate(weighting: str, has_gate: bool, family: str) -> None:
    """loop_weighting exit_pdf needs a family with an exit gate (Ouro): one-line refusal."""
    if weighting == "exit_pdf" and not has_gate:
        raise ValueError(f"objective.loop_weighting=exit_pdf: the {family} family has no exit "
                         "gate (Ouro's); use uniform or progressive")  # fmt: skip


def add_loop_columns(
    cols: dict[str, list[Tensor]],
    sel_k: Tensor,
    state: Tensor,
    stats: Callable[[Tensor], tuple[Tensor, Tensor]],
    gate_logit: Callable[[Tensor], Tensor] | None = None,
    gate_grad: bool = False,
) -> None:
    """One loop k's columns, for both policies' per-loop forwards: ``stats(state)`` (the
    sampled tokens' log-probs and entropies at the rows ``sel_k``, the tokens that ran loop k)
    under activation checkpointing when a gradient is built (the backward recomputes one
    loop's logits at a time), spread to [B, T]; with ``gate_logit``, the exit gate's logit
    (with its gradient when ``gate_grad``: objective.exit_pdf_gradient)."""
    if torch.is_grad_enabled():
        lp, ent = checkpoint(stats, state, use_reentrant=False)
    else:
        lp, ent = stats(state)
    cols["loop_logp"].append(spread(sel_k, lp))
    cols["loop_entropy"].append(spread(sel_k, ent))
    if gate_logit is not None:
        with torch.set_grad_enabled(gate_grad and torch.is_grad_enabled()):
            cols["loop_gate"].append(torch.where(sel_k, gate_logit(state), 0.0))


class _Tap(torch.autograd.Function):
    """(x, x) forward; backward: the two branches' gradients summed here, once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g_main: Tensor, g_side: Tensor) -> Tensor:  # noqa: D102
        return g_main + g_side


def tap(state: Tensor) -> tuple[Tensor, Tensor]:
    """(main, side): the same values, for a per-iteration hook of both policies' forwards
    (the readouts and exit gate of learner.loop_forward and the torch policy's replay read
    ``side``; the loop goes on with ``main``, the hook's return value). Autograd sums the
    gradients of a tensor's consumers in the order its engine reaches them, which differs
    between the two policies' graphs once a hook adds consumers (1e-7 apart after one update,
    measured on tests/learner/test_policies_ragged.py); here every hook consumer sums on
    ``side`` and the two branches in `_Tap.backward`, a sum of two, whatever the order: the
    same bits in exact numerics."""
    if not (torch.is_grad_enabled() and state.requires_grad):
        return state, state
    main, side = _Tap.apply(state)
    return main, side


class ExitSum:
    """A sampled exit's per-token log-prob and entropy, summed over the core iterations each
    response token ran, for both policies' hooked forwards (learner.loop_forward, the torch
    policy's per-loop replay): after iteration k, ``add(k, gate_logit)`` with the exit gate's
    logit of the state [B, L] adds models.exits.exit_step_logprob / exit_step_entropy at the
    tokens that ran iteration k (e_t >= k), in iteration order: the operations of
    models.engine.chunk.run_chunk, so exact numerics give the generator's claims bit for bit.
    ``forced`` [B]: each row's full depth (the run's D, where the gate is no longer consulted,
    docs/CONTRACTS.md 2), not its deepest recorded position."""

    def __init__(self, sel: Tensor, e: Tensor, forced: Tensor, min_depth: int, mode: str) -> None:
        self.sel, self.e, self.min_depth, self.mode = sel, e, min_depth, mode
        self.forced = forced.to(sel.device)[:, None].expand(sel.shape).reshape(-1)
        dt = torch.float64 if mode == "exact" else torch.float32
        self.elp = torch.zeros(sel.shape, dtype=dt, device=sel.device)
        self.ent = torch.zeros(sel.shape, dtype=dt, device=sel.device)

    def add(self, k: int, gate_logit: Tensor) -> None:
        ran = (self.sel & (self.e >= k)).reshape(-1)  # the tokens that ran iteration k
        g = gate_logit.reshape(-1)
        stop = (self.e == k).reshape(-1)
        term = exit_step_logprob(g, stop, k, self.min_depth, self.forced, self.mode)
        h = exit_step_entropy(g, k, self.min_depth, self.forced, self.mode)
        zero = torch.zeros_like(term)
        self.elp = self.elp + torch.where(ran, term, zero).view(self.sel.shape)
        self.ent = self.ent + torch.where(ran, h, zero).view(self.sel.shape)

    def result(self) -> dict[str, Tensor]:
        """{"exit_logp", "exit_entropy"} [B, L] fp32, 0 off the response."""
        return {"exit_logp": torch.where(self.sel, self.elp, 0.0).float(),
                "exit_entropy": torch.where(self.sel, self.ent, 0.0).float()}  # fmt: skip


def spread(sel: Tensor, x: Tensor) -> Tensor:
    """[N] values at the True positions of sel [B, L] -> [B, L], 0 elsewhere."""
    return torch.zeros(sel.shape, dtype=x.dtype, device=x.device).masked_scatter(sel, x)


def row_full_depths(mb: TrainBatch) -> Tensor:
    """[B] each row's full depth (docs/CONTRACTS.md 2: the run's D, recorded per rollout; the
    first position's depth for streams recorded before it): where a sampled exit is forced and
    Ouro's last loop takes the remaining exit mass. Not the row's deepest recorded position
    (a one-token prompt whose tokens all exit early has none at D)."""
    return mb.full_depths if mb.full_depths is not None else mb.exit_depths[:, 0]


def response_depths(mb: TrainBatch) -> tuple[Tensor, Tensor, int]:
    """(sel [B, L] response positions, e [B, L] their exit depths (0 elsewhere), K = max e;
    K counted on the host copy, `TrainBatch.on_host`: no read of the card)."""
    sel = mb.mask > 0
    e = torch.where(sel, mb.exit_depths, 0)
    h = mb.on_host()
    h_sel = h.mask > 0
    h_e = torch.where(h_sel, h.exit_depths, 0)
    return sel, e, max(1, int(h_e.max())) if bool(h_sel.any()) else 1
