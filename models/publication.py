"""A published weight set: the one ``Publication`` type of the learner and the pipeline.

The learner's publish (learner/publish.py: gather, cast, write the HF directory) returns it;
the coordinator announces it as it is. ``Publication.from_dir`` reads a written directory
back (the reference backend's path, and replay's digest check): that and the learner's
publish are the only two places a publication's canonical digest is computed, both with
``models.digest`` (DESIGN contract 6), and both refuse non-finite tensors.

``weights_dir`` and ``prune_weights`` are the one owner of the run's weight directories,
``RUN_DIR/weights/v<version>``: the coordinator names the directory a trainer writes and prunes
them after each announcement, including directories a killed run left behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.records import TensorMeta, WeightAnnounce


@dataclass(frozen=True)
class Publication:
    """One published weight set (rank 0's view)."""

    version: int
    """Weight version (strictly increasing)."""
    digest: str
    """`models.digest.canonical_digest` of the stored tensors (64 hex chars)."""
    path: Path | None
    """HF-layout directory, or None when nothing was written."""
    blob: bytes
    """Canonical bytes of every stored tensor, sorted by name (`models.digest.blob_and_meta`)."""
    tensors: list[dict[str, Any]]
    """Per-tensor {name, dtype, shape, offset, nbytes, sha256} inside the blob."""
    tied: dict[str, str]
    """{target: source} of tied weights (targets absent from blob and disk)."""
    config_json: str
    """The config.json text."""

    @classmethod
    def from_dir(cls, path: str | Path, version: int) -> Publication:
        """Read a written HF directory back: the state a generator's engine loads from it, so
        the digests agree by construction. NonFiniteWeightsError if a tensor is not finite."""
        from models.checkpoint import load_checkpoint
        from models.digest import blob_and_meta, check_finite, digest_from_blob

        path = Path(path)
        config, state = load_checkpoint(path)
        check_finite(state, f"weights v{version} in {path}")
        blob, meta = blob_and_meta(state)
        return cls(version, digest_from_blob(blob, meta), path, blob, meta, {},
                   json.dumps(config, sort_keys=True))  # fmt: skip

    def tensor_metas(self) -> list[TensorMeta]:
        return [TensorMeta(**t) for t in self.tensors]

    def announce(self, chunk_bytes: int, *, created_at: float = 0.0) -> WeightAnnounce:
        """The WeightAnnounce of a chunked broadcast of `blob` in `chunk_bytes` chunks, or of
        the directory alone (no chunks) when `chunk_bytes` is 0."""
        if chunk_bytes < 0 or (chunk_bytes == 0 and self.path is None):
            raise ValueError(f"chunk_bytes: expected >= 1 (or 0 with a path), got {chunk_bytes}")
        ann = WeightAnnounce(
            version=self.version,
            digest=self.digest,
            total_bytes=len(self.blob),
            chunk_bytes=chunk_bytes,
            num_chunks=-(-len(self.blob) // chunk_bytes) if chunk_bytes else 0,
            tensors=self.tensor_metas(),
            path="" if self.path is None else str(self.path.resolve()),
            config_json=self.config_json,
            created_at=created_at,
        )
        ann.validate()
        return ann


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
