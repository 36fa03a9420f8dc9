"""The learner's replay forward: recorded completions -> per-token log-probs, entropy, hidden.

Order of calls:

    batch = make_replay_batch(items)                    # models.reference.ReplayItem list
    out = replay_forward(policy, batch, temperature=t, top_p=p)   # differentiable
    out.logprobs[batch.loss_mask] ...                  # [B, S]; 0 outside loss_mask

or `replay(policy, items, ...)` (no grad) for `models.reference.ReplayResult`s per item, the
shape the parity checks compare.

Batch layout (the same as `models.reference.replay`): row b holds prompt + completion[:-1]
(the last completion token is never fed), right-padded. Position p predicts token p + 1; the
positions plen - 1 .. plen + n - 2 sampled the n completion tokens (`loss_mask`). Prompt
positions 0..plen-2 run the full depth D (`ReplayItem.full_depth`; None = exit_depths[0], older
completions), position plen - 1 + t exits after exit_depths[t] iterations (token 0 included);
`kv` names the KV semantics of exited positions (docs/CONTRACTS.md 3; None = the model's
`MegatronOptions.kv`, else the family's default).

Token statistics. The head gives this rank's vocab shard of the logits; at TP > 1 the rows of
`loss_mask` are all-gathered to full vocabulary (megatron's gather, whose backward takes the
local slice), and padded vocabulary rows are dropped. Then, per docs/CONTRACTS.md 4:
- exact mode, or top_p < 1: `models.reference.behaviour_logprobs` (the reference recipe,
  top-p nucleus included; exact = fp64 log-softmax rounded to fp32) and its entropy;
- fast mode with top_p == 1: `learner.vocab_ops.token_stats` (chunked, memory-lean backward).
A vocab-parallel version of the statistics (no gather) is future work for large vocabularies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor

from learner.megatron.model import LoopedGPT, _seed_tensor
from learner.vocab_ops import token_stats
from models import numerics as nx
from models.depths import full_depth
from models.reference import ReplayItem, ReplayResult, behaviour_logprobs, entropy
from models.token_rows import token_rows
from proto.records import MAX_DEPTH

__all__ = [
    "ReplayBatch",
    "ReplayOutput",
    "full_vocab_logits",
    "make_replay_batch",
    "replay",
    "replay_forward",
    "token_logprobs",
    "unwrap",
]


@dataclasses.dataclass(frozen=True)
class ReplayBatch:
    """Right-padded model inputs of recorded completions (module doc)."""

    tokens: Tensor
    """[B, S] int64 prompt + completion[:-1], 0 on padding."""
    targets: Tensor
    """[B, S] int64 the token each position predicts (completion tokens where loss_mask)."""
    depths: Tensor
    """[B, S] int64 core iterations per position (models.token_rows: PAD_DEPTH on padding)."""
    valid: Tensor
    """[B, S] bool real positions (a prefix of each row)."""
    loss_mask: Tensor
    """[B, S] bool positions that sampled a completion token."""
    latent_seeds: Tensor
    """[B] int64 latent seeds (uint64 in two's complement)."""

    def to(self, device: torch.device | str) -> ReplayBatch:
        return ReplayBatch(**{f.name: getattr(self, f.name).to(device) for f in _FIELDS})


_FIELDS = dataclasses.fields(ReplayBatch)


def make_replay_batch(items: Sequence[ReplayItem], pad_to_multiple: int = 1) -> ReplayBatch:
    """Pack recorded completions (checks as `models.reference.replay`)."""
    if not items:
        raise ValueError("make_replay_batch needs at least one item")
    for it in items:
        n = len(it.completion_tokens)
        if n == 0 or len(it.exit_depths) != n or not it.prompt_tokens:
            raise ValueError("a replay item needs a prompt, >= 1 completion token, one depth each")
        full_depth(it.exit_depths, MAX_DEPTH, it.full_depth)  # contract 2 (forward: the model's)
    lay = token_rows([it.prompt_tokens for it in items], [it.completion_tokens for it in items],
                     [it.exit_depths for it in items], pad_to_multiple=pad_to_multiple,
                     full_depths=[it.full_depth for it in items])  # fmt: skip
    bsz, length = len(items), lay.length
    tokens = torch.from_numpy(lay.input_ids)
    targets = torch.from_numpy(lay.targets)
    depths = torch.from_numpy(lay.depths)
    valid = torch.arange(length)[None, :] < torch.from_numpy(lay.seq_lens)[:, None]
    loss_mask = torch.from_numpy(lay.mask)
    seeds = _seed_tensor([int(it.latent_seed) for it in items], bsz)
    return ReplayBatch(tokens, targets, depths, valid, loss_mask, seeds)


@dataclasses.dataclass
class ReplayOutput:
    """Per-position results of `replay_forward` (0 outside loss_mask for the token stats)."""

    logprobs: Tensor
    """[B, S] fp32 log-prob of the target under the sampled-from distribution."""
    entropy: Tensor
    """[B, S] fp32 entropy of that distribution."""
    hidden: Tensor
    """[B, S, h] the hidden state the head read (for a value head)."""
    logits: Tensor
    """[B, S, V_pad / tp] this rank's vocab shard of the raw logits."""


def unwrap(model: Any) -> LoopedGPT:
    """The LoopedGPT inside wrappers (Megatron DDP, Float16Module) that keep it as `.module`."""
    while not isinstance(model, LoopedGPT):
        if not hasattr(model, "module"):
            raise TypeError(f"not a LoopedGPT or a wrapper of one: {type(model).__name__}")
        model = model.module
    return model


def full_vocab_logits(model: LoopedGPT, logits_local: Tensor) -> Tensor:
    """[N, V] the real vocabulary's logits from this rank's shards [N, V_pad / tp]."""
    full = logits_local
    if model.tp_size > 1:
        full = gather_from_tensor_model_parallel_region(logits_local)
    return full[..., : model.family_config.vocab_size]


def token_logprobs(
    model: LoopedGPT,
    logits_local: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    mode: str = "fast",
) -> tuple[Tensor, Tensor]:
    """(log-prob of targets, entropy), each [N], of the distribution sampled from."""
    full = full_vocab_logits(model, logits_local)
    if mode == "fast" and top_p >= 1.0:
        stats = token_stats(full.float(), None, targets, temperature)
        return stats.logp, stats.entropy
    lp = behaviour_logprobs(full, full.shape[-1], temperature, top_p, mode)
    return lp.gather(-1, targets[:, None])[:, 0], entropy(lp)


def replay_forward(
    model: Any,
    batch: ReplayBatch,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    numerics: str | None = None,
    kv: str | None = None,
) -> ReplayOutput:
    """Differentiable replay of `batch` through the policy (module doc). `model` is a
    LoopedGPT or a wrapper of one (Megatron DDP): the wrapper's forward is the one called."""
    core = unwrap(model)
    if core.is_critic:
        raise ValueError("replay_forward needs a policy (LM head), got a critic")
    mode = nx.check_mode(numerics or core.options.numerics)
    out = model(batch.tokens, batch.depths, batch.valid, batch.latent_seeds, numerics=mode, kv=kv)
    assert out.logits is not None
    sel = batch.loss_mask
    lp, ent = token_logprobs(
        core, out.logits[sel], batch.targets[sel], temperature=temperature, top_p=top_p, mode=mode
    )
    logprobs = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
    ents = torch.zeros(sel.shape, dtype=ent.dtype, device=ent.device).masked_scatter(sel, ent)
    return ReplayOutput(logprobs, ents, out.hidden, out.logits)


@torch.no_grad()
def replay(
    model: Any,
    items: Sequence[ReplayItem],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    numerics: str | None = None,
    kv: str | None = None,
) -> list[ReplayResult]:
    """`models.reference.replay`'s results, computed by the megatron model (no grad)."""
    if not items:
        return []
    dev = next(model.parameters()).device
    batch = make_replay_batch(items).to(dev)
    out = replay_forward(
        model, batch, temperature=temperature, top_p=top_p, numerics=numerics, kv=kv
    )
    results = []
    for b in range(len(items)):
        sel = batch.loss_mask[b]
        results.append(
            ReplayResult(
                logprobs=out.logprobs[b, sel].float().cpu(),
                entropies=out.entropy[b, sel].float().cpu(),
                hidden=out.hidden[b, sel].cpu(),
            )
        )
    return results
