"""Numerics modes: every arithmetic primitive of the reference forward, in two modes.

`fast` (default): native fp32 kernels (MKL / cuBLAS / SDPA). Results depend on the kernel's
summation order, hence on batch composition and row counts; mismatch against another engine
is small and measured (docs/CONTRACTS.md 5).

`exact`: every primitive is computed in float64 from its fp32 inputs and rounded ONCE to fp32
at the end of the primitive. A second implementation (the vLLM plugin, the megatron learner)
that follows the recipe of each function below gets the same fp32 bits, because fp64
accumulation error (~1e-16 relative) is far below fp32 resolution (~6e-8), so the final
rounding erases differences of summation order, blocking, thread count and row count; and
every fp64 transcendental (exp, sqrt, sin, cos) is within an fp64 ulp across libms, which the
rounding also erases. (A flip remains possible only when an exact result lies within ~1e-16
relative of an fp32 rounding midpoint; it has not been observed.) Element-wise fp32 ops that
are single IEEE operations (residual adds, the embedding scale, the RMSNorm weight product)
are exact by themselves and stay in fp32. No fused kernels anywhere (no torch rms_norm, no
SiluAndMul op, no FMA-contracted RoPE in fp32): those round differently.

Shapes: B batch rows, S query positions, T key positions, H query heads, G key/value heads,
D head_dim. All tensors are fp32 unless stated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

NumericsMode = Literal["fast", "exact"]
MODES: tuple[str, ...] = ("fast", "exact")


def check_mode(mode: str) -> NumericsMode:
    """`mode` if it is a numerics mode, else ValueError."""
    if mode not in MODES:
        raise ValueError(f"numerics mode must be one of {MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, mode: str = "fast") -> Tensor:
    """y = x W^T (+ b).

    exact: `F.linear(x.double(), W.double(), b.double()).float()`: the dot products and the bias
    add in fp64, one rounding to fp32.
    """
    if mode == "exact":
        b = None if bias is None else bias.double()
        return F.linear(x.double(), weight.double(), b).float()
    if weight.dtype != x.dtype:  # (a .to() of the same dtype is a no-op, but a dispatch)
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


def bias_add(x: Tensor, bias: Tensor, mode: str = "fast") -> Tensor:
    """x + bias (broadcast over leading dims).

    exact: the add in fp64, rounded to fp32: the same value as the fp32 add (fp64 holds the
    correctly rounded sum of two fp32 numbers), but the bias's gradient is summed over the
    leading dims in fp64, so it does not depend on how tokens are laid out (padded rows,
    packed rows, a flat token list) beyond that one rounding.
    """
    if mode == "exact":
        return (x.double() + bias.double()).to(x.dtype)
    return x + bias


def linears(
    x: Tensor, layers: list[tuple[Tensor, Tensor | None]], mode: str = "fast"
) -> list[Tensor]:
    """`linear(x, W_i, b_i)` for several weights reading the same x (q/k/v, gate/up).

    exact: x is promoted to fp64 once, so in backward the input gradients of the projections
    add in fp64 and are rounded ONCE to fp32, like the gradient of one fused linear (the
    learner's `linear_qkv` / `linear_fc1`) is; separate promotions would round each part and
    add in fp32 (other bits). The forward values are those of `linear`.
    """
    if mode == "exact":
        xd = x.double()
        return [
            F.linear(xd, w.double(), None if b is None else b.double()).float() for w, b in layers
        ]
    return [linear(x, w, b, mode) for w, b in layers]


OPAQUE_NORM_UNDER_COMPILE = False
"""When True, `rms_norm(mode="fast")` traced by torch.compile is one opaque op running the
eager kernels (inductor's fused RMSNorm reduces in another order: other bits). Set by the
vLLM plugin when vLLM compiles its decode core (generator/vllm_plugin/models.py, generator processes
only); forward only: the op has no autograd formula, so a process that also trains compiled
blocks must leave it False."""


@torch.library.custom_op("looprl::rms_norm_fast", mutates_args=())
def _rms_norm_fast_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm(x, weight, eps, "fast")


@_rms_norm_fast_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


_FUSED_GENERATION = [False]


@contextlib.contextmanager
def fused_generation(on: bool = True) -> Iterator[None]:
    """Within: fast-mode ops on CUDA without autograd may take fused kernels (`rms_norm` in
    bf16, `rope_adjacent`): other bits than the formula, within the fast mode's tolerance.
    Entered by the torch generator engine around its generation (generator/torch_engine/engine.py)
    only, so that the learner's and the reference's forwards, with or without autograd, keep
    the formula's kernels (a no-grad old-log-prob pass equals the grad pass)."""
    before = _FUSED_GENERATION[0]
    _FUSED_GENERATION[0] = on
    try:
        yield
    finally:
        _FUSED_GENERATION[0] = before


def _fused_inference(x: Tensor) -> bool:
    """Whether a fast-mode op may take a fused CUDA kernel: inside `fused_generation`, on CUDA,
    no autograd, not traced by torch.compile (inductor fuses the formula itself). Every CPU
    path keeps the formula's kernels; exact mode never comes here."""
    return (
        _FUSED_GENERATION[0]
        and x.device.type == "cuda"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float, mode: str = "fast") -> Tensor:
    """RMSNorm as Huginn and Ouro/Llama write it: normalise in fp32, cast back, times weight.

    fast: `xf = x.float(); y = xf * rsqrt(mean(xf^2, -1) + eps); y.to(x.dtype) * weight`;
    bf16 on CUDA inside `fused_generation` (the torch engine): `F.rms_norm`, torch's fused
    kernel (fp32 inside, the weight product before the one rounding to bf16: within one bf16
    ulp of the formula; one kernel instead of seven).
    On the CPU in fp32 this is `F.rms_norm`: torch's CPU implementation runs the same kernels
    in the same order (pow, mean, + eps, rsqrt, two products; tests/models/
    test_numerics_identities.py checks the bits), with less Python in between.
    exact: `xd = x.double(); y = xd * (1 / sqrt(mean(xd^2, -1) + eps))` in fp64, rounded to fp32,
    then `* weight`: the fp32 product's value (a single IEEE product: computed in fp64, where a
    product of two fp32 numbers is exact, and rounded once), so that the weight's gradient is
    summed over the tokens in fp64 and does not depend on their layout (padded or packed rows).
    """
    if mode == "exact":
        xd = x.double()
        y = xd * (1.0 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
        yr = y.float().to(x.dtype)
        return (yr.double() * weight.double()).to(torch.promote_types(yr.dtype, weight.dtype))
    if OPAQUE_NORM_UNDER_COMPILE and torch.compiler.is_compiling():
        return _rms_norm_fast_op(x, weight, eps)  # type: ignore[no-any-return]
    if _fused_inference(x) and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # fp32 inside, one rounding to bf16
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.device.type == "cpu":  # torch's CPU rms_norm: these very kernels, in C++
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def silu_mul(gate: Tensor, up: Tensor, mode: str = "fast") -> Tensor:
    """SwiGLU inner product silu(gate) * up.

    fast: `F.silu(gate) * up` in fp32. exact: `g * sigmoid(g) * u` in fp64 with
    sigmoid(g) = 1 / (1 + exp(-g)), rounded once to fp32.
    """
    if mode == "exact":
        g = gate.double()
        return (g * torch.sigmoid(g) * up.double()).float()
    return F.silu(gate) * up


def sigmoid(x: Tensor, mode: str = "fast") -> Tensor:
    """Logistic function; exact: fp64 then one rounding to fp32."""
    if mode == "exact":
        return torch.sigmoid(x.double()).float()
    return torch.sigmoid(x.float())


def log_softmax(x: Tensor, mode: str = "fast") -> Tensor:
    """Row-wise log-softmax over the last dim, fp32 out (exact: fp64 inside)."""
    if mode == "exact":
        return torch.log_softmax(x.double(), dim=-1).float()
    return torch.log_softmax(x.float(), dim=-1)


_PAIR_SIGNS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _pair_signs(dtype: torch.dtype, device: torch.device) -> Tensor:
    """(-1, +1) as a [2] tensor (cached per dtype and device)."""
    key = (dtype, device)
    signs = _PAIR_SIGNS.get(key)
    if signs is None:
        signs = _PAIR_SIGNS[key] = torch.tensor([-1.0, 1.0], dtype=dtype, device=device)
    return signs


_VECTOR_ISA = torch.backends.cpu.get_cpu_capability()


def _complex_rope_exact(x: Tensor, cos_sin: Tensor) -> bool:
    """Whether `rope_adjacent`'s complex product gives the formula's bits (see there)."""
    return (
        x.device.type == "cpu"
        and cos_sin.device.type == "cpu"
        and x.dtype == torch.float32
        and cos_sin.dtype == torch.float32
        and x.shape[-1] % 32 == 0
        and _VECTOR_ISA in ("AVX2", "AVX512")
    )


def rope_adjacent(x: Tensor, cos_sin: Tensor, mode: str = "fast") -> Tensor:
    """Huginn RoPE on adjacent pairs (x[2i], x[2i+1]) in fp32.

    x: [..., D]; cos_sin: [..., D/2, 2] broadcastable (cos, sin), the checkpoint's `freqs_cis`
    rows at the token positions. out[2i] = x0 c - x1 s, out[2i+1] = x1 c + x0 s.
    fast: in fp32 (the official order). exact: in fp64 (the products of fp32 values are exact
    in fp64), one rounding to fp32.

    Computed as pairs * c + swap(pairs) * (-s, s): x1 (-s) = -(x1 s) and a + (-b) = a - b are
    exact IEEE identities, so these are the bits of the formula above, in 4 kernels (mul,
    flip, mul, add) plus the sign product, instead of 7. fast, fp32 on an AVX2 / AVX512 CPU
    with head_dim % 32 == 0: one complex product (x0 + i x1)(c + i s), whose ATen vector
    kernel computes x0 c, x1 s, x0 s, x1 c with one rounded multiply each and then the
    difference / sum with one rounded add each (`_mm*_mul_ps` and `hsub`, no FMA); whole
    vectors only (the inner run of head_dim / 2 complex numbers fills 2-vector chunks, so the
    scalar remainder loop never runs). tests/models/test_numerics_identities.py checks it.
    fast on CUDA inside `fused_generation` (the torch engine): the same complex product on the
    input promoted to fp32, one kernel (the CUDA kernel may contract to FMA: within the fast
    mode's tolerance, not the formula's bits), cast back to x's dtype.
    """
    if mode != "exact" and _complex_rope_exact(x, cos_sin):
        try:
            xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
            return torch.view_as_real(xc * torch.view_as_complex(cos_sin)).flatten(-2)
        except RuntimeError:  # strides view_as_complex refuses: the general path
            pass
    if mode != "exact" and _fused_inference(x):  # the torch engine on CUDA (docstring)
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
        out = torch.view_as_real(xc * torch.view_as_complex(cos_sin.float().contiguous()))
        return out.flatten(-2).to(x.dtype)
    dt = torch.float64 if mode == "exact" else torch.float32
    if mode == "exact":  # the formula's own ops: their backward is the learner's, bit for bit
        pairs = x.to(dt).unflatten(-1, (-1, 2))
        c, s = cos_sin[..., 0].to(dt), cos_sin[..., 1].to(dt)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return (
            torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2).float().to(x.dtype)
        )
    pairs = (x if x.dtype == dt else x.to(dt)).unflatten(-1, (-1, 2))
    cs = cos_sin if cos_sin.dtype == dt else cos_sin.to(dt)
    out = pairs * cs[..., :1] + pairs.flip(-1) * (cs[..., 1:] * _pair_signs(dt, cs.device))
    out = out.flatten(-2)
    if out.dtype != torch.float32:
        out = out.float()
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, mode: str = "fast") -> Tensor:
    """Split-half RoPE table for Ouro / Nanbeige / Llama: [N, 2, D] (cos, sin), fp32.

    fast (= HF `default` rope): inv_freq = 1 / theta^(arange(0, D, 2) / D) in fp32;
    angle = position * inv_freq in fp32; emb = cat(angle, angle); cos/sin in fp32.
    exact: the same formula in fp64 on the CPU, rounded once to fp32 (another implementation
    must use this table, e.g. by calling this function, not its own fp32 cos/sin cache).
    """
    dt = torch.float64 if mode == "exact" else torch.float32
    pos = positions.to("cpu", dt) if mode == "exact" else positions.to(dt)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).to(dt)
    inv_freq = 1.0 / (theta ** (exponent / head_dim))
    angle = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([angle, angle], dim=-1)
    table = torch.stack([emb.cos(), emb.sin()], dim=1).float()
    return table.to(positions.device)


def rope_half(x: Tensor, cos_sin: Tensor, mode: str = "fast") -> Tensor:
    """Split-half (neox) RoPE: x cos + rotate_half(x) sin, rotate_half(x) = cat(-x2, x1).

    x: [N, heads, D]; cos_sin: [N, 2, D] from `rope_cos_sin`. fast: fp32; exact: fp64, one
    rounding to fp32.
    """
    dt = torch.float64 if mode == "exact" else torch.float32
    xd = x.to(dt)
    cos, sin = cos_sin[:, 0, None, :].to(dt), cos_sin[:, 1, None, :].to(dt)
    half = x.shape[-1] // 2
    rot = torch.cat([-xd[..., half:], xd[..., :half]], dim=-1)
    return (xd * cos + rot * sin).float().to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, mode: str = "fast",
              ends: Tensor | None = None) -> Tensor:  # fmt: skip
    """Softmax attention with an explicit boolean mask and grouped key/value heads.

    q: [B, S, H, D]; k, v: [B, T, G, D] with H % G == 0, query head j reads kv head
    j // (H / G) (HF `repeat_kv`); mask: [B, S, T] bool, True = visible (causality and the
    exit KV semantics, contract 3, live in the mask and in which K/V the caller passes).
    Every query row must see at least one key. Returns [B, S, H * D].

    exact, the one order-defined recipe:
      1. promote q, k, v to fp64;
      2. scores[b, h, s, t] = sum_d q[b, s, h, d] k[b, t, h // (H/G), d]   (fp64)
         then scores *= 1 / sqrt(D)   (the scale as an fp64 number, applied after the dot);
      3. masked scores = -inf; m = max_t scores; e = exp(scores - m); p = e / sum_t e  (fp64);
      4. out[b, s, h, :] = sum_t p[b, h, s, t] v[b, t, h // (H/G), :]   (fp64);
      5. round out to fp32.
    fast: `F.scaled_dot_product_attention` in fp32 with the boolean mask; one query position
    on CUDA inside `fused_generation` (the torch engine's decode): the Triton kernel of
    `models.engine.attention` (reads each cached key and value once, in the cache's layout;
    ``ends``: its `key_ends(mask)` when the caller computed it once for several calls, else
    None; no other path reads it).
    """
    if mode != "exact" and q.shape[1] == 1 and DECODE_KERNEL and _fused_inference(q):
        from models.engine import attention as ea  # (Triton: imported on CUDA only)

        if ea.available(q, k, v, mask):
            return ea.decode_attention(q, k, v, mask, ends=ends)
    heads, groups, dim = q.shape[2], k.shape[2], q.shape[3]
    rep = heads // groups
    qh = q.transpose(1, 2)  # [B, H, S, D]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, G, T, D]
    if rep > 1 or torch.is_grad_enabled():  # [B, H, T, D], a copy. Without grad a repeat of 1
        # is skipped (it copied the whole K/V cache: 20 of 84 ms a decode step); with grad the
        # copy stays: autograd saves it, and the cache it came from is written in place later
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    m = mask[:, None, :, :]
    if mode == "exact":
        scores = torch.matmul(qh.double(), kh.double().transpose(-1, -2)) * (1.0 / math.sqrt(dim))
        scores = scores.masked_fill(~m, float("-inf"))
        scores = scores - scores.amax(dim=-1, keepdim=True)
        e = torch.exp(scores)
        p = e / e.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, vh.double()).float()
    elif SDPA_BACKENDS is not None and q.device.type == "cuda":
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m)
    return out.transpose(1, 2).flatten(2).to(q.dtype)


DECODE_KERNEL = True
"""Whether `attention` may take the Triton decode kernel (inside `fused_generation`); False:
SDPA (benchmarks/depth_batching.py --attn compares them)."""

SDPA_BACKENDS: list[SDPBackend] | None = None
"""fast mode on CUDA: the SDPA backends `attention` may use, in order (None: torch's choice).
Set by benchmarks (benchmarks/depth_batching.py --attn) to compare decode attention kernels."""


__all__ = [
    "MODES",
    "NumericsMode",
    "attention",
    "bias_add",
    "check_mode",
    "fused_generation",
    "linear",
    "linears",
    "log_softmax",
    "rms_norm",
    "rope_adjacent",
    "rope_cos_sin",
    "rope_half",
    "sigmoid",
    "silu_mul",
]
