"""A published weight set: the one ``Publication`` type of the learner and the pipeline.

The learner's publish (learner/publish.py: gather, cast, write the HF directory) and the
reference backend (``Publication.from_dir``, which reads a written directory back, as replay's
digest check does) both build it with ``Publication.of_state``: the one place a publication's
digest is computed (weights.digest, the tree kind, docs/CONTRACTS.md 6), after the
non-finite check. The coordinator announces it as it is (``digests``: the digest, its kind, chunk
size and per-piece leaves) and writes ``record()`` to RUN_DIR/weights/digests.jsonl.

``manifest()`` is the manifest.json written beside the safetensors; ``verify_publication``
checks a written directory against it (either digest kind: a manifest without
``digest_kind`` is the flat kind of the runs before the tree).

``weights_dir`` and ``prune_weights`` are the one owner of the run's weight directories,
``RUN_DIR/weights/v<version>``: the coordinator names the directory a trainer writes and prunes
them after each announcement, including directories a killed run left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from proto.records import TensorMeta, WeightAnnounce
from weights.digest import (
    DEFAULT_CHUNK_BYTES,
    FLAT,
    TREE,
    Digest,
    blob_and_meta,
    check_finite,
    check_kind,
    digest_of_state,
    weights_digest,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "looprl-weights/1"


@dataclass
class DeviceSnapshot:
    """A version's stored tensors as the trainer's snapshot left them on its GPU (learner.publish;
    a transport that announces from there: weights.cuda_ipc, publish.directories=auto)."""

    version: int
    state: dict[str, torch.Tensor]
    """The stored tensors (after the ties), the learner's own copy, on one CUDA device."""
    tied: dict[str, str]
    config_json: str
    path: Path | None
    """Where its directory goes if one is written (RUN_DIR/weights/v<version>)."""
    ready: Any = None
    """A CUDA event recorded after the snapshot's copies (wait on it before reading)."""
    adapter: DeviceAdapter | None = None
    """learner.lora.publish=adapters: the version's adapter set, announced on the device as
    that set on a base (weights.cuda_ipc); ``state`` then holds at least the tensors trained
    in full (the whole set unless ``adapter.whole`` takes it)."""


@dataclass
class DeviceAdapter:
    """A version's low-rank adapter set on the learner's card (weights.cuda_ipc's adapter
    versions; the host's: weights.adapters)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """{module: (A [r, in], B [out, r])}, the learner's copies as merged into ``state``."""
    full: list[str]
    """The stored tensors trained in full beside the adapters (the norms; in ``state``)."""
    frozen: Callable[[str], torch.Tensor]
    """Module -> its base weight W (before training), on the card: called for each adapted
    module once per publisher (the base set, packed one weight at a time)."""
    scale: float
    """alpha / rank."""
    whole: Callable[[], tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None
    """The version's whole stored set on the card and its ties, taken when called (the first
    version of a publisher: the base is packed from it); None: the snapshot's ``state`` is the
    whole set."""


@dataclass(frozen=True)
class Publication:
    """One published weight set (rank 0's view)."""

    version: int
    """Weight version (strictly increasing)."""
    digest: str
    """The digest of the stored tensors, of kind ``digest_kind`` (64 hex chars)."""
    path: Path | None
    """HF-layout directory, or None when nothing was written."""
    blob: bytes | memoryview
    """Canonical bytes of every stored tensor, sorted by name (`weights.digest.blob_and_meta`:
    a read-only view of one host buffer)."""
    tensors: list[dict[str, Any]]
    """Per-tensor {name, dtype, shape, offset, nbytes, sha256} inside the blob."""
    tied: dict[str, str]
    """{target: source} of tied weights (targets absent from blob and disk)."""
    config_json: str
    """The config.json text."""
    digest_kind: str = FLAT
    """weights.digest.TREE for every new publication; FLAT only when built by hand."""
    digest_chunk_bytes: int = 0
    """Piece size of a tree digest."""
    chunk_digests: tuple[str, ...] = ()
    """sha256 hex of each piece of the blob (tree kind): announced, checked per piece."""
    stage_s: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    """Seconds of the stages that built it: ``blob`` (the canonical bytes), ``digest`` (the
    tree digest), and ``write`` when learner.publish wrote its directory (the metrics rows'
    ``time/publish_<stage>``); empty when built otherwise. Not part of its identity."""
    device_state: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """The stored tensors where the learner keeps them (a GPU: learner.publish), for a transport
    that sends them from there (weights.cuda_ipc), which empties it once it has; empty when the
    tensors were on the host. Not part of its identity."""
    adapter: dict[str, Any] = field(default_factory=dict, compare=False)
    """The announce's ``adapter`` field (weights.adapters, learner.lora.publish=adapters): this
    merged set is also an adapter set on a base, whose directory and digests it names; empty
    for a plain set. Not part of its identity (the merged digest is)."""

    @classmethod
    def of_state(
        cls,
        stored: Mapping[str, torch.Tensor],
        version: int,
        path: Path | None,
        *,
        tied: Mapping[str, str] | None = None,
        config_json: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        where: str = "",
        checked: bool = False,
        device_state: Mapping[str, torch.Tensor] | None = None,
    ) -> Publication:
        """Blob, metadata and tree digest of the stored tensors (hashed on the thread pool).
        NonFiniteWeightsError naming the first tensor that holds NaN or inf (and ``where``),
        unless the caller ``checked`` already (learner.publish, on every rank of its TP group)."""
        if not checked:
            check_finite(stored, where)
        t0 = time.perf_counter()
        blob, meta = blob_and_meta(stored)
        t1 = time.perf_counter()
        d = weights_digest(blob, meta, TREE, chunk_bytes)
        stage_s = {"blob": t1 - t0, "digest": time.perf_counter() - t1}
        return cls(version, d.hex, path, blob, meta, dict(tied or {}), config_json,
                   d.kind, d.chunk_bytes, d.chunks, stage_s, dict(device_state or {}))  # fmt: skip

    @classmethod
    def on_device(
        cls,
        version: int,
        digest: str,
        tensors: list[dict[str, Any]],
        *,
        tied: Mapping[str, str] | None = None,
        config_json: str = "",
    ) -> Publication:
        """A version that lives on the device only (publish.transport=cuda_ipc with
        publish.directories=auto, weights.cuda_ipc): named by its device digest ``digest``
        (kind ``mix128``, weights.device_digest) over the canonical layout ``tensors``
        ({name, dtype, shape, offset, nbytes}; no per-tensor sha256), no blob on the host, no
        directory. ``nbytes`` is its size; ``digest_as`` needs a host blob and refuses here."""
        from weights.device_digest import KIND

        metas = [{**t, "sha256": str(t.get("sha256", ""))} for t in tensors]
        return cls(version, digest, None, memoryview(b""), metas, dict(tied or {}), config_json,
                   KIND, 0, ())  # fmt: skip

    @property
    def on_device_only(self) -> bool:
        """Named by its device digest, with no host blob (``on_device``)."""
        from weights.device_digest import KIND

        return self.digest_kind == KIND and not len(self.blob)

    @property
    def nbytes(self) -> int:
        """The size of its canonical blob (bytes), also when the blob is on the device only."""
        if len(self.blob) or not self.tensors:
            return len(self.blob)
        last = self.tensors[-1]
        return int(last["offset"]) + int(last["nbytes"])

    @classmethod
    def from_dir(cls, path: str | Path, version: int) -> Publication:
        """Read a written HF directory back: the state a generator's engine loads from it, so
        the digests agree by construction. NonFiniteWeightsError if a tensor is not finite."""
        from models.checkpoint import load_checkpoint

        path = Path(path)
        config, state = load_checkpoint(path)
        return cls.of_state(state, version, path, config_json=json.dumps(config, sort_keys=True),
                            where=f"weights v{version} in {path}")  # fmt: skip

    @property
    def digests(self) -> Digest:
        """The digest with its kind, chunk size and per-piece leaves (what the announce carries)."""
        return Digest(self.digest, self.digest_kind, self.digest_chunk_bytes, self.chunk_digests)

    def record(self) -> dict[str, Any]:
        """The line of RUN_DIR/weights/digests.jsonl: {version, digest, digest_kind,
        digest_chunk_bytes}."""
        return {"version": self.version, **self.digests.record()}

    def digest_as(self, kind: str = "", chunk_bytes: int = 0) -> str:
        """This set's digest of kind ``kind`` ("": the flat kind of runs recorded before the
        tree): what replay compares with a recorded digest of that kind."""
        from weights.device_digest import KIND, digest_on_host_blob

        if kind == KIND:  # a version named on the device (weights.cuda_ipc)
            if self.on_device_only:
                raise ValueError(f"weights v{self.version}: on the device only, no host blob")
            if self.digest_kind == KIND:
                return self.digest
            return digest_on_host_blob(self.blob, self.tensors)
        kind = check_kind(kind, chunk_bytes)
        if (kind, chunk_bytes if kind == TREE else 0) == (
            self.digest_kind,
            self.digest_chunk_bytes,
        ):
            return self.digest
        return weights_digest(self.blob, self.tensors, kind, chunk_bytes or DEFAULT_CHUNK_BYTES).hex

    def manifest(self) -> dict[str, Any]:
        """manifest.json: {format, version, digest, digest_kind, digest_chunk_bytes, tied, tensors}."""
        return {"format": MANIFEST_FORMAT, "version": self.version, **self.digests.record(),
                "tied": dict(sorted(self.tied.items())), "tensors": self.tensors}  # fmt: skip

    def tensor_metas(self) -> list[TensorMeta]:
        return [TensorMeta(**t) for t in self.tensors]

    def announce(
        self,
        chunk_bytes: int,
        *,
        created_at: float = 0.0,
        cuda_ipc: Mapping[str, Any] | None = None,
    ) -> WeightAnnounce:
        """The WeightAnnounce of a chunked broadcast of `blob` in `chunk_bytes` chunks, or of
        the directory alone (no chunks) when `chunk_bytes` is 0; ``cuda_ipc``: its field
        (weights.cuda_ipc; what a version on the device only is announced with)."""
        if self.on_device_only and chunk_bytes:
            raise ValueError(f"weights v{self.version}: on the device only, no blob to chunk")
        if chunk_bytes < 0 or (chunk_bytes == 0 and self.path is None and not self.on_device_only):
            raise ValueError(f"chunk_bytes: expected >= 1 (or 0 with a path), got {chunk_bytes}")
        ann = WeightAnnounce(
            version=self.version,
            digest=self.digest,
            total_bytes=self.nbytes,
            chunk_bytes=chunk_bytes,
            num_chunks=-(-len(self.blob) // chunk_bytes) if chunk_bytes else 0,
            tensors=self.tensor_metas(),
            path="" if self.path is None else str(self.path.resolve()),
            config_json=self.config_json,
            created_at=created_at,
            digest_kind=self.digest_kind,
            digest_chunk_bytes=self.digest_chunk_bytes,
            chunk_digests=list(self.chunk_digests),
            adapter=dict(self.adapter),
            cuda_ipc=dict(cuda_ipc or {}),
        )
        ann.validate()
        return ann


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest.json of a published weights directory."""
    manifest: dict[str, Any] = json.loads((Path(path) / MANIFEST_NAME).read_text("utf-8"))
    return manifest


def verify_publication(path: str | os.PathLike[str]) -> str:
    """Recompute the digest of a published directory from its safetensors (of the manifest's
    kind); ValueError unless it equals the manifest's digest (and each tensor its sha256).
    Returns the digest."""
    from models.checkpoint import load_checkpoint

    manifest = read_manifest(path)
    _, state = load_checkpoint(path)
    kind, chunk = manifest.get("digest_kind", ""), int(manifest.get("digest_chunk_bytes", 0))
    digest = digest_of_state(state, kind, chunk)
    if digest != manifest["digest"]:
        raise ValueError(f"{path}: digest {digest} != manifest {manifest['digest']}")
    _, tensors = blob_and_meta(state)
    want = {t["name"]: t["sha256"] for t in manifest["tensors"]}
    got = {t["name"]: t["sha256"] for t in tensors}
    if want != got:
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        raise ValueError(f"{path}: per-tensor sha256 differ from the manifest: {bad}")
    return digest


def weights_dir(run_dir: str | Path, version: int) -> Path:
    """``RUN_DIR/weights/v<version>``: where weight version ``version`` is written."""
    return Path(run_dir) / "weights" / f"v{version}"


def weight_versions(run_dir: str | Path) -> list[int]:
    """The versions that have a directory under ``RUN_DIR/weights``, ascending."""
    root = Path(run_dir) / "weights"
    if not root.is_dir():
        return []
    return sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())


def prune_weights(run_dir: str | Path, current: int, keep: int) -> list[int]:
    """Remove the weight directories older than the newest ``keep`` versions up to ``current``
    (those a run announced and those a killed run left; a directory above ``current`` may be
    being written and is left); ``keep`` 0 keeps everything. Returns the removed versions."""
    if keep <= 0:
        return []
    upto = [v for v in weight_versions(run_dir) if v <= current]
    gone = upto[:-keep]
    for v in gone:
        shutil.rmtree(weights_dir(run_dir, v), ignore_errors=True)
    return gone


__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "Publication",
    "prune_weights",
    "read_manifest",
    "verify_publication",
    "weight_versions",
    "weights_dir",
]
