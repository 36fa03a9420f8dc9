"""Hugging Face state dicts <-> the TP shards of `learner.megatron.model.LoopedGPT`.

`load_hf_state(model, hf_state)` copies full HF tensors (the family's official names, as
`models.checkpoint.load_checkpoint` returns them) into this rank's shards;
`gather_hf_state(model)` all-gathers the shards over the TP group and returns the full HF state
dict on every rank (`grads=True`: the same for the parameters' gradients). Round trip is bit
exact at any TP size; tied embeddings come back as one tensor under both names; Huginn's fp32
`freqs_cis` buffer is carried as is.

Layouts (see `learner.megatron.layers`):

| kind  | megatron local shard on rank r of tp                                        |
|-------|-----------------------------------------------------------------------------|
| rep   | the full tensor (norms, o_proj bias, exit gate, value head, freqs_cis)      |
| rows  | chunk r of dim 0 (adapter)                                                  |
| cols  | chunk r of dim 1 (RowParallelLinear weights: o_proj / proj, down / fc2)     |
| heads | chunk r of dim 2 (Huginn qk_bias [2, 1, heads, head_dim])                   |
| vocab | rows padded with zeros to a multiple of tp, chunk r of dim 0 (wte, lm_head) |
| qkv   | rows regrouped per kv group g as [q heads of g; k_g; v_g], chunk r of dim 0 |
|       | (Huginn's fused Wqkv [q; k; v] is split into q, k, v first)                 |
| fc1   | [gate chunk r; up chunk r] (Huginn's fused fc [gate; up] split first)       |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from models.config import HuginnConfig, OuroConfig
from models.errors import CheckpointError


class LoopedGPT(Protocol):
    """What the conversion reads of a `learner.megatron.model.LoopedGPT` (a protocol here: that
    module imports this one to load HF states, not the other way round)."""

    @property
    def config(self) -> Any: ...  # megatron TransformerConfig (TP size, heads)
    @property
    def family_config(self) -> Any: ...  # models.config.ModelConfig
    @property
    def core(self) -> Any: ...
    @property
    def huginn(self) -> bool: ...
    @property
    def is_critic(self) -> bool: ...
    @property
    def tied(self) -> bool: ...
    @property
    def rows(self) -> int: ...
    def state_dict(self, *, keep_vars: bool = False) -> dict[str, Any]: ...
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]: ...


__all__ = [
    "Rule",
    "conversion_rules",
    "gather_hf_state",
    "load_hf_state",
    "to_full",
    "to_local",
    "to_local_state",
]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One megatron tensor and the HF tensors it is made of."""

    mine: str
    """Name in `LoopedGPT.state_dict()`."""
    hf: tuple[str, ...]
    """HF names (qkv: (q, k, v) or Huginn's one fused Wqkv; fc1: (gate, up) or one fused fc)."""
    kind: str
    """rep | rows | cols | heads | vocab | qkv | fc1 (module doc)."""


_HUGINN_BLOCK = {
    "input_norm.weight": ("norm_1.weight", "rep"),
    "attn_out_norm.weight": ("norm_2.weight", "rep"),
    "pre_mlp_norm.weight": ("norm_3.weight", "rep"),
    "mlp_out_norm.weight": ("norm_4.weight", "rep"),
    "linear_qkv.weight": ("attn.Wqkv.weight", "qkv"),
    "qk_bias": ("attn.qk_bias", "heads"),
    "linear_proj.weight": ("attn.proj.weight", "cols"),
    "linear_fc1.weight": ("mlp.fc.weight", "fc1"),
    "linear_fc2.weight": ("mlp.proj.weight", "cols"),
}
_LLAMA_BLOCK = {
    "input_norm.weight": ("input_layernorm.weight", "rep"),
    "attn_out_norm.weight": ("input_layernorm_2.weight", "rep"),
    "pre_mlp_norm.weight": ("post_attention_layernorm.weight", "rep"),
    "mlp_out_norm.weight": ("post_attention_layernorm_2.weight", "rep"),
    "linear_proj.weight": ("self_attn.o_proj.weight", "cols"),
    "linear_proj.bias": ("self_attn.o_proj.bias", "rep"),
    "linear_fc2.weight": ("mlp.down_proj.weight", "cols"),
}


def _block_rules(mine: str, hf: str, names: set[str], huginn: bool) -> list[Rule]:
    rules = []
    table = _HUGINN_BLOCK if huginn else _LLAMA_BLOCK
    for suffix, (hf_suffix, kind) in table.items():
        if mine + suffix in names:
            rules.append(Rule(mine + suffix, (hf + hf_suffix,), kind))
    if not huginn:
        for part in ("weight", "bias"):
            if f"{mine}linear_qkv.{part}" in names:
                qkv = tuple(f"{hf}self_attn.{p}_proj.{part}" for p in "qkv")
                rules.append(Rule(f"{mine}linear_qkv.{part}", qkv, "qkv"))
        fc1 = (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight")
        rules.append(Rule(f"{mine}linear_fc1.weight", fc1, "fc1"))
    return rules


def conversion_rules(model: LoopedGPT) -> list[Rule]:
    """Every tensor of `model.state_dict()` and where it comes from in the HF state dict."""
    # (".lora.": learner.megatron.lora's adapters, which are no HF tensors)
    names = {k for k in model.state_dict() if not k.endswith("_extra_state") and ".lora." not in k}
    c = model.family_config
    rules: list[Rule] = []
    if isinstance(c, HuginnConfig):
        stacks = (("prelude", "prelude"), ("core", "core_block"), ("coda", "coda"))
        for mine, hf in stacks:
            for i in range(len(getattr(model, mine))):
                rules += _block_rules(f"{mine}.{i}.", f"transformer.{hf}.{i}.", names, True)
        rules.append(Rule("embedding.weight", ("transformer.wte.weight",), "vocab"))
        rules.append(Rule("adapter.weight", ("transformer.adapter.weight",), "rows"))
        if "adapter.bias" in names:
            rules.append(Rule("adapter.bias", ("transformer.adapter.bias",), "rows"))
        rules.append(Rule("final_norm.weight", ("transformer.ln_f.weight",), "rep"))
        rules.append(Rule("freqs_cis", ("freqs_cis",), "rep"))
    else:
        for i in range(len(model.core)):
            rules += _block_rules(f"core.{i}.", f"model.layers.{i}.", names, False)
        rules.append(Rule("embedding.weight", ("model.embed_tokens.weight",), "vocab"))
        rules.append(Rule("final_norm.weight", ("model.norm.weight",), "rep"))
        if isinstance(c, OuroConfig):
            rules.append(Rule("exit_gate.weight", ("model.early_exit_gate.weight",), "rep"))
            rules.append(Rule("exit_gate.bias", ("model.early_exit_gate.bias",), "rep"))
    if model.is_critic:
        rules.append(Rule("value_head.weight", ("value_head.weight",), "rep"))
        rules.append(Rule("value_head.bias", ("value_head.bias",), "rep"))
    elif not model.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    covered = {r.mine for r in rules}
    assert covered == names, f"conversion rules do not cover {sorted(names ^ covered)}"
    return rules


def _hf_tied(model: LoopedGPT) -> tuple[str, str] | None:
    """(head name, embedding name) when the HF checkpoint ties them, else None."""
    if not model.tied:
        return None
    emb = "transformer.wte.weight" if model.huginn else "model.embed_tokens.weight"
    return "lm_head.weight", emb


def _heads(model: LoopedGPT) -> tuple[int, int, int]:
    tc = model.config
    groups = tc.num_query_groups or tc.num_attention_heads
    return tc.num_attention_heads, groups, tc.kv_channels or tc.hidden_size // groups


def _group_qkv(model: LoopedGPT, parts: list[Tensor]) -> Tensor:
    """HF q / k / v (or fused [q; k; v]) -> rows grouped per kv group [q_g; k_g; v_g]."""
    heads, groups, dim = _heads(model)
    if len(parts) == 1:
        parts = list(parts[0].split([heads * dim, groups * dim, groups * dim], dim=0))
    q, k, v = parts
    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * dim, *tail)
    k, v = k.reshape(groups, dim, *tail), v.reshape(groups, dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _ungroup_qkv(model: LoopedGPT, full: Tensor, n_out: int) -> list[Tensor]:
    heads, groups, dim = _heads(model)
    tail = full.shape[1:]
    per = heads // groups * dim
    q, k, v = full.reshape(groups, per + 2 * dim, *tail).split([per, dim, dim], dim=1)
    out = [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
    return [torch.cat(out, dim=0)] if n_out == 1 else out


def to_local(model: LoopedGPT, rule: Rule, parts: list[Tensor], rank: int, size: int) -> Tensor:
    """TP rank ``rank``'s shard of ``rule.mine`` from its full HF tensors ``parts``."""
    kind = rule.kind
    if kind == "rep":
        return parts[0]
    if kind in ("rows", "cols", "heads"):
        dim = {"rows": 0, "cols": 1, "heads": 2}[kind]
        return parts[0].chunk(size, dim=dim)[rank]
    if kind == "vocab":
        full = parts[0]
        pad = model.rows - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])], dim=0)
        return full.chunk(size, dim=0)[rank]
    if kind == "qkv":
        return _group_qkv(model, parts).chunk(size, dim=0)[rank]
    if kind == "fc1":
        gate, up = parts if len(parts) == 2 else list(parts[0].chunk(2, dim=0))
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise AssertionError(f"unknown kind {kind}")


def to_full(model: LoopedGPT, rule: Rule, shards: list[Tensor]) -> list[Tensor]:
    """The full HF tensors of ``rule.hf`` from every TP rank's shard of ``rule.mine``."""
    kind = rule.kind
    if kind == "rep":
        return [shards[0]]
    if kind in ("rows", "cols", "heads"):
        return [torch.cat(shards, dim={"rows": 0, "cols": 1, "heads": 2}[kind])]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: model.family_config.rows]]
    if kind == "qkv":
        return _ungroup_qkv(model, torch.cat(shards, dim=0), len(rule.hf))
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [gate, up] if len(rule.hf) == 2 else [torch.cat([gate, up], dim=0)]
    raise AssertionError(f"unknown kind {kind}")


def _tp() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def to_local_state(model: LoopedGPT, hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """This rank's shard of every tensor of `model`, from full HF tensors.

    CheckpointError for a missing or unexpected HF tensor (a critic ignores `lm_head.weight`
    and takes `value_head.*` only when present), or a tied head that differs from the embedding.
    """
    rank, size = _tp()
    state = dict(hf_state)
    tie = _hf_tied(model)
    if tie is not None and tie[0] in state:
        head, emb = tie
        if emb in state and not torch.equal(state[head], state[emb]):
            raise CheckpointError(f"{head} is tied to {emb} but differs from it")
        del state[head]
    if model.is_critic:
        state.pop("lm_head.weight", None)
    rules = conversion_rules(model)
    needed = {n for r in rules for n in r.hf}
    optional = {"value_head.weight", "value_head.bias"} if model.is_critic else set()
    missing = sorted(needed - state.keys() - optional)
    unexpected = sorted(state.keys() - needed)
    if missing or unexpected:
        raise CheckpointError(
            f"HF state dict does not match the model: missing {missing}, unexpected {unexpected}"
        )
    out = {}
    for rule in rules:
        if all(n in state for n in rule.hf):
            out[rule.mine] = to_local(model, rule, [state[n] for n in rule.hf], rank, size)
    return out


def load_hf_state(model: LoopedGPT, hf_state: Mapping[str, Tensor]) -> None:
    """Copy full HF tensors into `model`'s shards in place (dtype and device of the model)."""
    local = to_local_state(model, hf_state)
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in local.items():
            target = own[name]
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{name}: shard shape {tuple(value.shape)} != model {tuple(target.shape)}"
                )
            target.copy_(value)


def _gather(t: Tensor, size: int) -> list[Tensor]:
    if size == 1:
        return [t]
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


def gather_hf_state(
    model: LoopedGPT, *, grads: bool = False, only: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Full HF state dict on every TP rank (a collective over the TP group).

    grads: gather the parameters' `.grad` instead (zeros where None; buffers skipped;
    Megatron DDP keeps grads in `main_grad`, which is used when present).
    only: the HF tensors of the rules that make these names (None: all): a version's norms
    (weights.cuda_ipc's adapter versions) without exporting the whole set.
    Tied embeddings: the head name maps to the very tensor of the embedding.
    """
    _, size = _tp()
    own = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for rule in conversion_rules(model):
        if only is not None and not set(rule.hf) & set(only):
            continue
        t = own[rule.mine]
        lora = getattr(modules.get(rule.mine.rpartition(".")[0]), "lora", None)
        if lora is not None and rule.mine.endswith(".weight") and not grads:
            with torch.no_grad():
                t = lora(t)  # learner.megatron.lora: the merged weight W + s B A
        if grads:
            if rule.mine not in params:
                continue
            p = params[rule.mine]
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            t = torch.zeros_like(p) if g is None else g
        full = to_full(model, rule, _gather(t.detach(), size) if rule.kind != "rep" else [t])
        out.update({n: v.detach().clone() for n, v in zip(rule.hf, full, strict=True)})
    tie = _hf_tied(model)
    if tie is not None and not model.is_critic and tie[1] in out:
        out[tie[0]] = out[tie[1]]
    return dict(sorted(out.items()))
