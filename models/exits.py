"""Exit policies: how many core iterations a generated token runs (docs/CONTRACTS.md 2).

A policy is a frozen dataclass; `should_exit(policy, info, carry)` is called by the engine after
core iteration `info.depth` (1-based) of the tokens being decoded and says which of them stop
there. The depth a token stopped at is an output of generation (`exit_depths`) and an input of
replay. Prompt positions run the full depth D (`resolve_max_depth`), except the last one, which
samples token 0: it consults the policy where the family's official code exits there
(`token0_follows_policy`), so `exit_depths[0]` is its exit loop (may be below D); D itself is
recorded with the rollout (`Rollout.full_depth`), never read from `exit_depths[0]`.

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
- SampledGate(): the exit loop is an action drawn from the same gate's exit distribution:
  after iteration d (min_depth <= d < max depth) the token exits with probability lambda_d,
  decided by u_d < lambda_d with u_d = models.noise.exit_uniform(seed, position, d), so exit
  d has probability lambda_d prod_{min<=i<d} (1 - lambda_i) and the max depth takes the rest.
  Its log-probability (`exit_step_logprob`, summed over the iterations a token ran) is
  recorded with the rollout and recomputed by the learner from the recorded depths.

Every policy also exits at its max depth (default: the model's max_depth; up to MAX_DEPTH = 255,
the wire format's bound, so a model may think longer than it was trained to) and never before
min_depth.

KV semantics of exited tokens (docs/CONTRACTS.md 3), the policy's `kv` field:

- `last_exited`: an exited token's state is frozen; deeper iterations' queries see its K/V of
  its exit iteration (Huginn's official cache behaviour with adaptive compute: a later step
  reads the latest entry a token wrote). Saves the exited token's compute.
- `full`: every token runs every iteration up to the policy's max depth (its K/V exist at
  every iteration); the exit only picks which iteration's state is read out and sampled from
  (official Ouro: `OuroForCausalLM.forward` runs all `total_ut_steps` and selects the output
  at the exit step).

None = the family's default (`default_kv`): the one its official code implements.

fast mode evaluates the criteria in fp32 as the official code does; exact mode in
fp64 from the same fp32 inputs, so another exact implementation takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor

from proto.records import MAX_DEPTH  # the deepest exit policy: exit depths travel as uint8

KV_MODES = ("full", "last_exited")
"""KV semantics of exited tokens (module doc)."""


def _check_kv(owner: str, kv: str | None) -> None:
    if kv is not None and kv not in KV_MODES:
        raise ValueError(
            f"{owner}.kv must be one of {KV_MODES} or None (family default), got {kv!r}"
        )


def _check_depth(owner: str, name: str, depth: int | None) -> None:
    if depth is None:
        return
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"{owner}.{name} must be an int in [1, {MAX_DEPTH}], got {depth!r}")


@dataclasses.dataclass(frozen=True)
class FixedDepth:
    """Every token runs exactly `depth` core iterations."""

    depth: int
    """Iterations (1 .. MAX_DEPTH; beyond the model's max_depth = thinking longer)."""
    kv: str | None = None
    """KV semantics of exited tokens ('full' | 'last_exited'; None = the family's default).
    Every token exits at `depth`, so both give the same values; recorded for the run."""

    def __post_init__(self) -> None:
        _check_depth("FixedDepth", "depth", self.depth)
        _check_kv("FixedDepth", self.kv)


@dataclasses.dataclass(frozen=True)
class _Adaptive:
    threshold: float
    """Exit threshold of the criterion."""
    min_depth: int = 1
    """No exit before this many iterations."""
    max_depth: int | None = None
    """Forced exit here; None = the model's max_depth."""
    kv: str | None = None
    """KV semantics of exited tokens ('full' | 'last_exited'; None = the family's default)."""

    def __post_init__(self) -> None:
        _check_kv(type(self).__name__, self.kv)
        _check_depth(type(self).__name__, "max_depth", self.max_depth)
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
    kv: str | None = None
    """KV semantics of exited tokens ('full' | 'last_exited'; None = the family's default)."""

    def __post_init__(self) -> None:
        _check_kv("OuroGate", self.kv)
        _check_depth("OuroGate", "max_depth", self.max_depth)
        if not 0.0 < self.q <= 1.0:
            raise ValueError(f"OuroGate.q must be in (0, 1], got {self.q}")
        if self.min_depth < 1:
            raise ValueError("OuroGate.min_depth must be >= 1")
        if self.max_depth is not None and self.max_depth < self.min_depth:
            raise ValueError("OuroGate.max_depth must be >= min_depth")


@dataclasses.dataclass(frozen=True)
class SampledGate:
    """The exit loop sampled from the model's exit gate (module doc): a stochastic action with
    a log-probability, trained by the learner's exit term (objective.exit_coef)."""

    min_depth: int = 1
    """No exit before this many iterations (the gate is not consulted before)."""
    max_depth: int | None = None
    """Forced exit here; None = the model's max_depth."""
    kv: str | None = None
    """KV semantics of exited tokens ('full' | 'last_exited'; None = the family's default)."""

    def __post_init__(self) -> None:
        _check_kv("SampledGate", self.kv)
        _check_depth("SampledGate", "max_depth", self.max_depth)
        if isinstance(self.min_depth, bool) or not isinstance(self.min_depth, int):
            raise ValueError(f"SampledGate.min_depth must be an int, got {self.min_depth!r}")
        if self.min_depth < 1:
            raise ValueError("SampledGate.min_depth must be >= 1")
        if self.max_depth is not None and self.max_depth < self.min_depth:
            raise ValueError("SampledGate.max_depth must be >= min_depth")


ExitPolicy = FixedDepth | LatentDiff | KL | EntropyDiff | OuroGate | SampledGate


@dataclasses.dataclass
class StepInfo:
    """What the engine knows about N decoding rows after core iteration `depth`."""

    depth: int | Tensor
    """Iterations completed (1-based); or per row, a [N] int64 tensor (decode by ticks,
    models.engine.ticks: each row at its own iteration)."""
    max_depth: int
    """The resolved max depth (forced exit)."""
    state: Tensor
    """[N, h] state after this iteration."""
    prev_state: Tensor
    """[N, h] state before it."""
    logits: Tensor | None = None
    """[N, V] readout logits of `state` (KL / EntropyDiff)."""
    gate_logit: Tensor | None = None
    """[N] exit-gate logit of `state` (OuroGate, SampledGate)."""
    uniform: Tensor | None = None
    """[N] float64 `models.noise.exit_uniform` of each row at this depth (SampledGate)."""
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
    """The depth prompt positions run and the forced-exit depth of `policy` (its own max depth,
    else the model's; deeper than the model's is allowed up to MAX_DEPTH)."""
    depth = policy.depth if isinstance(policy, FixedDepth) else policy.max_depth
    depth = model_max_depth if depth is None else depth
    if depth > MAX_DEPTH:
        raise ValueError(
            f"{type(policy).__name__} asks for depth {depth} > {MAX_DEPTH} (exit depths travel "
            "as uint8)"
        )
    return depth


def default_kv(config: Any) -> str:
    """The KV semantics a family's official code implements: 'last_exited' for Huginn (its
    cache), 'full' for the others (Ouro runs every step; Nanbeige and Llama never exit early).
    `config` is a `models.config` family config (or anything with its `model_type`)."""
    return "last_exited" if getattr(config, "model_type", "") == "huginn_raven" else "full"


def token0_follows_policy(policy: ExitPolicy | None, config: Any) -> bool:
    """Whether the last prompt position (which samples response token 0) consults `policy`
    (else it runs the full depth), as each family's official code does (docs/MODELS.md):

    - Ouro: yes. `OuroForCausalLM.forward` applies its exit threshold at every position whose
      logits it returns, the prompt's last one in the prefill forward included.
    - Huginn: no. `generate_with_adaptive_compute` (seal-rg/recurrent-pretraining
      `raven_modeling_minimal.py`) checks no exit criterion in the prefill step ("do not exit
      in prefill"): token 0 comes from the full recurrence.
    - Nanbeige (no public modeling file) and Llama (one loop): as Ouro.

    A policy whose criterion reads the readout logits (KL, EntropyDiff) never applies there:
    the readout of a prompt position sees the coda K/V of the prompt positions before it,
    which exist at their final state only after the prompt's last iteration (a prefill split
    into chunks would decide differently), so token 0 runs the full depth under it."""
    if policy is None or isinstance(policy, FixedDepth) or needs_logits(policy):
        return False
    return getattr(config, "model_type", "") != "huginn_raven"


def resolve_kv(policy: ExitPolicy | None, config: Any) -> str:
    """`policy.kv`, or the family's default when the policy leaves it None (or is None)."""
    kv = None if policy is None else policy.kv
    return default_kv(config) if kv is None else kv


def check_kv(kv: str) -> str:
    """`kv` if it is one of KV_MODES, else ValueError naming them."""
    _check_kv("kv", kv)
    return kv


_KINDS: dict[str, type] = {
    "fixed": FixedDepth,
    "latent_diff": LatentDiff,
    "kl": KL,
    "entropy_diff": EntropyDiff,
    "ouro_gate": OuroGate,
    "sampled_gate": SampledGate,
}


def policy_kind(policy: ExitPolicy) -> str:
    """The ``kind`` of `policy`: "fixed" | "latent_diff" | "kl" | "entropy_diff" | "ouro_gate" |
    "sampled_gate" (its name in `policy_to_dict`, the run config and the flag)."""
    for kind, cls in _KINDS.items():
        if type(policy) is cls:
            return kind
    raise ValueError(f"unknown exit policy {policy!r}")


def policy_to_dict(policy: ExitPolicy | None) -> dict[str, Any] | None:
    """The mapping form of an exit policy (None for None): {"kind": `policy_kind`, **its
    fields}, as rollout.exit_policy writes it; what crosses a process boundary (the
    --exit-policy flag as its JSON, vLLM's additional_config, the learner's Welcome.exit_policy), read
    back
    by `parse_policy`."""
    if policy is None:
        return None
    return {"kind": policy_kind(policy), **dataclasses.asdict(policy)}


def policy_from_dict(d: Mapping[str, Any] | None) -> ExitPolicy | None:
    """Inverse of `policy_to_dict` (ValueError naming the allowed kinds / fields)."""
    if d is None:
        return None
    if not isinstance(d, Mapping) or d.get("kind") not in _KINDS:
        raise ValueError(f"exit_policy needs 'kind' in {sorted(_KINDS)}, got {d!r}")
    cls = _KINDS[d["kind"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    args = {k: v for k, v in d.items() if k != "kind"}
    unknown = set(args) - fields
    if unknown:
        raise ValueError(
            f"exit_policy {d['kind']!r}: unknown fields {sorted(unknown)} (expected some of "
            f"{sorted(fields)})"
        )
    return cls(**args)  # type: ignore[no-any-return]


def parse_policy(value: ExitPolicy | Mapping[str, Any] | str | None) -> ExitPolicy | None:
    """The exit policy `value` states, whatever form it came in: a policy (returned as is),
    `policy_to_dict`'s mapping, that mapping as JSON or YAML text (a command line; the Welcome
    of a learner before protocol 1.8, which sent it as canonical JSON), or None / '' / {} (full depth: None).
    ValueError (or TypeError for a field of the wrong type) naming what is wrong."""
    if value is None or isinstance(value, ExitPolicy):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)  # JSON first: YAML 1.1 would read 1e-3 as a string
        except json.JSONDecodeError:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                why = " ".join(str(e).split())
                raise ValueError(f"exit_policy {value!r}: neither JSON nor YAML ({why})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"exit_policy must be a mapping with a 'kind', got {value!r}")
    return policy_from_dict(value) if value else None


def needs_logits(policy: ExitPolicy) -> bool:
    """Whether `should_exit` needs readout logits at every iteration."""
    return isinstance(policy, KL | EntropyDiff)


def needs_gate(policy: ExitPolicy) -> bool:
    """Whether `should_exit` needs the exit-gate logit at every iteration."""
    return isinstance(policy, OuroGate | SampledGate)


def exit_step_entropy(
    gate_logit: Tensor, depth: int, min_depth: int, forced: Tensor, mode: str
) -> Tensor:
    """The entropy of the exit decision after iteration ``depth`` (a sampled exit), per row:
    H(Bernoulli(sigmoid(g))) where the gate is consulted (min_depth <= depth < forced), else 0.
    Summed over a token's iterations: the entropy of its exit decisions along the sampled path
    (in expectation the exit distribution's entropy, by the chain rule)."""
    dt = torch.float64 if mode == "exact" else torch.float32
    g = gate_logit.to(dt).reshape(-1)
    h = -(torch.sigmoid(g) * F.logsigmoid(g) + torch.sigmoid(-g) * F.logsigmoid(-g))
    if depth < min_depth:
        return torch.zeros_like(h)
    return torch.where(forced.to(g.device) > depth, h, torch.zeros_like(h))


def is_sampled(policy: ExitPolicy | None) -> bool:
    """Whether exits are sampled actions with log-probabilities (`SampledGate`)."""
    return isinstance(policy, SampledGate)


def exit_step_logprob(
    gate_logit: Tensor, stop: Tensor, depth: int | Tensor, min_depth: int, forced: Tensor,
    mode: str,
) -> Tensor:  # fmt: skip
    """The log-probability one iteration adds to a sampled exit's (SampledGate): per row,
    log sigmoid(g) if the row exits after iteration ``depth``, log sigmoid(-g) if it goes on,
    0 where the gate is not consulted (depth < min_depth, or depth >= the row's forced exit
    depth ``forced``), -inf for an exit before min_depth (impossible). A token's exit log-prob
    is the sum over the iterations it ran, so the exits min_depth..D form one distribution.
    fp64 in exact mode, fp32 in fast (as should_exit evaluates the gate). gate_logit [N],
    stop [N] bool, forced [N] int; ``depth`` an int or each row's own ([N] int64: decode by
    ticks; the same values as one call per distinct depth, with no host sync)."""
    dt = torch.float64 if mode == "exact" else torch.float32
    g = gate_logit.to(dt).reshape(-1)
    stop = stop.to(g.device)
    term = torch.where(stop, F.logsigmoid(g), F.logsigmoid(-g))
    if isinstance(depth, Tensor):
        d = depth.to(g.device).reshape(-1)
        early = torch.where(stop, torch.full_like(term, -math.inf), torch.zeros_like(term))
        late = torch.where(forced.to(g.device) > d, term, torch.zeros_like(term))
        return torch.where(d < min_depth, early, late)
    if depth < min_depth:
        return torch.where(stop, torch.full_like(term, -math.inf), torch.zeros_like(term))
    return torch.where(forced.to(g.device) > depth, term, torch.zeros_like(term))


def should_exit(
    policy: ExitPolicy, info: StepInfo, carry: ExitCarry | None = None
) -> tuple[Tensor, ExitCarry]:
    """Bool [N] on the state's device: rows that stop after iteration `info.depth`; and the
    carry for the next call.

    Call once per iteration, with depth 1, 2, ... in order, with the same rows each time (the
    engine masks out rows that already stopped). With per-row depths (a [N] tensor) and every
    input on one device it reads nothing back to the host, so it can run inside a CUDA graph
    (`models.engine.tickgraph`).
    """
    carry = carry if carry is not None else ExitCarry()
    n = info.state.shape[0]
    dt = torch.float64 if info.mode == "exact" else torch.float32
    dev = info.state.device
    last = info.depth >= info.max_depth  # per row when depth is (decode by ticks)
    per_row = isinstance(last, Tensor)
    if isinstance(last, Tensor):
        forced = last.reshape(n).to(dev)
    else:
        forced = torch.full((n,), last, dtype=torch.bool, device=dev)
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
        if per_row:  # the last iteration (of each row) takes what remains
            p = torch.where(forced.to(lam.device), remaining, lam * remaining)
        else:
            p = remaining if info.depth >= info.max_depth else lam * remaining
        carry.remaining = remaining * (1.0 - lam)
        carry.cumulative = cumulative + p
        hit = carry.cumulative >= policy.q
    elif isinstance(policy, SampledGate):
        assert info.gate_logit is not None, "SampledGate needs the gate logit"
        assert info.uniform is not None, "SampledGate needs the exit uniforms"
        lam = torch.sigmoid(info.gate_logit.to(dt).reshape(n))
        hit = info.uniform.to(lam.device) < lam.to(torch.float64)
    else:  # pragma: no cover
        raise TypeError(f"unknown exit policy {policy!r}")
    deep = info.depth >= policy.min_depth
    hit = hit.to(dev) & (deep.reshape(n).to(dev) if isinstance(deep, Tensor) else bool(deep))
    return hit | forced, carry


__all__ = [
    "KL",
    "EntropyDiff",
    "ExitCarry",
    "ExitPolicy",
    "FixedDepth",
    "KV_MODES",
    "LatentDiff",
    "OuroGate",
    "SampledGate",
    "StepInfo",
    "check_kv",
    "default_kv",
    "exit_step_entropy",
    "exit_step_logprob",
    "is_sampled",
    "needs_gate",
    "needs_logits",
    "parse_policy",
    "policy_from_dict",
    "policy_kind",
    "policy_to_dict",
    "resolve_kv",
    "resolve_max_depth",
    "should_exit",
    "token0_follows_policy",
]
