"""token_stats: hand-computed values and gradients, chunking, dtypes, -inf support, memory."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from learner.vocab_ops import TokenStats, token_stats

LN = math.log
INF = float("inf")


def close(actual: object, expected: object, tol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=tol,
        rtol=0,
    )


def test_two_entry_vocab_values_and_gradients_by_hand() -> None:
    # new p = [0.8, 0.2], old q = [0.5, 0.5] (logits shifted: softmax is shift-invariant).
    z_new = torch.tensor([[LN(0.8) + 3.0, LN(0.2) + 3.0]], requires_grad=True)
    z_old = torch.tensor([[LN(0.5) - 1.0, LN(0.5) - 1.0]])
    logp, ent, kl, logp_old = full(token_stats(z_new, z_old, torch.tensor([0]), chunk=1))
    close(logp, [LN(0.8)])  # -0.2231436
    close(ent, [-(0.8 * LN(0.8) + 0.2 * LN(0.2))])  # 0.5004024
    close(kl, [0.5 * LN(0.5 / 0.8) + 0.5 * LN(0.5 / 0.2)])  # ln 1.25 = 0.2231436
    close(logp_old, [LN(0.5)])
    assert logp.dtype == ent.dtype == torch.float32
    # d logp / dz = onehot - p = [0.2, -0.2]
    (grad,) = torch.autograd.grad(logp.sum(), z_new, retain_graph=True)
    close(grad, [[0.2, -0.2]])
    # d H / dz_j = -p_j (ln p_j + H): -0.8 (ln 0.8 + 0.5004024) = -0.2218071
    (grad,) = torch.autograd.grad(ent.sum(), z_new, retain_graph=True)
    close(grad, [[-0.2218071, 0.2218071]])
    # d KL / dz = p - q = [0.3, -0.3]
    (grad,) = torch.autograd.grad(kl.sum(), z_new)
    close(grad, [[0.3, -0.3]])


def test_temperature_divides_logits_and_gradient() -> None:
    z_new = torch.tensor([[2 * LN(0.8), 2 * LN(0.2)]], requires_grad=True)
    z_old = torch.tensor([[0.0, 0.0]])
    logp, _, kl, _ = full(token_stats(z_new, z_old, torch.tensor([1]), temperature=2.0))
    close(logp, [LN(0.2)])
    close(kl, [LN(1.25)])
    (grad,) = torch.autograd.grad(logp.sum(), z_new)
    close(grad, [[-0.8 / 2, 0.8 / 2]])  # (onehot - p) / T


def test_without_old_logits_there_is_no_kl() -> None:
    s = token_stats(torch.zeros(2, 4), None, torch.tensor([0, 3]))
    assert s.kl is None and s.logp_old is None
    close(s.logp, [LN(0.25)] * 2)
    close(s.entropy, [LN(4.0)] * 2)


def full(s: TokenStats) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four outputs of a call that was given logits_old (none of them None)."""
    assert s.kl is not None and s.logp_old is not None
    return s.logp, s.entropy, s.kl, s.logp_old


def reference(
    z_new: Tensor, z_old: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Unchunked fp64 reference with plain autograd."""
    lp = torch.log_softmax(z_new.double() / temperature, -1)
    lq = torch.log_softmax(z_old.double() / temperature, -1)
    q = lq.exp()
    entropy = -(lp.exp() * lp).sum(-1)
    kl = torch.where(q > 0, q * (lq - lp), 0.0).sum(-1)
    pick = targets[:, None]
    return lp.gather(1, pick)[:, 0], entropy, kl, lq.gather(1, pick)[:, 0]


@pytest.fixture(scope="module")
def random_case():
    g = torch.Generator().manual_seed(0)
    n, v = 24, 1000
    z_new = torch.randn(n, v, generator=g)
    z_old = z_new + 0.5 * torch.randn(n, v, generator=g)
    z_old[:, 3::7] = -INF  # a truncated support on every 7th entry
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = 3  # the old policy gives this target probability 0
    upstream = torch.randn(3, n, generator=g)
    return z_new, z_old, targets, upstream


@pytest.mark.parametrize("chunk", [1, 7, 64, 333, 1000, 4096])
def test_chunking_matches_unchunked_reference(random_case, chunk: int) -> None:
    z_new, z_old, targets, up = random_case
    x64 = z_new.double().requires_grad_()
    ref = reference(x64, z_old, targets, 0.7)
    (ref[0] * up[0] + ref[1] * up[1] + ref[2] * up[2]).sum().backward()
    x = z_new.clone().requires_grad_()
    s = full(token_stats(x, z_old, targets, temperature=0.7, chunk=chunk))
    (s[0] * up[0] + s[1] * up[1] + s[2] * up[2]).sum().backward()
    for got, want in zip(s[:3], ref[:3], strict=True):
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s[3].double(), ref[3].detach(), atol=1e-6, rtol=1e-6)  # [0] is -inf
    assert s[3][0] == -INF and torch.isfinite(s[2]).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-6, rtol=1e-6)
    # and against this implementation's own single-chunk path
    y = z_new.clone().requires_grad_()
    whole = full(token_stats(y, z_old, targets, temperature=0.7, chunk=z_new.shape[1]))
    (whole[0] * up[0] + whole[1] * up[1] + whole[2] * up[2]).sum().backward()
    for got, want in zip(s[:3], whole[:3], strict=True):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-6)


def test_gradcheck_fp64() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    old = torch.randn(3, 5, dtype=torch.float64, generator=g)
    old[0, 1] = -INF
    t = torch.tensor([0, 2, 4])
    assert torch.autograd.gradcheck(lambda z: full(token_stats(z, old, t, 1.3, 2))[:3], (x,))
    assert torch.autograd.gradcheck(lambda z: token_stats(z, None, t, 0.5, 3)[:2], (x,))


def test_bf16_logits_use_fp32_math() -> None:
    g = torch.Generator().manual_seed(2)
    z16 = (3 * torch.randn(8, 300, generator=g)).bfloat16().requires_grad_()
    old16 = (3 * torch.randn(8, 300, generator=g)).bfloat16()
    t = torch.randint(0, 300, (8,), generator=g)
    s = full(token_stats(z16, old16, t, chunk=128))
    assert all(x.dtype == torch.float32 for x in s)
    (s[0] + s[1] + s[2]).sum().backward()
    assert z16.grad is not None and z16.grad.dtype == torch.bfloat16
    z32 = z16.detach().float().requires_grad_()  # exact upcast of the same numbers
    r = full(token_stats(z32, old16.float(), t, chunk=128))
    (r[0] + r[1] + r[2]).sum().backward()
    for got, want in zip(s, r, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert z32.grad is not None
    torch.testing.assert_close(z16.grad, z32.grad.bfloat16(), atol=0, rtol=0)


def test_minus_inf_old_entries_contribute_exactly_zero() -> None:
    # old q = [0.5, 0.5, 0] (third entry truncated away), new p = [0.4, 0.4, 0.2]
    z_new = torch.tensor([[LN(0.4), LN(0.4), LN(0.2)]] * 3, requires_grad=True)
    z_old = torch.tensor([[0.0, 0.0, -INF], [0.0, 0.0, -INF], [-INF, -INF, -INF]])
    s = full(token_stats(z_new, z_old, torch.tensor([0, 2, 1]), chunk=2))
    close(s[2], [LN(1.25), LN(1.25), 0.0])  # 2 * 0.5 ln(0.5 / 0.4); empty old row: 0
    assert s[3].tolist() == [pytest.approx(LN(0.5)), -INF, -INF]
    (s[0] + s[1] + s[2]).sum().backward()
    assert z_new.grad is not None and torch.isfinite(z_new.grad).all()
    # row 0: (e0 - p) + (-p (ln p + H)) + (p - q), H = 1.0549202
    h = -(0.8 * LN(0.4) + 0.2 * LN(0.2))
    p, q = [0.4, 0.4, 0.2], [0.5, 0.5, 0.0]
    want = [
        (j == 0) - p[j] - p[j] * (LN(p[j]) + h) + p[j] - q[j] for j in range(3)
    ]  # [0.4832, -0.0168, -0.4664]
    close(z_new.grad[0:1], [want])


def test_invalid_arguments_raise() -> None:
    z = torch.zeros(2, 4)
    t = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="logits_new"):
        token_stats(torch.zeros(4), None, t)
    with pytest.raises(ValueError, match="logits_old"):
        token_stats(z, torch.zeros(2, 5), t)
    with pytest.raises(ValueError, match="targets"):
        token_stats(z, None, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="temperature"):
        token_stats(z, None, t, temperature=0.0)
    with pytest.raises(ValueError, match="chunk"):
        token_stats(z, None, t, chunk=0)


def peak_bytes(fn) -> int:
    """Peak of live bytes allocated by torch's CPU allocator while fn runs (profiler view:
    every allocation and free is an event carrying its signed size)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_extra_memory_below_two_full_fp32_tensors() -> None:
    n, v = 256, 32768
    one = n * v * 4  # one [N, V] fp32 tensor: 32 MiB
    g = torch.Generator().manual_seed(3)
    z_new = torch.randn(n, v, generator=g).requires_grad_()
    z_old = torch.randn(n, v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)

    def step() -> None:
        s = full(token_stats(z_new, z_old, t))
        (s[0] + s[1] + s[2]).sum().backward()

    peak = peak_bytes(step)
    print(f"token_stats N={n} V={v}: peak extra {peak / 2**20:.1f} MiB ({peak / one:.2f}x)")
    assert z_new.grad is not None
    assert one <= peak < 2 * one  # the gradient itself is one full tensor
