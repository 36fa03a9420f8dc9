"""The exit-gate warm start (pipeline/commands/exit_stages.py; benchmarks/loop_credit.py's
--gate-warm-steps runs it): Ouro's exit distribution, the stage-I and stage-II gate losses by
hand, and the per-loop readouts against
fixed-depth forwards of a tiny Ouro.

Cost: tensor-only tests (< 1 s), tiny-model forwards and argument checks (~4 s in all)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.objective_config import ObjectiveConfig
from learner.objectives.loops import loop_weights
from models.config import tiny_config
from models.reference import build_model
from pipeline.commands import exit_stages
from tests.bench_import import load_benchmark

lc = load_benchmark("loop_credit")
lcg = load_benchmark("loop_credit_gate")


def _logit(lam: list[float]) -> torch.Tensor:
    t = torch.tensor(lam, dtype=torch.float64)
    return torch.log(t / (1 - t))


def test_exit_pdf_by_hand_and_as_the_learner_reads_it() -> None:
    # lambda = (0.5, 0.75, anything): p1 = 0.5, p2 = 0.75 * 0.5 = 0.375, p3 (last: the rest)
    # = 0.5 * 0.25 = 0.125; the last gate logit is not used
    for last in (0.1, 0.9):
        g = _logit([0.5, 0.75, last])[:, None]
        p = exit_stages.exit_log_pdf(g).exp()[:, 0]
        torch.testing.assert_close(p, torch.tensor([0.5, 0.375, 0.125], dtype=torch.float64))
    # the learner's exit_pdf loop weights of a token that ran every loop are the same numbers
    g4 = _logit([0.5, 0.25, 0.5, 0.9])
    w = loop_weights(ObjectiveConfig(loop_weighting="exit_pdf"), torch.tensor([[4]]),
                     torch.tensor([4]), g4.float().view(1, 1, 4), 4)  # fmt: skip
    torch.testing.assert_close(exit_stages.exit_log_pdf(g4[:, None].float()).exp()[:, 0], w[0, 0])


def test_stage1_entropy_loss_by_hand() -> None:
    # p = (0.5, 0.375, 0.125), L = (2, 1, 0.5): E_p[L] = 1 + 0.375 + 0.0625 = 1.4375;
    # H(p) = 0.5 ln 2 + 0.375 ln(8/3) + 0.125 ln 8 = 0.9743148; beta 0.1 -> 1.3400685
    g = _logit([0.5, 0.75, 0.3])[:, None]
    loss = torch.tensor([[2.0], [1.0], [0.5]], dtype=torch.float64)
    h = 0.5 * math.log(2) + 0.375 * math.log(8 / 3) + 0.125 * math.log(8)
    assert abs(h - 0.9743148) < 1e-6
    got = exit_stages.gate_loss_entropy(loss, g, 0.1)
    assert abs(float(got) - (1.4375 - 0.1 * h)) < 1e-12
    assert abs(float(exit_stages.gate_loss_entropy(loss, g, 0.0)) - 1.4375) < 1e-12
    # two tokens: the mean of the two per-token losses
    g2, loss2 = torch.cat([g, g], 1), torch.cat([loss, loss + 1.0], 1)
    assert (
        abs(float(exit_stages.gate_loss_entropy(loss2, g2, 0.1)) - (1.4375 - 0.1 * h + 0.5)) < 1e-12
    )


def test_stage2_adaptive_loss_by_hand() -> None:
    # L = (2, 1, 1): gains I1 = 1, I2 = 0; slope 50, margin 0.005: w1 = sigmoid(49.75) ~ 1,
    # w2 = sigmoid(-0.25) = 0.4378235; lambda = (0.5, 0.75):
    # t=1: -log(1 - 0.5) = 0.6931472; t=2: -(0.4378235 ln 0.25 + 0.5621765 ln 0.75) = 0.7686804
    # mean 0.7309138
    g = _logit([0.5, 0.75, 0.99])[:, None].requires_grad_(True)
    loss = torch.tensor([[2.0], [1.0], [1.0]], dtype=torch.float64, requires_grad=True)
    got = exit_stages.gate_loss_adaptive(loss, g, 50.0, 0.005)
    w2 = 1 / (1 + math.exp(0.25))
    t2 = -(w2 * math.log(0.25) + (1 - w2) * math.log(0.75))
    assert abs(t2 - 0.7686804) < 1e-6
    assert abs(float(got.detach()) - (math.log(2) + t2) / 2) < 1e-12
    got.backward()
    assert loss.grad is None  # the per-loop losses are labels, not trained through
    assert g.grad is not None and float(g.grad[2, 0]) == 0.0  # the last loop's gate unused
    # a loss that rises (L2 > L1): no gain, w = sigmoid(-0.25) too
    up = exit_stages.gate_loss_adaptive(
        torch.tensor([[1.0], [1.5]]), torch.zeros(2, 1), 50.0, 0.005
    )
    w = 1 / (1 + math.exp(0.25))
    assert abs(float(up) - (-(w * math.log(0.5) + (1 - w) * math.log(0.5)))) < 1e-6


def test_loop_losses_are_the_fixed_depth_readouts() -> None:
    """Loop k's cross-entropy is that of the model run at depth k (forward_full), and the gate
    logit is the gate on that forward's state: what the docstring claims for Ouro."""
    model = build_model(tiny_config("ouro"), seed=3).eval()
    examples = [([1, 5, 9, 4], [7, 2]), ([1, 6], [8, 3, 2])]
    with torch.no_grad():
        ce, gate = lcg.loop_losses(model, examples, [11, 12], "fast")
    depth = model.max_depth
    assert ce.shape == gate.shape == (depth, 5)
    ids, mask = lcg._batch(examples, 0)
    sel = mask > 0
    for k in range(1, depth + 1):
        with torch.no_grad():
            logits = model(ids, latent_seeds=[11, 12], depth=k)[:, :-1][sel]
        want = torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel], reduction="none")
        torch.testing.assert_close(ce[k - 1], want, rtol=0, atol=1e-5)
    # the per-loop losses differ between loops (the test would pass vacuously otherwise)
    assert float((ce[0] - ce[-1]).abs().max()) > 1e-3


def test_gate_warm_start_refuses_bad_input() -> None:
    """A family without an exit gate (Huginn) and out-of-range flags: SystemExit naming them."""
    huginn = build_model(tiny_config("huginn"), seed=0)
    with pytest.raises(SystemExit, match="--gate-warm-steps: needs a family with an exit gate"):
        lcg.loop_losses(huginn, [([1, 5], [7, 2])], [0], "fast")
    for argv, flag in ((["--gate-warm-steps", "-1"], "--gate-warm-steps"),
                       (["--gate-lr", "0"], "--gate-lr"),
                       (["--gate-beta", "-0.1"], "--gate-beta"),
                       (["--gate-slope", "0"], "--gate-slope")):  # fmt: skip
        with pytest.raises(SystemExit, match=f"{flag} must be"):
            lc.main(argv)


def test_summary_counts_collapsed_seeds() -> None:
    """An arm's ``collapsed``: its seeds under half the warm start's held-out accuracy (a run
    that stayed finite but lost the task), beside the mean and the spread."""
    runs = [{"accuracy": a, "mean_depth": 4.0} for a in (0.48, 0.23, 0.24, 0.0)]
    out = lc.summarise(runs, 0.48)
    assert out["collapsed"] == 2  # 0.23 and 0.0 are under 0.24; 0.24 is not
    assert abs(out["accuracy"] - 0.2375) < 1e-12
    assert out["accuracy_seeds"] == [0.48, 0.23, 0.24, 0.0]
    assert lc.summarise(runs[:1], 0.48)["accuracy_std"] == 0.0


def test_device_flag_is_checked() -> None:
    """--device takes cpu or cuda, and cuda only where a GPU is present."""
    with pytest.raises(SystemExit, match="--device must be cpu, or cuda"):
        lc.main(["--device", "tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device must be cpu, or cuda"):
            lc.main(["--device", "cuda"])
