"""models.sampling: the counter-based sampler draws from the distribution it is given, a row's
token depends on its own (key, step) only, and greedy rows take the argmax."""

from __future__ import annotations

import math

import pytest
import torch

from models.sampling import draw, exponentials


def test_draws_follow_the_distribution() -> None:
    # 20,000 draws (keys 0..19,999, step 3) from one 6-way distribution with a -inf entry:
    # each frequency within 4 standard errors of its probability, the -inf entry never drawn
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    lp = p.log().expand(20_000, -1).contiguous()
    toks = torch.tensor(draw(lp, range(20_000), [3] * 20_000, False))
    freq = torch.bincount(toks, minlength=6).double() / 20_000
    se = (p.double() * (1 - p.double()) / 20_000).sqrt()
    assert freq[5] == 0.0
    assert bool(((freq - p.double()).abs() <= 4 * se + 1e-12).all()), freq.tolist()


def test_exponentials_are_exp1() -> None:
    q = exponentials(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert q.dtype == torch.float64 and bool((q > 0).all())
    mean, var = float(q.mean()), float(q.var())  # Exp(1): 1 and 1; n = 262,144
    assert abs(mean - 1.0) < 4 / math.sqrt(q.numel()) and abs(var - 1.0) < 0.02
    # different steps and keys give different numbers (no reuse across tokens or completions)
    q1 = exponentials(torch.arange(64, dtype=torch.int64), torch.ones(64, dtype=torch.int64), 4096)
    assert not torch.equal(q, q1) and not torch.equal(q[0], q[1])


def test_a_row_depends_on_its_own_key_and_step_only() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(8, 300, generator=g).log_softmax(-1)
    keys = [2**64 - 1, 0, 7, 2**63, 12345, 99, 3, 2**40]  # u64, edges included
    steps = [0, 5, 1, 1, 2, 0, 9, 4]
    whole = draw(lp, keys, steps, False)
    alone = [draw(lp[b : b + 1], [keys[b]], [steps[b]], False)[0] for b in range(8)]
    shuffled = draw(lp.flip(0), keys[::-1], steps[::-1], False)[::-1]
    assert whole == alone == shuffled
    assert draw(lp, keys, [s + 1 for s in steps], False) != whole  # the next token draws anew


def test_greedy_rows_take_the_argmax() -> None:
    lp = torch.tensor([[-3.0, -0.1, -2.0, -0.1], [-0.5, -1.0, -9.0, -3.0]]).log_softmax(-1)
    assert draw(lp, [1, 2], [0, 0], True) == [1, 0]  # first index on ties
    mixed = draw(lp, [1, 2], [0, 0], [True, False])
    assert mixed[0] == 1 and mixed[1] == draw(lp[1:], [2], [0], False)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_draw_on_the_gpu_is_the_cpus() -> None:
    # the torch engine draws on the logits' device: the integer bits are the same, the float64
    # log and division and the fp32 exp are CUDA's; 512 rows of a 65,536-token vocabulary at
    # several temperatures' sharpness: the same tokens as the CPU's draw
    g = torch.Generator().manual_seed(1)
    keys, steps = list(range(10**6, 10**6 + 512)), [i % 7 for i in range(512)]
    for scale in (0.5, 2.0, 8.0):
        lp = (scale * torch.randn(512, 65_536, generator=g)).log_softmax(-1)
        cpu = draw(lp, keys, steps, False)
        gpu = draw(lp.cuda(), keys, steps, False)
        assert gpu == cpu, sum(a != b for a, b in zip(gpu, cpu))
    q_cpu = exponentials(torch.tensor(keys), torch.tensor(steps), 4096)
    q_gpu = exponentials(torch.tensor(keys).cuda(), torch.tensor(steps).cuda(), 4096).cpu()
    assert float((q_gpu - q_cpu).abs().max() / q_cpu.abs().max()) < 1e-15  # libm's ulp at most


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_race_draws_the_eager_tokens() -> None:
    # inside fused_generation (the torch engine, fast mode) draw_keys runs the race compiled
    # (one fused kernel for the ~20 passes over [N, V]); its integer bits are the eager ones
    # and its exp / log may round differently: the same tokens at these sizes, two row counts
    # (dynamic shapes: the host draw's M varies)
    from models import numerics as nx
    from models.sampling import _RACE, draw_keys

    g = torch.Generator().manual_seed(2)
    for rows in (256, 37):
        lp = (2.0 * torch.randn(rows, 65_536, generator=g)).log_softmax(-1).cuda()
        k = torch.arange(5, 5 + rows, dtype=torch.int64).cuda() * 7919
        s = (torch.arange(rows, dtype=torch.int64) % 5).cuda()
        with torch.no_grad():  # (the torch engine generates without autograd)
            eager = draw_keys(lp, k, s)
            with nx.fused_generation():
                fused = draw_keys(lp, k, s)
        assert torch.equal(fused, eager)
    assert _RACE and _RACE[0] is not None  # compiled, not fallen back to the eager race
