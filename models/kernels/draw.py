"""A decode step's draw on CUDA in two Triton kernels: the torch engine's token and its log-prob
from the logits, in fast numerics at top_p 1.

The spec (models.sampling, docs/CONTRACTS.md 4) draws token t of a row by the exponential race
over the distribution sampled from::

    lp    = log_softmax(z),  z = logits[:vocab] / temperature       (fp32, [V])
    q_v   = -log(u_v)        u_v from the row's key, its step and v   (float64, Exp(1))
    token = argmax_v exp(lp_v) / q_v                                   (first index on ties)

and the engine keeps lp[token], the behaviour log-prob. Since lp_v = z_v - lse with lse the
row's constant, argmax exp(lp_v) / q_v = argmax (z_v - log q_v): the same token in exact
arithmetic, so the race needs no normalised lp at all. On the card the engine ran it as four
passes over [N, V] (the fp32 cast, the temperature, torch's log_softmax, the compiled race:
inductor's one reduction program per row, 256 programs over 65,536 columns each, 289 us of a
1b decode step's ~6 ms in the H100 profile of docs/PERFORMANCE.md, the four ~0.48 ms); here
one pass reads each logit once:

    pass 1, a program per (row, split of the vocabulary): the split's running max m and
            sum exp(z - m) (the softmax's), and its best race score z_v - log(q_v) with its
            index (float64, the first index on ties; a greedy row scores z_v)
    pass 2, a program per row: lse = M + log(sum_j s_j exp(m_j - M)) over the splits, the
            best split's index, lp[token] = (z_token - M) - log(sum)

The random bits are the spec's to the bit (splitmix64, u_v, -log u_v in float64); the score's
float64 log and the fp32 softmax sums round differently from the spec's division and
torch's log_softmax: fast numerics (the engine's CUDA default, `models.numerics.fused_generation`),
as the compiled race already was. `draw_step` is what the engine calls: this kernel where it
applies (CUDA, Triton, fast inference, top_p 1), else the spec's ops. Checked against them
under Triton's CPU interpreter and on CUDA: tests/models/test_kernels_draw.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models import numerics as nx
from models.kernels.noise import HAVE_TRITON
from models.reference import behaviour_logprobs
from models.sampling import SAMPLE_DOMAIN, draw_keys
from models.seeds import seed_to_i64

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from models.kernels.noise import _GOLD, _M1, _M2, _mix, _srl

__all__ = ["draw_step", "draw_triton"]


def draw_step(logits: Tensor, vocab: int, temperature: float, top_p: float, mode: str,
              keys: Tensor | None, steps: Tensor | None,
              greedy: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each row's token (int64 [N]) and its behaviour log-prob (fp32 [N]) from ``logits``
    [N, >= vocab] on one device: the race of models.sampling with the rows' sampler ``keys``
    and ``steps`` (int64 [N]; None, None: every row greedy), ``greedy`` (bool [N] or None): the
    rows drawn by argmax instead. One fused kernel pair on CUDA in fast generation at top_p 1
    (module doc), the spec's ops elsewhere; nothing read back either way."""
    if top_p >= 1.0 and mode != "exact" and HAVE_TRITON and nx._fused_inference(logits):
        return draw_triton(logits, vocab, temperature, keys, steps, greedy)
    lp = behaviour_logprobs(logits, vocab, temperature, top_p, mode)
    tok = draw_keys(lp, keys, steps)
    if greedy is not None and keys is not None:
        tok = torch.where(greedy, lp.argmax(dim=-1), tok)
    return tok, lp.gather(1, tok[:, None])[:, 0]


def draw_triton(logits: Tensor, vocab: int, temperature: float, keys: Tensor | None,
                steps: Tensor | None, greedy: Tensor | None = None, *,
                block: int = 1024, splits: int | None = None,
                warps: int = 4) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`draw_step`'s kernel pair on any tensors Triton takes (CUDA; the CPU under
    TRITON_INTERPRET=1). ``block``: columns a tile; ``splits``: programs a row (default: one
    per 4,096 columns, at most 64); ``warps``: the first kernel's (`benchmarks/draw_gpu.py
    --sweep` times the choices on a card)."""
    n = logits.shape[0]
    dev = logits.device
    if logits.dim() != 2 or logits.stride(1) != 1 or not 0 < vocab <= logits.shape[1]:
        raise ValueError(f"logits must be [N, >= {vocab}] with unit column stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    tok = torch.empty(n, dtype=torch.int64, device=dev)
    lp = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tok, lp
    s = splits or max(1, min(64, triton.cdiv(vocab, 4096)))
    span = triton.cdiv(triton.cdiv(vocab, s), block) * block  # columns a split, whole tiles
    s = triton.cdiv(vocab, span)
    part_m = torch.empty((n, s), dtype=torch.float32, device=dev)
    part_s = torch.empty((n, s), dtype=torch.float32, device=dev)
    part_b = torch.empty((n, s), dtype=torch.float64, device=dev)
    part_i = torch.empty((n, s), dtype=torch.int64, device=dev)
    all_greedy = keys is None or steps is None
    k = keys if keys is not None else tok  # (not read when every row is greedy)
    st = steps if steps is not None else tok
    g = greedy if greedy is not None else tok
    _split_kernel[(n, s)](
        logits, logits.stride(0), vocab, float(temperature), k, st, g, part_m, part_s, part_b,
        part_i, s, _M1, _M2, _GOLD, seed_to_i64(SAMPLE_DOMAIN), all_greedy,
        greedy is not None, block=block, tiles=span // block, num_warps=warps,
    )  # fmt: skip
    _row_kernel[(n,)](
        logits, logits.stride(0), float(temperature), part_m, part_s, part_b, part_i, tok, lp, s,
        sp=triton.next_power_of_2(s), num_warps=1,
    )  # fmt: skip
    return tok, lp


if HAVE_TRITON:

    @triton.jit
    def _split_kernel(x_ptr, row_stride, vocab, temp, key_ptr, step_ptr, greedy_ptr, pm_ptr,
                      ps_ptr, pb_ptr, pi_ptr, n_splits, m1: tl.constexpr,
                      m2: tl.constexpr, gold: tl.constexpr, domain: tl.constexpr,
                      all_greedy: tl.constexpr, some_greedy: tl.constexpr,
                      block: tl.constexpr, tiles: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        sid = tl.program_id(1)
        start = sid * (tiles * block)  # a split's first column
        row = tl.zeros((), tl.int64)
        is_greedy = tl.zeros((), tl.int1)
        if not all_greedy:
            key = tl.load(key_ptr + r)
            step = tl.load(step_ptr + r)
            row = _mix(_mix(key ^ domain, m1, m2) ^ step, m1, m2)
            if some_greedy:
                is_greedy = tl.load(greedy_ptr + r) != 0
        m = tl.full((), float("-inf"), tl.float32)
        acc = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float64)
        best_i = tl.full((), 2**62, tl.int64)
        for t in range(tiles):  # (a constexpr count: numpy >= 2.4's interpreter takes no
            # runtime bound, a one-element array, in Python's range)
            v = start + t * block + tl.arange(0, block)
            live = v < vocab
            z = tl.load(x_ptr + r * row_stride + v, mask=live, other=float("-inf")).to(tl.float32)
            z = z / temp
            # the softmax's running max and sum (a tile with nothing finite leaves them)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            fin = m_new > float("-inf")
            scale = tl.where(fin, tl.exp(m - m_new), 0.0)
            tile = tl.where(fin, tl.where(live, tl.exp(z - m_new), 0.0), 0.0)
            acc = acc * scale + tl.sum(tile, axis=0)
            m = m_new
            # the race: z - log(-log u), u from the spec's bits (a greedy row: z)
            if all_greedy:
                score = z.to(tl.float64)
            else:
                bits = _mix(row + (v + 1).to(tl.int64) * gold, m1, m2)
                u = (_srl(bits, 11) | 1).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
                score = z.to(tl.float64) - tl.log(-tl.log(u))
                score = tl.where(is_greedy, z.to(tl.float64), score)
            score = tl.where(live, score, float("-inf"))
            top = tl.max(score, axis=0)
            at = tl.min(tl.where(score == top, v.to(tl.int64), 2**62), axis=0)
            take = top > best  # an earlier tile keeps a tie: the first index
            best_i = tl.where(take, at, best_i)
            best = tl.where(take, top, best)
        out = r * n_splits + sid
        tl.store(pm_ptr + out, m)
        tl.store(ps_ptr + out, acc)
        tl.store(pb_ptr + out, best)
        tl.store(pi_ptr + out, best_i)

    @triton.jit
    def _row_kernel(x_ptr, row_stride, temp, pm_ptr, ps_ptr, pb_ptr, pi_ptr, tok_ptr, lp_ptr,
                    n_splits, sp: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, sp)
        live = j < n_splits
        pm = tl.load(pm_ptr + r * n_splits + j, mask=live, other=float("-inf"))
        ps = tl.load(ps_ptr + r * n_splits + j, mask=live, other=0.0)
        pb = tl.load(pb_ptr + r * n_splits + j, mask=live, other=float("-inf"))
        pi = tl.load(pi_ptr + r * n_splits + j, mask=live, other=2**62)
        big = tl.max(pm, axis=0)
        total = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - big), 0.0), axis=0)
        top = tl.max(pb, axis=0)
        tok = tl.min(tl.where(pb == top, pi, 2**62), axis=0)  # splits in column order
        z = tl.load(x_ptr + r * row_stride + tok).to(tl.float32) / temp
        tl.store(tok_ptr + r, tok)
        tl.store(lp_ptr + r, (z - big) - tl.log(total))
