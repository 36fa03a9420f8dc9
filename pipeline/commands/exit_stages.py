"""Ouro's exit-gate training stages, the last part of a warm start (``warm_start.gate_steps``,
docs/TASKS.md "Mixed depth"): every loop's readout and the exit gate trained on the per-loop
losses of the reference answers, before RL.

Ouro's exit distribution over the loops (`exit_log_pdf`), its stage-I loss
(`gate_loss_entropy`: every parameter, every loop's readout under the exit distribution) and
stage-II loss (`gate_loss_adaptive`: the gate alone, taught whether the next loop still lowers
the token's loss), the per-loop cross-entropies and gate logits of a batch (`loop_losses`), and
the training loop (`gate_steps`). benchmarks/loop_credit.py's ``--gate-warm-steps`` runs the
same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.engine.chunk import KVCache, run_chunk
from models.errors import ConfigError
from pipeline.config.sections import GateObjective


def exit_log_pdf(gate_KN: Tensor) -> Tensor:
    """log p(t) [K, N] of Ouro's exit distribution over loops t = 1..K from the gate logits
    after each loop [K, N] (models.exits.OuroGate's lambda_t = sigmoid(g_t)):
    p(t) = lambda_t prod_{j<t} (1 - lambda_j) for t < K, p(K) = prod_{j<K} (1 - lambda_j)
    (the last loop takes the remaining mass; g_K is not used). In log space: logsigmoid."""
    zero = torch.zeros_like(gate_KN[:1])
    log_before = torch.cat([zero, F.logsigmoid(-gate_KN[:-1]).cumsum(0)])  # log S_{t-1}
    return log_before + torch.cat([F.logsigmoid(gate_KN[:-1]), zero])


def gate_loss_entropy(loss_KN: Tensor, gate_KN: Tensor, beta: float) -> Tensor:
    """Ouro's stage-I objective (the paper's entropy-regularised loss over the loops): per
    token sum_t p(t) L_t - beta H(p), p = exit_log_pdf's distribution, L_t the token's
    cross-entropy read out after loop t; the mean over the N tokens. Gradients reach the
    model through every L_t and the gate through p."""
    logp = exit_log_pdf(gate_KN)
    p = logp.exp()
    return ((p * loss_KN).sum(0) + beta * (p * logp).sum(0)).mean()


def gate_loss_adaptive(loss_KN: Tensor, gate_KN: Tensor, slope: float, margin: float) -> Tensor:
    """Ouro's stage-II adaptive gate loss (the paper's, as read): after loop t < K the gate is
    taught whether loop t + 1 still lowers the token's loss. Gain I_t = max(0, L_t - L_{t+1})
    (no gradient), the ideal probability of going on w_t = sigmoid(slope (I_t - margin)) (the
    paper's k = 50, gamma = 0.005), and the binary cross-entropy of the gate's own
    probability of going on, 1 - lambda_t = sigmoid(-g_t), against w_t:

        - mean_{t < K, tokens} [ w_t log sigmoid(-g_t) + (1 - w_t) log sigmoid(g_t) ]

    Only the gate is trained by it (the per-loop losses are the fixed model's)."""
    gain = (loss_KN[:-1] - loss_KN[1:]).detach().clamp_min(0.0)
    w = torch.sigmoid(slope * (gain - margin))
    g = gate_KN[:-1]
    return -(w * F.logsigmoid(-g) + (1.0 - w) * F.logsigmoid(g)).mean()


def check_gate_family(model: Any) -> None:
    """ConfigError unless ``model`` has an exit gate read on its state and no coda (ouro)."""
    dev = next(model.parameters()).device
    gate = model.gate_logit(torch.zeros(1, model.hidden_size, device=dev), "fast")
    if gate is None or model.coda_blocks():
        raise ConfigError(
            f"warm_start.gate_steps: needs a family with an exit gate read on its state "
            f"(ouro); {type(model).__name__} has none (set warm_start.gate_steps=0)"
        )


def loop_losses(model: Any, ids: Tensor, mask: Tensor, seeds: list[int], mode: str,
                model_grad: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per loop k = 1..D (the model's max depth) and target token n (``mask`` [B, S - 1] > 0:
    position t predicts token t + 1 of ``ids`` [B, S]): (cross-entropy [K, N] of the target
    read out after loop k, the exit-gate logit [K, N] of the state after loop k). Loop k's
    readout of a full-depth forward is the depth-k forward's (kv 'full': later iterations of
    earlier positions never feed loop k; Ouro has no coda and reads its state out directly, so
    the readout's input is the state the gate sees: ChunkOut.hidden), hence one run_chunk per
    depth, every position at depth k. model_grad=False: the forwards without a graph, the
    gate's logits with one (stage II). ConfigError for a family without such a gate."""
    check_gate_family(model)
    dev = next(model.parameters()).device
    ids, mask = ids.to(dev), mask.to(dev)
    sel = mask > 0
    targets = ids[:, 1:][sel]
    bsz, seq = ids.shape
    pos = torch.arange(seq, device=dev).expand(bsz, seq)
    ones = torch.ones(bsz, seq, dtype=torch.bool, device=dev)
    ce, gate = [], []
    for k in range(1, model.max_depth + 1):
        with torch.set_grad_enabled(model_grad and torch.is_grad_enabled()):
            out = run_chunk(model, KVCache.empty(model, bsz, seq, k), ids, pos, ones, seeds,
                            max_depth=k, depths=torch.full((bsz, seq), k), mode=mode)  # fmt: skip
            ce.append(F.cross_entropy(out.logits[:, :-1][sel].float(), targets, reduction="none"))
        gate.append(model.gate_logit(out.hidden[:, :-1][sel], mode).float())
    return torch.stack(ce), torch.stack(gate)


def gate_steps(module: Any, pick: Callable[[int], tuple[Tensor, Tensor, list[int]]], steps: int,
               objective: GateObjective, lr: float, beta: float, slope: float, margin: float,
               mode: str) -> list[float]:  # fmt: skip
    """``steps`` AdamW updates (clip 1.0, no weight decay) of ``module`` (train mode, eval again
    at the end), each on the batch ``pick(step)`` = (ids [B, S], target mask [B, S - 1], one
    latent seed per row): ``entropy`` (Ouro stage I) trains every parameter on
    gate_loss_entropy (weight ``beta``); ``adaptive`` (stage II) the exit gate's parameters
    alone on gate_loss_adaptive (``slope``, ``margin``), the per-loop losses without gradient.
    Returns the loss of each step."""
    adaptive = objective == "adaptive"
    check_gate_family(module)
    params = [p for n, p in module.named_parameters() if "exit_gate" in n or not adaptive]
    if not params:
        raise ConfigError("warm_start.gate_steps: the model has no exit-gate parameters")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    module.train()
    losses = []
    for step in range(steps):
        ids, mask, seeds = pick(step)
        ce, gate = loop_losses(module, ids, mask, seeds, mode, model_grad=not adaptive)
        if adaptive:
            loss = gate_loss_adaptive(ce, gate, slope, margin)
        else:
            loss = gate_loss_entropy(ce, gate, beta)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    module.eval()
    return losses
