"""Weights into a running vLLM engine's model, on its worker (generator.engine's
`_load_on_worker`, called through `LLM.collective_rpc`; the module doc of generator.engine says
when each path runs): the looped plugin classes copy in place through their own loader; vLLM's
native classes on the CPU reload directly (`_direct_reload`), elsewhere through vLLM's
layer-by-layer reload, and a layer that shares its parameter (a tied head) is processed again
(`_reprocess_shared`)."""

from __future__ import annotations

from typing import Any

import torch


def _load_on_worker(
    worker: Any, state: dict[str, torch.Tensor], version: int, native: bool = False
) -> int:
    """On each worker: ``state`` (HF names) into the served model (see the module doc)."""
    runner = worker.model_runner
    model = runner.get_model()
    if not native:
        model.load_weights(iter(state.items()))
        if hasattr(model, "record_book"):
            model.weight_version = version
        return version
    if not _direct_reload(model, state):
        reload = getattr(worker, "reload_weights", None) or runner.reload_weights
        reload(weights_iterator=iter(state.items()))
        _reprocess_shared(model)
    return version


KEPT = "_looprl_checkpoint_weights"
"""Attribute of a native CPU model: {packed linear layer: its checkpoint-layout weight}."""
DIRECT_RELOAD_BYTES = 256 << 20
"""Most bytes of kept checkpoint-layout weights: the direct reload holds a second copy of the
packed layers' weights for good (vLLM's reload holds one layer's at a time, while it loads)."""


def _direct_reload(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """A native, unquantized model on the CPU: the same steps as vLLM's reload without its
    per-version bookkeeping; False (nothing done) elsewhere, where vLLM's reload runs.

    vLLM's layer-by-layer reload puts every layer back on the meta device, materialises it,
    wraps each loader to count the elements it copies and processes a layer when it is
    complete: ~6 of its ~12 ms a version on the tiny Llama. Here each packed linear layer
    gets a checkpoint-layout weight (materialised once from vLLM's own record of the layer,
    then kept), the model's own loader fills them (fusing q/k/v, gate/up), and every layer
    with a weight is processed again (``process_weights_after_loading``: the packed copies
    made afresh, the checkpoint weight dropped from the layer as at start). Only while those
    weights take at most DIRECT_RELOAD_BYTES: the per-version bookkeeping matters on small
    models, a second copy of a large one's weights would not be worth it."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    layers: list[Any] = []  # the layers with a quant method (each has a weight)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not isinstance(method, UnquantizedLinearMethod | UnquantizedEmbeddingMethod):
            return False
        if getattr(module, "weight", None) is None:
            return False
        layers.append(module)
    kept: dict[torch.nn.Module, torch.Tensor] = model.__dict__.setdefault(KEPT, {})
    packed = [m for m in layers if not m.weight.numel()]  # packed: vLLM dropped the weight
    metas = {}
    for layer in (m for m in packed if m not in kept):  # the first call: vLLM's records
        info = LAYERWISE_INFO.get(layer)
        meta = info.restore_metadata[0].get("weight") if info is not None else None
        if meta is None or not hasattr(layer, "cpu_linear"):
            return False
        metas[layer] = meta
    if metas and sum(t.numel() * t.element_size() for t in metas.values()) > DIRECT_RELOAD_BYTES:
        return False  # a large model: vLLM's reload, one layer's copy at a time
    for layer, meta in metas.items():
        weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
        if hasattr(weight, "weight_loader"):  # a reload of vLLM's may have left its
            weight.weight_loader = _get_original_loader(weight)  # counting wrapper there
        kept[layer] = weight
    for layer in packed:
        layer.weight = kept[layer]  # vLLM's parameter class: its loader and shard layout
    model.load_weights(iter(state.items()))  # type: ignore[operator]  # vLLM's own loader
    done: set[int] = set()
    for layer in layers:
        if id(layer) in done or not layer.weight.numel():
            continue
        layer.quant_method.process_weights_after_loading(layer)
        done.add(id(layer))
    return True


def _reprocess_shared(model: torch.nn.Module) -> None:
    """Rebuild the kernel copies of layers whose parameter another layer loaded (a tied head).

    vLLM's layer-by-layer reload processes the layer that loaded a shared parameter only; a
    layer that keeps its weight (the embedding method: `remove_weight=False`) is processed
    again from that weight. Layers whose weight was replaced by a packed copy are left alone."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    done: set[int] = set()
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if id(module) in done or method is None or weight is None or weight.numel() == 0:
                continue
            method.process_weights_after_loading(module)
            done.add(id(module))
