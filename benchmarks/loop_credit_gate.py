"""benchmarks/loop_credit.py's exit-gate warm start (``--gate-warm-steps``): the gate trained
as Ouro trains it, on the per-loop readouts of the train answers, before RL (the product's
warm-start stage, pipeline/commands/exit_stages.py: `looprl run`'s warm_start.gate_steps runs
the same code); and the report of the gate before and after it."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.loop_credit_tasks import Task, evaluate  # noqa: E402
from models.errors import ConfigError  # noqa: E402
from models.exits import OuroGate, SampledGate  # noqa: E402
from pipeline.commands import exit_stages  # noqa: E402
from pipeline.commands.warm_start import _batch  # noqa: E402


def loop_losses(model: Any, examples: list[tuple[list[int], list[int]]], seeds: list[int],
                mode: str, model_grad: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    """pipeline.commands.exit_stages.loop_losses on ``examples`` (prompt tokens, target tokens)
    batched as sft_steps batches them: (cross-entropy [K, N], exit-gate logit [K, N]) per loop
    and target token; SystemExit naming the flag for a family without an exit gate."""
    ids, mask = _batch(examples, 0)
    try:
        return exit_stages.loop_losses(model, ids, mask, seeds, mode, model_grad)
    except ConfigError as e:
        raise SystemExit(f"--gate-warm-steps: needs a family with an exit gate ({e})") from None


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

    def pick(_: int) -> tuple[Tensor, Tensor, list[int]]:
        ex = [(p.tokens, task.target(p)) for p in rng.sample(task.train, args.warm_batch)]
        seeds = [rng.getrandbits(32) for _ in ex]
        return (*_batch(ex, 0), seeds)

    try:
        losses = exit_stages.gate_steps(model, pick, args.gate_warm_steps, args.gate_objective,
                                        args.gate_lr, args.gate_beta, args.gate_slope,
                                        args.gate_margin, mode)  # fmt: skip
    except ConfigError as e:
        raise SystemExit(f"--gate-warm-steps: {e}") from None
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
    out["exit_pdf"] = [round(float(x), 4) for x in exit_stages.exit_log_pdf(gate).exp().mean(1)]
    out["loss_at_loop"] = [round(float(x), 4) for x in ce.mean(1)]
    return out
