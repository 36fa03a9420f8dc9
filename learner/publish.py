"""Weight publication: the policy, gathered over tensor parallel, in the family's HF layout.

Order of calls (every rank calls; ranks outside data-parallel rank 0 return None at once):

    out = weights.publication.weights_dir(run_dir, v)   # the coordinator names it
    pub = publish(trainer.policy_model, out, v, dtype=torch.bfloat16)
    if pub is not None:                                  # global rank 0 (the coordinator)
        publisher.publish(pub)                           # weights.transports: the announce, ...

This module is the learner's part only (the TP gather and the cast); the publication itself
(blob, digest, manifest, the directory's name) is weights.publication's.

What is published, for weight version v:

1. the full HF state dict (`exporter`, default `looped_exporter`: learner.hf_convert's TP
   all-gather over the TP group of data-parallel rank 0);
2. floating parameters cast to `dtype` when given; buffers (Huginn's fp32 `freqs_cis`) keep
   their dtype; tied tensors stay one tensor through the cast;
3. tied weights (`lm_head.*` sharing its embedding) stored once, under the embedding's name,
   as `save_pretrained` does: on disk, in the blob and in the digest alike;
4. on global rank 0: `out_dir` (the run's `RUN_DIR/weights/v<v>`) written atomically by
   `models.checkpoint.save_checkpoint` (config.json, model.safetensors, manifest.json);
   manifest.json = `Publication.manifest()`: {"format", "version", "digest", "digest_kind",
   "digest_chunk_bytes", "tied", "tensors": [{name, dtype, shape, offset, nbytes, sha256}]};
   the digest is the tree digest (weights.digest) of the stored tensors' blob;
5. the same tensors as one contiguous blob + per-tensor metadata (`weights.digest`)
   for the transports (weights.transports).

Non-finite weights are never published: `publication_state` checks every stored tensor after
the cast (a finite fp32 value can overflow bf16) and raises `NonFiniteWeightsError` naming the
first offending tensor (sorted by name) and its count of NaN / inf elements; nothing is written.
It is raised on every rank of data-parallel rank 0's TP group (they all hold the full state);
the other DP ranks return None as always.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.checkpoint import json_bytes, save_checkpoint
from models.ties import detached_copy, view_key
from weights.digest import check_finite
from weights.publication import MANIFEST_NAME, DeviceSnapshot, Publication

__all__ = [
    "Exporter",
    "cast_for_publication",
    "looped_exporter",
    "publication_state",
    "publish",
    "snapshot_publication",
    "tie_map",
]

Exporter = Callable[[nn.Module], tuple[dict[str, Tensor], set[str]]]
"""model -> (full HF state dict on every rank of the TP group, names that are buffers).
A collective over the tensor-parallel group."""


def looped_exporter(model: nn.Module) -> tuple[dict[str, Tensor], set[str]]:
    """HF state of a `learner.megatron.model.LoopedGPT` (`gather_hf_state`) and its buffers."""
    from learner.hf_convert import conversion_rules, gather_hf_state

    params = {n for n, _ in model.named_parameters()}
    buffers = {h for r in conversion_rules(model) if r.mine not in params for h in r.hf}  # type: ignore[arg-type]
    return gather_hf_state(model), buffers  # type: ignore[arg-type]


def tie_map(state: Mapping[str, Tensor], head_prefix: str = "lm_head.") -> dict[str, str]:
    """{target: source} for names under `head_prefix` that are the very tensor of another
    name (the embedding): the target is dropped on save, as transformers does."""
    by_storage: dict[tuple, list[str]] = {}
    for name in sorted(state):
        t = state[name]
        if t.numel():
            key = view_key(t)
            by_storage.setdefault(key, []).append(name)
    tied: dict[str, str] = {}
    for names in by_storage.values():
        sources = [n for n in names if not n.startswith(head_prefix)]
        if len(names) > 1 and sources:
            tied.update({n: sources[0] for n in names if n.startswith(head_prefix)})
    return tied


def cast_for_publication(
    state: Mapping[str, Tensor], dtype: torch.dtype | None, keep: set[str]
) -> dict[str, Tensor]:
    """Floating tensors not in `keep` cast to `dtype` (None: unchanged); tensors that share
    storage stay shared after the cast."""
    if dtype is None:
        return dict(state)
    done: dict[tuple, Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name in keep or not t.is_floating_point():
            out[name] = t
            continue
        key = view_key(t)
        if key not in done:
            done[key] = t.detach().to(dtype)
        out[name] = done[key]
    return out


def publication_state(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    exporter: Exporter | None = None,
    on_device: bool = False,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(stored tensors: tie targets dropped, contiguous, on the CPU, or where the model keeps
    them with ``on_device``; tied {target: source}). A collective over the TP group (the
    exporter's gather). NonFiniteWeightsError when a stored tensor holds NaN or inf
    (`check_finite`, on the device too: a GPU scans 7 GB in milliseconds)."""
    state, buffers = (exporter or looped_exporter)(model)
    state = cast_for_publication(state, dtype, buffers)
    tied = tie_map(state)
    stored = {n: t.detach().contiguous() if on_device else t.detach().cpu().contiguous()
              for n, t in sorted(state.items()) if n not in tied}  # fmt: skip
    check_finite(stored)
    return stored, tied


@contextlib.contextmanager
def _side_stream(stored: Mapping[str, Tensor], ready: Any) -> Iterator[None]:
    """With device tensors in ``stored``: a side stream on their device that waits for
    ``ready`` (the CUDA event recorded after the snapshot's copies), current for the block,
    so the blob's device -> host copies run beside the next step's kernels instead of in
    their stream; synchronised at the end. Without: nothing."""
    if ready is None:
        yield
        return
    dev = next(t.device for t in stored.values() if t.is_cuda)  # a new thread's device is 0
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
    with torch.cuda.device(dev), torch.cuda.stream(side):
        side.wait_event(ready)
        yield
    side.synchronize()


def _config_dict(model: nn.Module, config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is not None:
        return dict(config)
    family = getattr(model, "family_config", None)
    if family is None:
        raise ValueError("config: required for a model without `family_config`")
    return dict(family.to_hf_dict())


def snapshot_publication(
    model: nn.Module,
    out_dir: str | os.PathLike | None,
    version: int,
    *,
    config: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    exporter: Exporter | None = None,
) -> Callable[[], Publication] | None:
    """The collective part of :func:`publish`, now; the rest as a function to call later.

    Every rank takes part in the gather; on global rank 0 the stored tensors are made its own
    (``models.ties.detached_copy``: a tensor that still shares memory with the model is cloned,
    since the next step trains on) and the returned ``finish()`` builds the blob, the tree digest
    and writes ``out_dir``, on any thread, while the model trains; every other rank gets None.
    NonFiniteWeightsError (nothing written) here, before any training goes on."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if version < 0:
        raise ValueError(f"version: expected >= 0, got {version}")
    if ps.get_data_parallel_rank() != 0:
        return None
    # the copy the next step cannot touch is made where the weights are (a device-to-device
    # copy on a GPU: milliseconds for 7 GB, where the host copy and scan took ~12 s on the
    # trainer thread at the Huginn-0125 shape); finish() brings it to the host on its thread
    stored, tied = publication_state(model, dtype=dtype, exporter=exporter, on_device=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    stored = detached_copy(stored, live=[*model.parameters(), *model.buffers()])
    ready = None
    if any(t.is_cuda for t in stored.values()):
        ready = torch.cuda.Event()
        ready.record()  # after the copies, on the trainer's stream
    config_dict = _config_dict(model, config)
    path = None if out_dir is None else Path(out_dir)

    def finish() -> Publication:
        config_json = json_bytes(config_dict).decode("utf-8")
        # device tensors are copied into the blob from there (the "blob" stage includes it)
        with _side_stream(stored, ready):
            pub = Publication.of_state(stored, version, path, tied=tied,
                                       config_json=config_json, checked=True,
                                       device_state=stored if ready is not None else None)  # fmt: skip
        if path is not None:
            t0 = time.perf_counter()
            save_checkpoint(stored, config_dict, path, tied=tied,
                            extra_files={MANIFEST_NAME: pub.manifest()},
                            blob=(pub.blob, pub.tensors))  # fmt: skip
            pub.stage_s["write"] = time.perf_counter() - t0
        return pub

    if ready is None:
        return finish
    return _Finish(finish, DeviceSnapshot(version, stored, dict(tied),
                                          json_bytes(config_dict).decode("utf-8"), path, ready))  # fmt: skip


class _Finish:
    """``snapshot_publication``'s ``finish`` when the copy is on a GPU: callable as ever, with
    the copy itself as ``device`` (weights.publication.DeviceSnapshot)."""

    def __init__(self, finish: Callable[[], Publication], device: DeviceSnapshot) -> None:
        self.finish, self.device = finish, device

    def __call__(self) -> Publication:
        return self.finish()


def publish(
    model: nn.Module,
    out_dir: str | os.PathLike | None,
    version: int,
    *,
    config: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    exporter: Exporter | None = None,
) -> Publication | None:
    """Publish the policy as weight version `version` (module docstring).

    Call on every rank. Data-parallel rank 0's TP group gathers; global rank 0 writes
    `out_dir` (skipped when None) and returns the Publication; every other rank returns None.
    config: the HF config dict (default: `model.family_config.to_hf_dict()`). Raises
    NonFiniteWeightsError (nothing written) when a published tensor is not finite.
    :func:`snapshot_publication` then its ``finish()``.
    """
    finish = snapshot_publication(model, out_dir, version, config=config, dtype=dtype,
                                  exporter=exporter)  # fmt: skip
    return None if finish is None else finish()
