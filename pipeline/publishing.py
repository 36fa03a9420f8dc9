"""Announcing published weights: on disk (a directory) or chunked, with the canonical digest.

``WeightPublisher.publish`` (pipeline/weight_sync.py) streams the blob in chunks and announces
``models.digest.digest_from_blob(blob, tensors)``, the canonical digest that the receiver and
``LoopedEngine.load_weights`` verify. ``CanonicalPublisher`` adds the on-disk form:

- ``chunked=False`` (publish.transport "disk"): the announce carries ``path`` and no chunks;
  the generator loop hands the directory to the engine, which checks the canonical digest of
  what it loads before serving. Nothing but the announce crosses the wire.
- ``chunked=True`` (publish.transport "chunks"): WeightPublisher.publish, unchanged.

Everything else (per-generator transfers, credits, retries) is WeightPublisher's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline.weight_sync import WeightPublisher, WeightSyncError
from proto import TensorMeta, WeightAnnounce


class CanonicalPublisher(WeightPublisher):
    """WeightPublisher whose announce digest is the canonical one (see the module doc)."""

    def publish(
        self,
        version: int,
        blob: bytes,
        *,
        tensors: Sequence[TensorMeta] = (),
        config_json: str = "",
        path: str = "",
        digest: str | None = None,
        chunked: bool = True,
    ) -> WeightAnnounce:
        if chunked:
            return super().publish(
                version, blob, tensors=tensors, config_json=config_json, path=path, digest=digest
            )
        if version <= self.version:
            raise WeightSyncError(f"version {version} is not newer than {self.version}")
        if digest is None or len(digest) != 64:
            raise WeightSyncError("an on-disk publication needs the canonical digest")
        if not path:
            raise WeightSyncError("an on-disk publication needs its path")
        n = len(blob)
        ann = WeightAnnounce(
            version=version,
            digest=digest,
            total_bytes=n,
            chunk_bytes=0,
            num_chunks=0,
            tensors=list(tensors),
            path=path,
            config_json=config_json,
            created_at=time.time(),
        )
        ann.validate()
        self.announce, self._blob = ann, b""
        for g in self._gens.values():
            if g.serving < version:
                self._start(g)
        self.counts["published"] += 1
        return ann
