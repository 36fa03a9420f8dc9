"""Low-rank adapters on a plain-PyTorch looped model (the reference backend's policy).

`apply_lora(model, cfg, seed)` freezes every parameter of ``model`` and gives each linear whose
Hugging Face module name matches one of ``cfg.targets`` (fnmatch) a `LoraFactors`
parametrization: reading ``linear.weight`` then returns the merged weight
``models.lora.merged_weight(W, s B A)``, so every forward (models.engine.chunk, whose layers read
``.weight``) runs the adapted model unchanged, activation recompute included, and in numerics
exact the merged weight it trains with is the one it publishes (docs/CONTRACTS.md 5). A looped
core block is one set of modules run at every iteration, so its adapters are shared across
iterations as its weights are.

Factors: A [r, in] uniform in +-1/sqrt(in) from one torch.Generator(seed), the targets taken in
sorted-name order; B [out, r] zero, so the adapted model starts equal to its base bit for bit.
Only A and B (and, with ``cfg.train_norms``, the RMSNorm weights; with
``cfg.train_embeddings``, the token embedding, a tied head with it) require grad: an optimizer
built over the parameters that require grad (learner.torch_policy.TorchNet) holds those only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from learner.config import LoraConfig
from models.errors import ConfigError
from models.layers import RMSNorm
from models.lora import lora_delta, merged_weight

__all__ = [
    "Adapters",
    "LoraFactors",
    "apply_lora",
    "check_dropout",
    "frozen_weights",
    "initial_a",
    "linear_names",
    "merged_state",
    "select_targets",
]

_ORIGINAL = ".parametrizations.weight.original"
_FACTORS = ".parametrizations.weight.0."


class LoraFactors(nn.Module):
    """The parametrization of one adapted weight W [out, in]: W -> W + scale * B A (models.lora)."""

    def __init__(self, lora_a: Tensor, out_features: int, scale: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(lora_a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, lora_a.shape[0], dtype=lora_a.dtype))
        self.scale = scale

    def delta(self) -> Tensor:
        """s B A [out, in] in fp64 (models.lora.lora_delta)."""
        return lora_delta(self.lora_A, self.lora_B, self.scale)

    def forward(self, weight: Tensor) -> Tensor:
        return merged_weight(weight, self.delta())


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The adapters `apply_lora` put on a model: {HF module name: its factors}, sorted by name,
    and the weights trained in full beside them ({HF parameter name: parameter}: the norms
    with train_norms, the token embedding with train_embeddings)."""

    config: LoraConfig
    factors: dict[str, LoraFactors]
    norms: dict[str, nn.Parameter] = dataclasses.field(default_factory=dict)

    def state(self) -> dict[str, Tensor]:
        """{"<module>.lora_A": A [r, in], "<module>.lora_B": B [out, r]} (detached)."""
        out: dict[str, Tensor] = {}
        for name, f in self.factors.items():
            out[f"{name}.lora_A"] = f.lora_A.detach()
            out[f"{name}.lora_B"] = f.lora_B.detach()
        return out

    def factor_copies(self) -> dict[str, tuple[Tensor, Tensor]]:
        """{module: (A, B)} copied now (the next step trains on): a version's adapter set."""
        return {n: (f.lora_A.detach().clone(), f.lora_B.detach().clone())
                for n, f in self.factors.items()}  # fmt: skip

    def parameters(self) -> list[nn.Parameter]:
        """A and B of every adapter, in the order of `factors`, then the trained norms."""
        return [p for f in self.factors.values() for p in (f.lora_A, f.lora_B)] + list(
            self.norms.values()
        )


def linear_names(model: nn.Module) -> list[str]:
    """Module names of the model's linears (nn.Linear), in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _collapsed(names: list[str]) -> list[str]:
    """Names with block indices written ``*`` (one entry per distinct shape of name)."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names))


def select_targets(names: list[str], patterns: list[str]) -> list[str]:
    """The names matching any pattern, sorted; ConfigError for a pattern that matches none,
    naming the linears there are."""
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise ConfigError(
                f"learner.lora.targets: pattern {pat!r} matches no linear module of the model; "
                f"its linears are {_collapsed(names)}"
            )
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> Adapters:
    """Freeze ``model`` and adapt the linears ``cfg.targets`` names (module docstring)."""
    if not cfg.on:
        raise ValueError("apply_lora: learner.lora.rank is 0 (adapters off)")
    check_dropout(cfg)
    names = select_targets(linear_names(model), cfg.targets)
    shared: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(n)
    modules = dict(model.named_modules())
    for name in names:
        others = [n for n in shared[id(modules[name].weight)] if n != f"{name}.weight"]
        if others:
            raise ConfigError(
                f"learner.lora.targets: {name} shares its weight with {others} (tied); an "
                "adapter there would change both: leave it out of the patterns"
            )
    model.requires_grad_(False)
    norms: dict[str, nn.Parameter] = {}
    for n, m in model.named_modules():
        if (cfg.train_norms and isinstance(m, RMSNorm)) or (
            cfg.train_embeddings is True and isinstance(m, nn.Embedding)
        ):
            w = m.weight
            assert isinstance(w, nn.Parameter)
            norms[f"{n}.weight"] = w
            w.requires_grad_(True)
    linears = {n: modules[n] for n in names}
    starts = initial_a({n: m.in_features for n, m in linears.items()}, cfg.rank, seed)
    factors: dict[str, LoraFactors] = {}
    for name, lin in linears.items():
        assert isinstance(lin, nn.Linear)
        f = LoraFactors(starts[name].to(lin.weight.dtype), lin.out_features, cfg.scale)
        parametrize.register_parametrization(lin, "weight", f)
        factors[name] = f
    return Adapters(cfg, factors, dict(sorted(norms.items())))


def check_dropout(cfg: LoraConfig) -> None:
    """ConfigError unless learner.lora.dropout is 0 (the backends merge B A into W)."""
    if cfg.dropout:
        raise ConfigError(
            f"learner.lora.dropout={cfg.dropout!r}: the learner merges B A into the weight "
            "(models.lora), where input dropout has no place; use 0"
        )


def initial_a(in_features: dict[str, int], rank: int, seed: int) -> dict[str, Tensor]:
    """{module: A [rank, in] fp32}: uniform in +-1/sqrt(in) from one torch.Generator(seed),
    drawn in sorted-name order (both backends start from these)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name in sorted(in_features):
        bound = 1.0 / math.sqrt(in_features[name])
        out[name] = torch.empty(rank, in_features[name]).uniform_(-bound, bound, generator=gen)
    return out


@torch.no_grad()
def frozen_weights(model: nn.Module, adapters: Adapters) -> dict[str, Tensor]:
    """{"<module>.weight": W} of each adapted linear: its frozen base weight (without B A),
    the tensor itself (it never changes)."""
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for name in adapters.factors:
        lin = modules[name]
        assert parametrize.is_parametrized(lin, "weight")
        out[f"{name}.weight"] = lin.parametrizations.weight.original.detach()  # type: ignore[union-attr]
    return out


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` as the base model's: each adapted weight merged (its current
    W + s B A) under its own name, the factors left out; other entries as they are."""
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if key.endswith(_ORIGINAL):
            name = key[: -len(_ORIGINAL)]
            out[f"{name}.weight"] = modules[name].weight.detach()
        elif _FACTORS not in key:
            out[key] = value
    return out
