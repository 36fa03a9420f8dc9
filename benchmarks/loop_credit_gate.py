"""benchmarks/loop_credit.py's exit-gate warm start (``--gate-warm-steps``): the gate trained
as Ouro trains it, on the per-loop readouts of the train answers, before RL; and the report of
the gate before and after it. Ouro's exit distribution over the loops (`exit_log_pdf`), its
stage-I loss (`gate_loss_entropy`) and stage-II loss (`gate_loss_adaptive`), the per-loop
cross-entropies and gate logits of a batch (`loop_losses`)."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.loop_credit_tasks import Task, evaluate  # noqa: E402
from models.engine.chunk import KVCache, run_chunk  # noqa: E402
from models.exits import OuroGate, SampledGate  # noqa: E402
from pipeline.commands.warm_start import _batch  # noqa: E402


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


def loop_losses(model: Any, examples: list[tuple[list[int], list[int]]], seeds: list[int],
                mode: str, model_grad: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per loop k = 1..D (the model's max depth) and target token n: (cross-entropy [K, N] of
    the target read out after loop k, the exit-gate logit [K, N] of the state after loop k).
    Loop k's readout of a full-depth forward is the depth-k forward's (kv 'full': later
    iterations of earlier positions never feed loop k; Ouro has no coda and reads its state
    out directly, so the readout's input is the state the gate sees: ChunkOut.hidden), hence
    one run_chunk per depth, every position at depth k, the targets as sft_steps masks them.
    model_grad=False: the forwards without a graph, the gate's logits with one (stage II)."""
    dev = next(model.parameters()).device
    if model.gate_logit(torch.zeros(1, model.hidden_size, device=dev), mode) is None or (
        model.coda_blocks()
    ):
        raise SystemExit(
            f"--gate-warm-steps: needs a family with an exit gate read on its state (ouro); "
            f"{type(model).__name__} has none"
        )
    ids, mask = (t.to(dev) for t in _batch(examples, 0))
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


def check_gate_args(args: argparse.Namespace) -> None:
    """SystemExit naming the flag when a gate warm-start setting is out of range."""
    for flag, ok, want in (
        ("--gate-warm-steps", args.gate_warm_steps >= 0, "an int >= 0"),
        ("--gate-lr", args.gate_lr > 0, "> 0"),
        ("--gate-beta", args.gate_beta >= 0, ">= 0"),
        ("--gate-slope", args.gate_slope > 0, "> 0"),
    ):
        if not ok:
            raise SystemExit(
                f"{flag} must be {want}, got {getattr(args, flag[2:].replace('-', '_'))}"
            )


def gate_warm(model: Any, task: Task, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """--gate-warm-steps AdamW steps (lr --gate-lr, clip 1.0) on random --warm-batch rows of
    the train split after the SFT warm start: ``adaptive`` (Ouro stage II) trains the exit
    gate's parameters alone on gate_loss_adaptive (the model's per-loop losses without
    gradient); ``entropy`` (Ouro stage I) trains every parameter on gate_loss_entropy."""
    t0 = time.perf_counter()
    rng = random.Random(f"gate/{args.data_seed}")
    adaptive = args.gate_objective == "adaptive"
    params = [p for n, p in model.named_parameters() if "exit_gate" in n or not adaptive]
    if not params:
        raise SystemExit("--gate-warm-steps: the model has no exit-gate parameters")
    opt = torch.optim.AdamW(params, lr=args.gate_lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(args.gate_warm_steps):
        ex = [(p.tokens, task.target(p)) for p in rng.sample(task.train, args.warm_batch)]
        seeds = [rng.getrandbits(32) for _ in ex]
        ce, gate = loop_losses(model, ex, seeds, mode, model_grad=not adaptive)
        if adaptive:
            loss = gate_loss_adaptive(ce, gate, args.gate_slope, args.gate_margin)
        else:
            loss = gate_loss_entropy(ce, gate, args.gate_beta)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return {"objective": args.gate_objective, "steps": args.gate_warm_steps,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def gate_report(model: Any, task: Task, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The gate as it stands, on the test split: greedy accuracy and token-mean exit depth
    under SampledGate() and OuroGate(0.5), and over the test targets (teacher-forced, seed 0)
    the mean exit distribution p(t) and the mean cross-entropy after each loop t."""
    out: dict[str, Any] = {}
    for name, pol in (("sampled_gate", SampledGate()), ("ouro_gate_0.5", OuroGate(0.5))):
        acc, depth = evaluate(model, task, pol, args.max_tokens, mode)
        out[name] = {"accuracy": acc, "mean_depth": depth}
    ex = [(p.tokens, task.target(p)) for p in task.test]
    with torch.no_grad():
        ce, gate = loop_losses(model, ex, [0] * len(ex), mode)
    out["exit_pdf"] = [round(float(x), 4) for x in exit_log_pdf(gate).exp().mean(1)]
    out["loss_at_loop"] = [round(float(x), 4) for x in ce.mean(1)]
    return out
