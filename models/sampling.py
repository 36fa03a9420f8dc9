"""How a token is sampled: the distribution (``Sampling``, docs/CONTRACTS.md 4: temperature and
top_p, which the generator samples with and the learner renormalises with; the run's rollout
section is one) and the sampler's random numbers: counter-based, one batched draw for every row
of a step.

A completion's token t is drawn by the Gumbel/exponential race over the distribution actually
sampled from (models.reference.behaviour_logprobs: lp, fp32 [V])::

    key   = sampling_seed(latent_seed, offset)            (models.reference; u64)
    row   = mix(mix(key ^ 0x4558_5053_414D_504C) ^ t)    (b"EXPSAMPL"; t = tokens drawn before)
    u_v   = f64((mix(row + (v + 1) * GOLDEN) >> 11) | 1) * 2^-53      v = 0 .. V-1, in (0, 1)
    q_v   = -log(u_v)                                     (float64: Exp(1))
    token = argmax_v f64(exp(lp_v)) / q_v                 (first index on ties; greedy: argmax lp)

``mix`` is splitmix64's finaliser (models.noise, the latent noise's mixer, another domain). The
draws depend on (key, t, v) only, never on the batch a row shares or on how many numbers other
rows drew, so the torch engine (many requests in one batch, slots refilled) and
models.reference.generate give the same tokens. Replaced a per-request CPU ``torch.Generator``
whose ``exponential_`` cost ~38 us per row and token (~40% of the torch engine's generation of a
small model on the CPU); the integer part is exact on every device, the float64 log and division
are one elementwise op each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from models import numerics as nx
from models.noise import GOLDEN, _mix_t, _srl
from models.seeds import seed_to_i64 as _i64
from models.settings import check
from models.untraced import nested_trace

_log = logging.getLogger(__name__)

SAMPLE_DOMAIN = 0x4558_5053_414D_504C  # b"EXPSAMPL"


@dataclass(frozen=True)
class Sampling:
    """How the generator samples a token (contract 4); the learner renormalises the same way."""

    temperature: float = 1.0
    """Sampling temperature (> 0); the objective uses the same."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: the learner renormalises over the same nucleus."""

    def __post_init__(self) -> None:
        check(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")


def exponentials(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """float64 [N, vocab] Exp(1) draws of rows (key, step) (module doc); keys: [N] int64 (u64 as
    two's complement), steps: [N] int64 >= 0, on one device (the result's)."""
    if keys.dtype != torch.int64 or steps.dtype != torch.int64 or keys.shape != steps.shape:
        raise ValueError("keys and steps must be int64 tensors of one shape [N]")
    return _exp_draws(keys, steps, _offsets(vocab, keys.device))


def _offsets(vocab: int, dev: torch.device) -> Tensor:
    """(v + 1) * GOLDEN (wrapping) for v < vocab, int64."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=dev) * _i64(GOLDEN)


def _exp_draws(keys: Tensor, steps: Tensor, offs: Tensor) -> Tensor:
    row = _mix_t(_mix_t(keys ^ _i64(SAMPLE_DOMAIN)) ^ steps)
    bits = _mix_t(row[:, None] + offs[None, :])
    u = (_srl(bits, 11) | 1).to(torch.float64) * 2.0**-53
    return -torch.log(u)


def draw_tensor(
    lp: Tensor, keys: Sequence[int], steps: Sequence[int], greedy: bool | Sequence[bool]
) -> Tensor:
    """Each row's token from its log-probs ``lp`` [N, V] (fp32; -inf = never drawn), the row's
    sampling key (u64) and step (tokens it drew before): module doc. ``greedy`` (one flag, or
    one per row): argmax lp, no draw. int64 [N] on lp's device, nothing read back (`draw`: the
    same as a list)."""
    flags = [bool(greedy)] * lp.shape[0] if isinstance(greedy, bool) else [bool(g) for g in greedy]
    if len(flags) != lp.shape[0] or len(keys) != lp.shape[0] or len(steps) != lp.shape[0]:
        raise ValueError(f"draw: {lp.shape[0]} rows need as many keys, steps and greedy flags")
    dev = lp.device
    if all(flags):
        return draw_keys(lp, None, None)
    k = torch.tensor([_i64(int(x)) for x in keys], dtype=torch.int64, device=dev)
    s = torch.tensor([int(x) for x in steps], dtype=torch.int64, device=dev)
    drawn = draw_keys(lp, k, s)
    if not any(flags):
        return drawn
    return torch.where(torch.tensor(flags, device=dev), lp.argmax(dim=-1), drawn)


def draw_keys(lp: Tensor, keys: Tensor | None, steps: Tensor | None) -> Tensor:
    """The draw of rows whose keys (int64, u64 as two's complement) and steps are tensors on
    lp's device (no host work: a CUDA graph's readout, models.engine.tickgraph); None, None:
    greedy (argmax lp). int64 [N]. On CUDA in the torch engine's fast generation
    (`models.numerics.fused_generation`) the race runs compiled: inductor fuses the ~20
    integer and float ops over [N, V] (each a pass over N x V int64 in eager: ~1.5 ms at 256 x
    65,536 on the H200) into one kernel; the integer bits are the same, the float exp / log
    may round differently (fast mode)."""
    if keys is None or steps is None:
        return lp.argmax(dim=-1)
    offs = _offsets(lp.shape[-1], lp.device)  # (an input: inductor would fold it into int32
    # index arithmetic and overflow)
    if nx._fused_inference(lp) and _RACE != [None]:
        try:
            return _compiled_race()(lp, keys, steps, offs)
        except Exception as exc:  # noqa: BLE001  (a compiler failure: the eager race from now)
            if nested_trace(exc):  # another thread compiling (models.untraced): eager this once
                return _race(lp, keys, steps, offs)
            _log.warning("compiled draw failed (%s: %s); eager draws", type(exc).__name__, exc)
            _RACE[:] = [None]
    return _race(lp, keys, steps, offs)


def _race(lp: Tensor, keys: Tensor, steps: Tensor, offs: Tensor) -> Tensor:
    q = _exp_draws(keys, steps, offs)
    return (lp.exp().to(torch.float64) / q).argmax(dim=-1)


_RACE: list[Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None] = []
"""The compiled race (one per process); [None] after a compiler failure."""


def _compiled_race() -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    if not _RACE:
        _RACE.append(torch.compile(_race, dynamic=True))
    race = _RACE[0]
    assert race is not None
    return race


def draw(
    lp: Tensor, keys: Sequence[int], steps: Sequence[int], greedy: bool | Sequence[bool]
) -> list[int]:
    """`draw_tensor`'s tokens as a list."""
    return [int(t) for t in draw_tensor(lp, keys, steps, greedy).tolist()]


__all__ = ["SAMPLE_DOMAIN", "Sampling", "draw", "draw_keys", "draw_tensor", "exponentials"]
