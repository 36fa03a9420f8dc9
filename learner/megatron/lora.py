"""Low-rank adapters on the megatron policy (learner.megatron.model.LoopedGPT), in the Hugging
Face module space of the reference backend's (learner.lora).

The candidates are the HF linears the megatron linears are made of (learner.hf_convert's
rules: linear_qkv of q / k / v or Huginn's Wqkv, linear_fc1 of gate / up, linear_proj,
linear_fc2, Huginn's adapter, an untied head, Ouro's exit gate); learner.lora.targets selects
among them by the same names (learner.lora.select_targets), and each selected HF linear gets
the factors the reference backend gives it (learner.lora.LoraFactors, A from
learner.lora.initial_a, B = 0). A megatron linear with adapted parts owns a `LoraMerge` child
``lora``; learner.megatron.layers' linears read ``lora(weight)``: each part's fp64 delta s B A
(zero for a part not adapted) laid out as the megatron tensor (hf_convert.to_local), added to
W in fp64 and rounded once (models.lora): elementwise the weight the reference backend merges,
so in numerics exact both backends compute with the same bits. A looped core block is one set
of modules run at every iteration: its adapters are shared across iterations as its weights
are. Every other base parameter is frozen (no gradient, no optimizer state), but for the
RMSNorm weights with learner.lora.train_norms and the token embedding with
learner.lora.train_embeddings (a tied head is the same tensor). Tensor parallel 1 only (the factors are whole on
each rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor, nn

from learner.config import LoraConfig
from learner.hf_convert import Rule, conversion_rules, to_full, to_local
from learner.lora import Adapters, LoraFactors, check_dropout, initial_a, select_targets
from learner.megatron.layers import RMSNorm
from models.errors import ConfigError
from models.lora import merged_weight

__all__ = [
    "LoraMerge",
    "apply_megatron_lora",
    "frozen_hf_weights",
    "hf_linears",
    "merged_once",
    "megatron_adapters",
    "trained_full",
    "trained_norms",
]


class LoraMerge(nn.Module):
    """The adapters of one megatron linear: W -> W + layout(s B_i A_i of each HF part i).
    Within ``merged_once`` the merge is made once and every call returns it (``merged``)."""

    def __init__(self, names: list[str], shapes: list[tuple[int, int]],
                 parts: dict[int, LoraFactors], layout: Callable[[list[Tensor]], Tensor]) -> None:  # fmt: skip
        super().__init__()
        self.names, self.shapes, self.layout = names, shapes, layout
        self.parts = nn.ModuleDict({str(i): f for i, f in parts.items()})
        self.merged: Tensor | None
        self.register_buffer("merged", None, persistent=False)  # (a buffer: a compiled block's
        # input, not a constant it would recompile for)

    def forward(self, weight: Tensor) -> Tensor:
        if self.merged is not None:
            return self.merged
        return self.merge(weight)

    def merge(self, weight: Tensor) -> Tensor:
        deltas = []
        for i, shape in enumerate(self.shapes):
            f = self.parts[str(i)] if str(i) in self.parts else None
            assert f is None or isinstance(f, LoraFactors)
            deltas.append(torch.zeros(shape, dtype=torch.float64, device=weight.device)
                          if f is None else f.delta())  # fmt: skip
        return merged_weight(weight, self.layout(deltas))


@contextlib.contextmanager
def merged_once(model: nn.Module) -> Iterator[None]:
    """Every adapted linear of ``model`` merged once for the block (one forward): a looped
    core block's linears, run at every iteration, read the same merged weight, which autograd
    keeps once for the backward (its gradient summed over the iterations, then through the
    merge once). Merging at every call kept a merged copy per iteration with gradient: 0125
    with rank-16 adapters ran an H100 out of memory (docs/PERFORMANCE.md)."""
    merges = [(m, cast(Tensor, owner.weight)) for owner in model.modules()
              if isinstance(m := getattr(owner, "lora", None), LoraMerge)]  # fmt: skip
    if not merges or any(m.merged is not None for m, _ in merges):  # none, or already inside
        yield
        return
    try:
        for m, w in merges:
            m.merged = m.merge(w)
        yield
    finally:
        for m, _ in merges:
            m.merged = None


def hf_linears(model: nn.Module) -> dict[str, tuple[Rule, int]]:
    """{HF module name: (its conversion rule, its index among the rule's HF tensors)} of every
    HF linear a megatron linear of ``model`` is made of."""
    modules = dict(model.named_modules())
    out: dict[str, tuple[Rule, int]] = {}
    for rule in conversion_rules(model):  # type: ignore[arg-type]
        owner = modules.get(rule.mine.removesuffix(".weight"))
        if rule.mine.endswith(".weight") and isinstance(
            owner, ColumnParallelLinear | RowParallelLinear | nn.Linear
        ):
            for i, hf in enumerate(rule.hf):
                out[hf.removesuffix(".weight")] = (rule, i)
    return out


def apply_megatron_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> Adapters:
    """Freeze ``model`` and adapt the HF linears ``cfg.targets`` names (module docstring)."""
    from megatron.core import parallel_state as ps

    check_dropout(cfg)
    if ps.get_tensor_model_parallel_world_size() != 1:
        raise ConfigError(
            f"learner.lora.rank={cfg.rank}: the megatron backend trains adapters at tp 1 only "
            f"(tp is {ps.get_tensor_model_parallel_world_size()})"
        )
    candidates = hf_linears(model)
    tied = bool(getattr(model, "tied", False))  # the head is the embedding: no linear of its own
    names = select_targets(list(candidates) + (["lm_head"] if tied else []), cfg.targets)
    if "lm_head" in names and "lm_head" not in candidates:
        raise ConfigError(
            "learner.lora.targets: lm_head shares its weight with the embedding (tied); an "
            "adapter there would change both: leave it out of the patterns"
        )
    modules = dict(model.named_modules())
    by_owner: dict[str, list[str]] = {}
    for name in names:
        by_owner.setdefault(candidates[name][0].mine, []).append(name)
    model.requires_grad_(False)
    norms = trained_full(model, cfg)
    for p in norms.values():
        p.requires_grad_(True)
    hf = {}
    for mine in by_owner:
        rule = candidates[by_owner[mine][0]][0]
        owner = modules[mine.removesuffix(".weight")]
        parts = to_full(model, rule, [owner.weight.detach()])  # type: ignore[arg-type]
        hf[mine] = (rule, owner, [(int(p.shape[0]), int(p.shape[1])) for p in parts])
    in_features = {n: hf[candidates[n][0].mine][2][candidates[n][1]][1] for n in names}
    starts = initial_a(in_features, cfg.rank, seed)
    factors: dict[str, LoraFactors] = {}
    for mine, (rule, owner, shapes) in hf.items():
        own: dict[int, LoraFactors] = {}
        for name in by_owner[mine]:
            i = candidates[name][1]
            w = owner.weight
            f = LoraFactors(starts[name].to(device=w.device, dtype=w.dtype), shapes[i][0],
                            cfg.scale)  # fmt: skip
            own[i] = factors[name] = f

        def layout(deltas: list[Tensor], rule: Rule = rule) -> Tensor:
            return to_local(model, rule, deltas, 0, 1)  # type: ignore[arg-type]

        owner.lora = LoraMerge([h.removesuffix(".weight") for h in rule.hf], shapes, own, layout)
    return Adapters(cfg, dict(sorted(factors.items())), norms)


@torch.no_grad()
def frozen_hf_weights(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """{"<module>.weight": W} of the HF linears ``names``: the frozen base weight of each
    (its part of the megatron weight, without the adapters), on rank 0 at tp 1."""
    candidates, modules = hf_linears(model), dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for name in names:
        rule, i = candidates[name]
        owner = modules[rule.mine.removesuffix(".weight")]
        parts = to_full(model, rule, [owner.weight.detach()])  # type: ignore[arg-type]
        out[f"{name}.weight"] = parts[i].contiguous()
    return out


def trained_norms(model: nn.Module) -> dict[str, nn.Parameter]:
    """{HF name: parameter} of every RMSNorm weight of ``model``, sorted by name."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out = {}
    for rule in conversion_rules(model):  # type: ignore[arg-type]
        if isinstance(modules.get(rule.mine.removesuffix(".weight")), RMSNorm):
            out[rule.hf[0]] = params[rule.mine]
    return dict(sorted(out.items()))


def trained_full(model: nn.Module, cfg: LoraConfig) -> dict[str, nn.Parameter]:
    """{HF name: parameter} of the weights trained in full beside the adapters: the RMSNorm
    weights with train_norms, the token embedding with train_embeddings; sorted by name."""
    out = dict(trained_norms(model)) if cfg.train_norms else {}
    if cfg.train_embeddings is True:  # (auto unresolved: false, LoraConfig)
        params = dict(model.named_parameters())
        for rule in conversion_rules(model):  # type: ignore[arg-type]
            if rule.mine == "embedding.weight" and rule.mine in params:
                out[rule.hf[0]] = params[rule.mine]
        if not any(rule.mine == "embedding.weight" for rule in conversion_rules(model)):  # type: ignore[arg-type]
            raise ConfigError("learner.lora.train_embeddings: the model has no embedding rule")
    return dict(sorted(out.items()))


def megatron_adapters(model: nn.Module, cfg: LoraConfig) -> Adapters:
    """The adapters `apply_megatron_lora` put on ``model`` (by HF module name, sorted)."""
    factors: dict[str, LoraFactors] = {}
    for m in model.modules():
        if isinstance(m, LoraMerge):
            for i, f in m.parts.items():
                assert isinstance(f, LoraFactors)
                factors[m.names[int(i)]] = f
    return Adapters(cfg, dict(sorted(factors.items())), trained_full(model, cfg))
