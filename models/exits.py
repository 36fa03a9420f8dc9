"""Exit policies: how many core iterations a generated token runs (DESIGN contract 2).

A policy is a frozen dataclass; `should_exit(policy, info, carry)` is called by the engine after
core iteration `info.depth` (1-based) of the tokens being decoded and says which of them stop
there. The depth a token stopped at is an output of generation (`exit_depths`) and an input of
replay. Prompt positions never consult a policy: they run the full depth
(`resolve_max_depth`), so `exit_depths[0]` is that depth.

Criteria (Huginn's from `generate_with_adaptive_compute` in seal-rg/recurrent-pretraining
`raven_modeling_minimal.py`; Ouro's from `OuroForCausalLM.forward` in `modeling_ouro.py`):

- FixedDepth(d): every token runs d iterations.
- LatentDiff(thr): exit when ||s_d - s_{d-1}|| / ||s_d|| < thr (L2 over the hidden dim, s = the
  core's output state before any readout norm; s_0 = the initial state).
- KL(thr): exit when KL(P_{d-1} || P_d) = sum_v P_{d-1}(v) (log P_{d-1}(v) - log P_d(v)) < thr,
  P_d = softmax(readout logits after iteration d) over the full (padded) vocab, no temperature;
  P_0 = uniform.
- EntropyDiff(thr): exit when |H_d - H_{d-1}| < thr, H = -sum p log(p + 1e-10); H_0 = 100.
- OuroGate(q): lambda_d = sigmoid(gate(s_d)), s_d = the normed state after step d;
  p_d = lambda_d * R_{d-1}, R_d = R_{d-1} (1 - lambda_d), R_0 = 1; exit at the first d with
  cumulative sum_{i<=d} p_i >= q (the official cumsum-threshold rule).

Every policy also exits at its max depth (default: the model's max_depth) and never before
min_depth. fast mode evaluates the criteria in fp32 as the official code does; exact mode in
fp64 from the same fp32 inputs, so another exact implementation takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class FixedDepth:
    """Every token runs exactly `depth` core iterations."""

    depth: int
    """Iterations (1 .. model max_depth)."""

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"FixedDepth.depth must be an int >= 1, got {self.depth!r}")


@dataclasses.dataclass(frozen=True)
class _Adaptive:
    threshold: float
    """Exit threshold of the criterion."""
    min_depth: int = 1
    """No exit before this many iterations."""
    max_depth: int | None = None
    """Forced exit here; None = the model's max_depth."""

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, int | float) or not math.isfinite(self.threshold):
            raise ValueError(f"{type(self).__name__}.threshold must be a finite number")
        if self.min_depth < 1:
            raise ValueError(f"{type(self).__name__}.min_depth must be >= 1")
        if self.max_depth is not None and self.max_depth < self.min_depth:
            raise ValueError(f"{type(self).__name__}.max_depth must be >= min_depth")


@dataclasses.dataclass(frozen=True)
class LatentDiff(_Adaptive):
    """Huginn 'latent-diff': relative change of the latent state below threshold."""


@dataclasses.dataclass(frozen=True)
class KL(_Adaptive):
    """Huginn 'kl': KL divergence between successive iterations' output distributions."""


@dataclasses.dataclass(frozen=True)
class EntropyDiff(_Adaptive):
    """Huginn 'entropy-diff': change of the output entropy below threshold."""


@dataclasses.dataclass(frozen=True)
class OuroGate:
    """Ouro's learned exit gate: exit once the cumulative exit probability reaches q."""

    q: float
    """Threshold on the cumulative exit probability, in (0, 1]."""
    min_depth: int = 1
    """No exit before this many iterations."""
    max_depth: int | None = None
    """Forced exit here; None = the model's max_depth."""

    def __post_init__(self) -> None:
        if not 0.0 < self.q <= 1.0:
            raise ValueError(f"OuroGate.q must be in (0, 1], got {self.q}")
        if self.min_depth < 1:
            raise ValueError("OuroGate.min_depth must be >= 1")


ExitPolicy = FixedDepth | LatentDiff | KL | EntropyDiff | OuroGate


@dataclasses.dataclass
class StepInfo:
    """What the engine knows about N decoding rows after core iteration `depth`."""

    depth: int
    """Iterations completed (1-based)."""
    max_depth: int
    """The resolved max depth (forced exit)."""
    state: Tensor
    """[N, h] state after this iteration."""
    prev_state: Tensor
    """[N, h] state before it."""
    logits: Tensor | None = None
    """[N, V] readout logits of `state` (KL / EntropyDiff)."""
    gate_logit: Tensor | None = None
    """[N] exit-gate logit of `state` (OuroGate)."""
    mode: str = "fast"
    """Numerics mode."""


@dataclasses.dataclass
class ExitCarry:
    """Per-row values carried from one iteration to the next."""

    prev_logprobs: Tensor | None = None
    prev_entropy: Tensor | None = None
    remaining: Tensor | None = None
    cumulative: Tensor | None = None


def resolve_max_depth(policy: ExitPolicy, model_max_depth: int) -> int:
    """The depth prompt positions run and the forced-exit depth of `policy`."""
    depth = policy.depth if isinstance(policy, FixedDepth) else policy.max_depth
    depth = model_max_depth if depth is None else depth
    if depth > model_max_depth:
        raise ValueError(
            f"{type(policy).__name__} asks for depth {depth} > the model's max_depth "
            f"{model_max_depth}"
        )
    return depth


def needs_logits(policy: ExitPolicy) -> bool:
    """Whether `should_exit` needs readout logits at every iteration."""
    return isinstance(policy, KL | EntropyDiff)


def needs_gate(policy: ExitPolicy) -> bool:
    """Whether `should_exit` needs the exit-gate logit at every iteration."""
    return isinstance(policy, OuroGate)


def should_exit(
    policy: ExitPolicy, info: StepInfo, carry: ExitCarry | None = None
) -> tuple[Tensor, ExitCarry]:
    """Bool [N]: rows that stop after iteration `info.depth`; and the carry for the next call.

    Call once per iteration, with depth 1, 2, ... in order, with the same rows each time (the
    engine masks out rows that already stopped).
    """
    carry = carry if carry is not None else ExitCarry()
    n = info.state.shape[0]
    dt = torch.float64 if info.mode == "exact" else torch.float32
    forced = torch.full((n,), info.depth >= info.max_depth, dtype=torch.bool)
    if isinstance(policy, FixedDepth):
        return forced, carry
    if isinstance(policy, LatentDiff):
        cur, prev = info.state.to(dt), info.prev_state.to(dt)
        value = (prev - cur).norm(dim=-1) / cur.norm(dim=-1)
        hit = value < policy.threshold
    elif isinstance(policy, KL):
        assert info.logits is not None, "KL needs logits"
        logp = torch.log_softmax(info.logits.to(dt), dim=-1)
        if carry.prev_logprobs is None:
            prev = torch.full_like(logp, 1.0 / logp.shape[-1]).log()
        else:
            prev = carry.prev_logprobs
        value = (prev.exp() * (prev - logp)).sum(dim=-1)
        carry.prev_logprobs = logp
        hit = value < policy.threshold
    elif isinstance(policy, EntropyDiff):
        assert info.logits is not None, "EntropyDiff needs logits"
        probs = torch.softmax(info.logits.to(dt), dim=-1)
        entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)
        prev_h = carry.prev_entropy
        prev_h = torch.full_like(entropy, 100.0) if prev_h is None else prev_h
        value = (entropy - prev_h).abs()
        carry.prev_entropy = entropy
        hit = value < policy.threshold
    elif isinstance(policy, OuroGate):
        assert info.gate_logit is not None, "OuroGate needs the gate logit"
        lam = torch.sigmoid(info.gate_logit.to(dt).reshape(n))
        remaining = carry.remaining if carry.remaining is not None else torch.ones_like(lam)
        cumulative = carry.cumulative if carry.cumulative is not None else torch.zeros_like(lam)
        p = remaining if info.depth >= info.max_depth else lam * remaining
        carry.remaining = remaining * (1.0 - lam)
        carry.cumulative = cumulative + p
        hit = carry.cumulative >= policy.q
    else:  # pragma: no cover
        raise TypeError(f"unknown exit policy {policy!r}")
    hit = hit.cpu() & torch.tensor(info.depth >= policy.min_depth)
    return hit | forced, carry


__all__ = [
    "KL",
    "EntropyDiff",
    "ExitCarry",
    "ExitPolicy",
    "FixedDepth",
    "LatentDiff",
    "OuroGate",
    "StepInfo",
    "needs_gate",
    "needs_logits",
    "resolve_max_depth",
    "should_exit",
]
