"""Per-loop credit (objective.loop_weighting; docs/OBJECTIVES.md "Per-loop credit"): the loop
weights w_tk of each response token t over its loops k = 1..e_t.

    w = loop_weights(cfg, exit_depths, full_depths, gate)     # [B, T, K], sum_k w_tk = 1

`learner.objectives.policy_loss` applies the objective's per-token term at every loop with the
loop's log-probs (`LossBatch.loop_logp`, `loop_prox`, `loop_ref`, `loop_entropy`) and sums the
terms with these weights. The weights carry no gradient (RLTT's exit_pdf weights are the
model's exit distribution, a fixed credit assignment per token, not a quantity to optimise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from learner.config import ObjectiveConfig

if TYPE_CHECKING:
    from learner.batching import TrainBatch

__all__ = ["check_gate", "loop_weights", "response_depths", "spread"]


@torch.no_grad()
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
    """
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
) -> None:
    """One loop k's columns, for both policies' per-loop forwards: ``stats(state)`` (the
    sampled tokens' log-probs and entropies at the rows ``sel_k``, the tokens that ran loop k)
    under activation checkpointing when a gradient is built (the backward recomputes one
    loop's logits at a time), spread to [B, T]; with ``gate_logit``, the exit gate's logit."""
    if torch.is_grad_enabled():
        lp, ent = checkpoint(stats, state, use_reentrant=False)
    else:
        lp, ent = stats(state)
    cols["loop_logp"].append(spread(sel_k, lp))
    cols["loop_entropy"].append(spread(sel_k, ent))
    if gate_logit is not None:
        with torch.no_grad():
            cols["loop_gate"].append(torch.where(sel_k, gate_logit(state), 0.0))


def spread(sel: Tensor, x: Tensor) -> Tensor:
    """[N] values at the True positions of sel [B, L] -> [B, L], 0 elsewhere."""
    return torch.zeros(sel.shape, dtype=x.dtype, device=x.device).masked_scatter(sel, x)


def response_depths(mb: TrainBatch) -> tuple[Tensor, Tensor, int]:
    """(sel [B, L] response positions, e [B, L] their exit depths (0 elsewhere), K = max e)."""
    sel = mb.mask > 0
    e = torch.where(sel, mb.exit_depths, 0)
    return sel, e, max(1, int(e.max())) if bool(sel.any()) else 1
