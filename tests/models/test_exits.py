"""Exit policies: the criteria's formulas, min/max depth, Ouro's cumulative gate rule."""

from __future__ import annotations

import pytest
import torch

from models.exits import (
    KL,
    EntropyDiff,
    FixedDepth,
    LatentDiff,
    OuroGate,
    StepInfo,
    resolve_max_depth,
    should_exit,
)


def info(depth: int, max_depth: int = 6, **kw: torch.Tensor) -> StepInfo:
    rows = 3
    for key in ("logits", "gate_logit"):
        if key in kw:
            rows = kw[key].shape[0]
    state = kw.pop("state", torch.ones(rows, 4))
    prev = kw.pop("prev_state", torch.ones(rows, 4))
    return StepInfo(depth, max_depth, state, prev, **kw)  # type: ignore[arg-type]


def test_validation_and_max_depth() -> None:
    with pytest.raises(ValueError, match="FixedDepth.depth"):
        FixedDepth(0)
    with pytest.raises(ValueError, match="OuroGate.q"):
        OuroGate(0.0)
    with pytest.raises(ValueError, match="max_depth must be >= min_depth"):
        KL(0.1, min_depth=4, max_depth=2)
    assert resolve_max_depth(FixedDepth(3), 6) == 3
    assert resolve_max_depth(KL(0.1), 6) == 6
    assert resolve_max_depth(LatentDiff(0.1, max_depth=4), 6) == 4
    assert resolve_max_depth(FixedDepth(48), 6) == 48  # deeper than trained: allowed
    with pytest.raises(ValueError, match=r"FixedDepth.depth must be an int in \[1, 255\]"):
        resolve_max_depth(FixedDepth(256), 6)
    with pytest.raises(ValueError, match=r"KL.max_depth must be an int in \[1, 255\]"):
        KL(0.1, max_depth=300)
    with pytest.raises(ValueError, match="KL.kv must be one of"):
        KL(0.1, kv="fulll")
    with pytest.raises(ValueError, match="OuroGate.max_depth must be >= min_depth"):
        OuroGate(0.5, min_depth=3, max_depth=2)


def test_fixed_depth_exits_only_at_max() -> None:
    assert not should_exit(FixedDepth(3), info(2, 3))[0].any()
    assert should_exit(FixedDepth(3), info(3, 3))[0].all()


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_latent_diff(mode: str) -> None:
    prev = torch.tensor([[1.0, 0.0], [1.0, 0.0], [3.0, 4.0]])
    cur = torch.tensor([[1.0, 0.05], [0.0, 1.0], [3.0, 4.0]])
    # relative diffs: 0.05 / |cur| ~ 0.0499, sqrt(2) / 1, 0
    out, _ = should_exit(LatentDiff(0.06), info(2, state=cur, prev_state=prev, mode=mode))
    assert out.tolist() == [True, False, True]
    out, _ = should_exit(LatentDiff(0.06, min_depth=3), info(2, state=cur, prev_state=prev))
    assert out.tolist() == [False, False, False]
    out, _ = should_exit(LatentDiff(0.06, min_depth=3), info(6, state=cur, prev_state=prev))
    assert out.tolist() == [True, True, True]  # forced at max depth


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_kl_between_successive_distributions(mode: str) -> None:
    policy = KL(1e-3)
    flat = torch.zeros(2, 8)
    peaked = torch.tensor([[5.0] + [0.0] * 7, [0.0] * 8])
    # depth 1 compares to the uniform start: row 1 is uniform -> KL 0 -> exit
    out, carry = should_exit(policy, info(1, logits=peaked, state=flat, prev_state=flat, mode=mode))
    assert out.tolist() == [False, True]
    # depth 2: row 0 repeats its distribution -> KL 0; row 1 moves to the peaked one
    nxt = torch.tensor([[5.0] + [0.0] * 7, [5.0] + [0.0] * 7])
    out, carry = should_exit(policy, info(2, logits=nxt, state=flat, prev_state=flat), carry)
    assert out.tolist() == [True, False]
    p = torch.softmax(nxt[1], -1)
    expected = (torch.full((8,), 1 / 8) * (torch.log(torch.tensor(1 / 8)) - p.log())).sum()
    assert expected > 1e-3  # the formula is KL(prev || cur)


def test_entropy_diff() -> None:
    policy = EntropyDiff(1e-3)
    logits = torch.zeros(1, 4)
    out, carry = should_exit(policy, info(1, logits=logits))
    assert not out.any()  # |H - 100| is large
    out, _ = should_exit(policy, info(2, logits=logits), carry)
    assert out.all()


def official_exit_step(gate_logits: torch.Tensor, q: float) -> int:
    """Ouro's rule as written in OuroForCausalLM.forward: pdf, cumsum, first >= q."""
    lam = torch.sigmoid(gate_logits)
    pdf, remaining = [], torch.tensor(1.0)
    for i, lam_i in enumerate(lam):
        if i < len(lam) - 1:
            pdf.append(lam_i * remaining)
            remaining = remaining * (1 - lam_i)
        else:
            pdf.append(remaining)
    hit = torch.cumsum(torch.stack(pdf), 0) >= q
    return int(hit.float().argmax()) + 1 if hit.any() else len(lam)


@pytest.mark.parametrize("q", [0.3, 0.5, 0.8, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_ouro_gate_matches_official_rule(q: float, mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(4, generator=gen) * 2
        carry, depth = None, None
        for d in range(1, 5):
            out, carry = should_exit(
                OuroGate(q), info(d, 4, gate_logit=logits[d - 1 : d], mode=mode), carry
            )
            if out[0]:
                depth = d
                break
        assert depth == official_exit_step(logits, q)
    # constant lambda = 0.5: cumulative 0.5, 0.75, 0.875 -> q = 0.8 exits at 3
    carry, outs = None, []
    for d in range(1, 5):
        out, carry = should_exit(OuroGate(0.8), info(d, 4, gate_logit=torch.zeros(1)), carry)
        outs.append(bool(out[0]))
    assert outs == [False, False, True, True]
