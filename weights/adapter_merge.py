"""How an adapter set merges onto its base (weights.adapters on the host, weights.cuda_ipc on
the device): one routine, so a generator that merges on the host and one that merges on its
card compute the same bits, the learner's (models.lora's formula).

The merged set of a base B (every stored tensor of a version, each adapted weight W as it was
before training) and an adapter set S ({m}.lora_A [r, in], {m}.lora_B [out, r] per adapted
module m, and the tensors trained in full, the norms):

    {m}.weight    merged_weight(W, lora_delta(A, B, scale))     each m of ``targets``
    n             S[n]                                          each tensor trained in full
    n             B[n]                                          every other tensor

``merged_pieces`` checks the sets against each other first (WeightsRefused naming what does
not fit: factors that are not the announced targets, targets with no weight in the base,
shapes that are not [out, in] = B [out, r] A [r, in]), then yields the merged tensors in
sorted-name order (the canonical blob's), one at a time: a device merge writes each into its
place and lets it go, never holding two copies of the set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from models.lora import lora_delta
from weights.check import WeightsRefused
from weights.digest import dtype_name

__all__ = ["merge_adapters", "merged_pieces", "write_merged"]

_FACTOR = (".lora_A", ".lora_B")


def merged_pieces(
    base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], targets: Sequence[str], scale: float
) -> Iterator[tuple[str, Tensor]]:
    """The merged set's (name, tensor) in sorted-name order (module docstring), after the
    checks; the adapted weights are computed as they are taken, on ``base``'s device."""
    factors = sorted({n.rsplit(".", 1)[0] for n in adapter if n.endswith(_FACTOR)})
    if factors != sorted(targets):
        raise WeightsRefused(
            f"adapter set: its factors {factors} are not the announced targets {sorted(targets)}"
        )
    absent = [m for m in targets if f"{m}.weight" not in base]
    if absent:
        raise WeightsRefused(
            f"adapter set for other target modules: {absent} have no weight in the base held"
        )
    for m in targets:
        w, a, b = base[f"{m}.weight"], adapter.get(f"{m}.lora_A"), adapter.get(f"{m}.lora_B")
        if a is None or b is None:
            raise WeightsRefused(f"adapter set: module {m} lacks its lora_A or lora_B")
        fits = w.dim() == a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1]
        if not fits or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise WeightsRefused(
                f"adapter set for other target modules: {m} has lora_A {list(a.shape)}, lora_B "
                f"{list(b.shape)}, the base's weight {list(w.shape)}"
            )
    return _pieces(base, adapter, {f"{m}.weight": m for m in targets}, scale)


def _pieces(base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], adapted: dict[str, str],
            scale: float) -> Iterator[tuple[str, Tensor]]:  # fmt: skip
    full = {n: t for n, t in adapter.items() if not n.endswith(_FACTOR)}
    for name in sorted(set(base) | set(full)):
        if name in full:
            yield name, full[name]
        elif name in adapted:
            w, m = base[name], adapted[name]
            a, b = adapter[f"{m}.lora_A"].to(w.device), adapter[f"{m}.lora_B"].to(w.device)
            yield name, _merged(w, a, b, scale)
        else:
            yield name, base[name]


def _merged(w: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``merged_weight(w, lora_delta(a, b, scale))`` bit for bit (fp64 addition commutes, and
    w's fp64 value is exact), in one fp64 temporary instead of three: a 0125 MLP weight's
    merge holds 1.5 GB on the generator's card, not 4.5."""
    with torch.no_grad():
        d = lora_delta(a, b, scale)
        d.add_(w)
        return d.to(w.dtype)


def merge_adapters(
    base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], targets: Sequence[str], scale: float
) -> dict[str, Tensor]:
    """The merged set as a dict (``merged_pieces``; the base's other tensors not copied)."""
    return dict(merged_pieces(base, adapter, targets, scale))


def write_merged(
    out: Tensor,
    tensors: Sequence[Any],
    base: Mapping[str, Tensor],
    adapter: Mapping[str, Tensor],
    targets: Sequence[str],
    scale: float,
) -> None:
    """The merged set written into the flat uint8 ``out`` as the blob layout ``tensors``
    ({name, dtype, shape, offset, nbytes} or TensorMeta) lays it out, each merged weight
    written and let go in turn; WeightsRefused when the merged set's names, dtypes or shapes
    are not the layout's (an adapter set or a base of another model)."""
    want = {_get(t, "name"): t for t in tensors}
    seen = 0
    for name, t in merged_pieces(base, adapter, targets, scale):
        meta = want.get(name)
        if meta is None:
            raise WeightsRefused(f"merged set: tensor {name} is not in the announced layout")
        dtype, shape = dtype_name(t.dtype), [int(d) for d in t.shape]
        if (dtype, shape) != (_get(meta, "dtype"), [int(d) for d in _get(meta, "shape")]):
            raise WeightsRefused(
                f"merged set: tensor {name} is {dtype} {shape}, the announce says "
                f"{_get(meta, 'dtype')} {list(_get(meta, 'shape'))}"
            )
        n, off = int(_get(meta, "nbytes")), int(_get(meta, "offset"))
        if n:
            out[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(out.dtype))
        seen += 1
    if seen != len(want):
        raise WeightsRefused(
            f"merged set: {seen} tensors from the base and the adapter set, {len(want)} announced"
        )


def _get(m: Any, key: str) -> Any:
    return m[key] if isinstance(m, Mapping) else getattr(m, key)
