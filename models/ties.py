"""Tied weights of a state dict: which names are views of the same memory, and how a
checkpoint stores a tie (the target dropped on save, restored from its source on load, as
transformers does). Used by models.checkpoint."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from models.errors import CheckpointError

__all__ = [
    "alias_groups",
    "apply_ties",
    "detached_copy",
    "drop_tied",
    "find_aliases",
    "same_tensor",
    "tied_from_module",
    "view_key",
]


def view_key(t: torch.Tensor) -> tuple:
    storage = (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset())
    return (*storage, tuple(t.shape), t.stride(), t.dtype)


def alias_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Sorted groups (2+ names) of tensors that are the same view of the same memory."""
    groups: dict[tuple, list[str]] = {}
    for name in sorted(state):
        t = state[name]
        if isinstance(t, torch.Tensor) and t.numel() > 0:  # empty tensors share nothing
            groups.setdefault(view_key(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def detached_copy(
    state: Mapping[str, torch.Tensor], live: Iterable[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A copy of ``state`` that owns its memory: each distinct view cloned once, so names that
    were one tensor stay one tensor. ``live``: the tensors training goes on writing (a tensor
    of ``state`` sharing no storage with any of them is already a copy and taken as it is;
    None: clone all). What a publication finished while the next step trains must hold."""
    ptrs = None if live is None else {t.untyped_storage().data_ptr() for t in live}
    done: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ptrs is not None and t.untyped_storage().data_ptr() not in ptrs:
            out[name] = t
            continue
        key = view_key(t)
        if key not in done:
            done[key] = t.detach().clone()
        out[name] = done[key]
    return out


def find_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{alias: canonical} for names whose tensors are the same view of the same memory
    (canonical: the group's first name in sorted order)."""
    return {alias: names[0] for names in alias_groups(state) for alias in names[1:]}


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a.cpu(), b.cpu().to(a.dtype)))


def tied_from_module(module: torch.nn.Module, head_prefix: str = "lm_head.") -> dict[str, str]:
    """{target: source} to save a module whose head shares its embedding: as transformers
    does, the head (names starting with `head_prefix`) is the target dropped on save, the
    other name of the same tensor the source kept. Other aliases are left out."""
    tied: dict[str, str] = {}
    for names in alias_groups(module.state_dict()):
        sources = sorted(n for n in names if not n.startswith(head_prefix))
        if sources:
            tied.update({n: sources[0] for n in names if n.startswith(head_prefix)})
    return tied


def drop_tied(
    state: Mapping[str, torch.Tensor], tied: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    out = dict(state)
    for target, source in sorted(tied.items()):
        if source not in state:
            raise ValueError(f"tied weight {target!r} -> {source!r}: source not in state dict")
        if target in tied.values():
            raise ValueError(f"tied weight {target!r} is also a tie source (no chains)")
        if target in state:
            if state[target].dtype != state[source].dtype or not same_tensor(
                state[target], state[source]
            ):
                raise ValueError(f"tied weight {target!r} differs from its source {source!r}")
            del out[target]
    return out


def apply_ties(state: dict[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, str]:
    """Make each tie target the very tensor of its source (a present one must equal it)."""
    made: dict[str, str] = {}
    for target, source in sorted(tied.items()):
        if source not in state:
            raise CheckpointError(f"tied weight {target!r}: its source {source!r} is missing")
        if target in state and not same_tensor(state[target], state[source]):
            raise CheckpointError(f"tied weight {target!r} differs from its source {source!r}")
        state[target] = state[source]
        made[target] = source
    return made
