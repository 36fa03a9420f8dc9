"""Adapter-only versions (learner.lora.publish=adapters): a version travels as its low-rank
adapter set on a base the generator already holds (docs/LEARNER.md "LoRA", docs/PROTOCOL.md
1.10), both ends.

Every version is still a merged set W' = W + (alpha / r) B A (models.lora): its digest is the
one the announce carries, digests.jsonl records and replay reaches, and its directory
RUN_DIR/weights/v<N> is written as ever. Beside it the learner writes, once per learner process,
the base set RUN_DIR/weights/base (the frozen weights: every stored tensor of the merged set
with each adapted weight W in place of W', the norms trained in full left out), and, for every
version after its first, the adapter set RUN_DIR/weights/v<N>/adapter:

    <module>.lora_A [r, in], <module>.lora_B [out, r]   each adapted module, the learner's dtype
    <norm>.weight                                       each norm trained in full (as merged)

The announce's ``adapter`` field names both directories, their digests (the tree kind), the
adapted modules and the scale. ``AdapterLine`` is the learner's end (a backend's publication
goes through it), ``AdapterReceiver`` the generator's, stacked over every transport's
receiver (weights.transports.open_receiver). One announce, on the loop's thread::

    adapter set read from adapter.path, its digest == adapter.digest?       else Nack (named)
    no base held: read adapter.base_path once, its digest == base_digest?   (a late joiner)
    a base held whose digest != base_digest?                                Nack: wrong base
    targets == the set's factors, each <module>.weight in the base, shapes r-compatible?
                                                                            else Nack (named)
    merged = base, each adapted weight merge(W, s B A) (models.lora.merged_weight), the norms
    digest(merged) == the announce's digest? -> VerifiedWeights.of_checked to the engine
    else (a merge that differs in a bit): the merged directory, as shared_fs reads it

An announce that also carries a ``cuda_ipc`` field of a card this process sees (the learner on
this host, publish.transport=cuda_ipc) goes to the receivers below instead: the merged set
copied device to device and checked there (weights.cuda_ipc) costs milliseconds where the host
merge of a 7.1 GB set takes seconds. So does an adapter version announced from the device
(publish.directories=when_free, protocol 1.12): its adapter set is in the learner's slot and
its base in a buffer the learner packed once; weights.cuda_ipc merges them on the card (one
routine with this host merge: weights.adapter_merge) or refuses the version by name.

Invariant: nothing reaches the engine before its digest matched the announced merged digest;
a refused adapter set leaves the version served as it was (the engine is not touched).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from models.checkpoint import save_checkpoint
from proto.records import Ack, Nack, WeightAnnounce
from weights.adapter_merge import merge_adapters
from weights.check import WeightsRefused
from weights.cuda_ipc import card_visible
from weights.digest import digest_of_state, state_from_blob
from weights.publication import MANIFEST_NAME, Publication, read_manifest
from weights.receiver import GeneratorSide, Receiver
from weights.verified import VerifiedWeights

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""The adapter set of version N: RUN_DIR/weights/v<N>/adapter (pruned with its version)."""
BASE_DIR = "base"
"""The base set of the run's adapters: RUN_DIR/weights/base."""

__all__ = [
    "ADAPTER_DIR",
    "BASE_DIR",
    "AdapterLine",
    "AdapterReceiver",
    "adapter_state",
]


def adapter_state(
    factors: Mapping[str, tuple[Tensor, Tensor]], norms: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """{"<module>.lora_A": A, "<module>.lora_B": B, "<norm>.weight": w}: the adapter set's
    tensors (module docstring), on the CPU, contiguous."""
    out: dict[str, Tensor] = {}
    for m, (a, b) in factors.items():
        out[f"{m}.lora_A"] = a.detach().cpu().contiguous()
        out[f"{m}.lora_B"] = b.detach().cpu().contiguous()
    out.update({n: t.detach().cpu().contiguous() for n, t in norms.items()})
    return out


def _views(pub: Publication) -> dict[str, Tensor]:
    """{name: tensor} read-only views of ``pub``'s blob (nothing copied; never written to)."""
    with warnings.catch_warnings():  # torch warns of a read-only buffer: these are only read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return state_from_blob(pub.blob, pub.tensors, verify=False, copy=False)


def _write(state: Mapping[str, Tensor], pub_like: Publication, out: Path, version: int,
           tied: Mapping[str, str]) -> Publication:  # fmt: skip
    """``state`` written to ``out`` (HF layout, manifest.json) and read back as a Publication."""
    shutil.rmtree(out, ignore_errors=True)
    config = json.loads(pub_like.config_json) if pub_like.config_json else {}
    save_checkpoint(state, config, out, tied=tied)
    pub = Publication.from_dir(out, version)
    (out / MANIFEST_NAME).write_text(json.dumps(pub.manifest()))
    return pub


class AdapterLine:
    """The learner's end (rank 0, the thread that finishes a publication): the first version
    of this learner process (a run's start, a resume's first) goes out as the full merged set
    as ever, and writes the base set (once: a base directory of the same digest is kept);
    every later one also carries its adapter set (module docstring)."""

    def __init__(self, run_dir: str | Path, scale: float) -> None:
        self.weights_root = Path(run_dir) / "weights"
        self.scale = scale
        self.base: Publication | None = None
        self.counts: Counter[str] = Counter()

    def publication(
        self,
        merged: Publication,
        factors: Mapping[str, tuple[Tensor, Tensor]],
        frozen: Mapping[str, Tensor],
        norms: Iterable[str],
    ) -> Publication:
        """``merged`` (a version's merged set, its directory written), with its adapter set
        written and named in ``merged.adapter`` unless it is this line's first version.
        ``factors``: {module: (A, B)} as merged; ``frozen``: {"<module>.weight": W} of the
        base; ``norms``: the names of the norms trained in full."""
        norms = sorted(norms)
        if self.base is None:
            self.base = self._base(merged, frozen, norms)
            return merged
        if merged.path is None:
            raise ValueError(f"weights v{merged.version}: no directory to put the adapter set in")
        full = _views(merged)
        state = adapter_state(factors, {n: full[n] for n in norms})
        out = Path(merged.path) / ADAPTER_DIR
        ad = _write(state, merged, out, merged.version, {})
        base = self.base
        assert (ad.digest_kind, ad.digest_chunk_bytes) == (
            base.digest_kind,
            base.digest_chunk_bytes,
        )
        self.counts["adapter_versions"] += 1
        field: dict[str, Any] = {
            "path": str(out.resolve()), "digest": ad.digest, "digest_kind": ad.digest_kind,
            "digest_chunk_bytes": ad.digest_chunk_bytes, "bytes": len(ad.blob),
            "base_path": str(Path(str(base.path)).resolve()), "base_digest": base.digest,
            "targets": ",".join(sorted(factors)), "scale": float(self.scale),
        }  # fmt: skip
        return dataclasses.replace(merged, adapter=field)

    def _base(
        self, merged: Publication, frozen: Mapping[str, Tensor], norms: list[str]
    ) -> Publication:
        """The base set (module docstring), written to RUN_DIR/weights/base unless a base of
        the same digest is there."""
        full = _views(merged)
        missing = sorted(set(frozen) - set(full))
        if missing:
            raise ValueError(f"adapted weights {missing} are not stored tensors of the set")
        state = {n: t for n, t in full.items() if n not in norms}
        state.update({n: w.detach().cpu().contiguous() for n, w in frozen.items()})
        out = self.weights_root / BASE_DIR
        tied = {t: src for t, src in merged.tied.items() if src in state}  # not a trained embedding
        want = Publication.of_state(state, merged.version, out, tied=tied,
                                    config_json=merged.config_json)  # fmt: skip
        try:
            if read_manifest(out)["digest"] == want.digest:
                self.counts["base_kept"] += 1
                return want
        except (OSError, ValueError, KeyError):
            pass
        self.counts["base_written"] += 1
        return _write(state, merged, out, merged.version, tied)


class AdapterReceiver:
    """The generator's end (module docstring): announces with an ``adapter`` field and no
    chunks are taken here; every other record goes to ``fallback``. It keeps the base set it
    read (a host copy) for the versions after."""

    def __init__(
        self,
        conn: GeneratorSide,
        fallback: Receiver,
        generator_id: str = "",
        *,
        serving_version: int = -1,
        max_total_bytes: int = 1 << 40,
    ) -> None:
        self.conn, self.fallback, self.generator_id = conn, fallback, generator_id
        self.serving, self.max_total_bytes = serving_version, max_total_bytes
        self.base: dict[str, Tensor] | None = None
        self.base_digest = ""
        self.counts: Counter[str] = Counter()
        self.bytes_read: Counter[str] = Counter()
        """Bytes of tensors read: ``adapter`` (every adapter set), ``base`` (each base read)."""

    def handle(self, rec: Any) -> VerifiedWeights | None:
        if isinstance(rec, WeightAnnounce) and rec.adapter and not rec.num_chunks:
            if rec.cuda_ipc.get("holds") == "adapter":  # the adapter set on the device only
                self.counts["device_adapter"] += 1  # (weights.cuda_ipc merges it on the card)
                return self.fallback.handle(rec)
            if rec.cuda_ipc and card_visible(str(rec.cuda_ipc.get("device_uuid", ""))):
                # the learner's card is ours (cuda_ipc): its device copy of the merged set, a
                # device-to-device copy checked there, beats reading and merging on the host
                self.counts["device_copy"] += 1
                return self.fallback.handle(rec)
            return self._adapter(rec)
        return self.fallback.handle(rec)

    def loaded(self, version: int) -> None:
        self.serving = max(self.serving, version)
        self.fallback.loaded(version)

    def load_failed(self, version: int, reason: str) -> None:
        self.fallback.load_failed(version, reason)

    def _nack(self, version: int, reason: str) -> None:
        log.warning("refusing adapter weights v%d: %s", version, reason)
        self.counts["nacked"] += 1
        self.conn.send(Nack("weights", str(version), reason[:2000], version), channel="weights")

    def _read(
        self, path: str, version: int, c: Mapping[str, Any], digest: str
    ) -> dict[str, Tensor]:
        kind, chunk = str(c["digest_kind"]), int(c["digest_chunk_bytes"])
        try:
            state = VerifiedWeights.of(path, version, digest, kind=kind, chunk_bytes=chunk).state()
        except WeightsRefused:
            raise
        except Exception as e:  # unreadable: named as what it is
            raise WeightsRefused(f"{path}: {type(e).__name__}: {e}") from None
        return dict(state)

    def _adapter(self, ann: WeightAnnounce) -> VerifiedWeights | None:
        v, c = ann.version, ann.adapter
        if v <= self.serving:  # already serving it: our Ack was lost
            self.conn.send(Ack("weights", str(self.serving), self.serving), channel="weights")
            return None
        t0 = time.perf_counter()
        try:
            base_digest = str(c["base_digest"])
            if self.base is not None and self.base_digest != base_digest:
                raise WeightsRefused(
                    f"wrong base: the adapter set applies to base {base_digest[:16]}, this "
                    f"generator holds base {self.base_digest[:16]}"
                )
            try:
                adapter = self._read(str(c["path"]), v, c, str(c["digest"]))
            except WeightsRefused as e:
                raise WeightsRefused(f"adapter set of v{v}: {e}") from None
            nbytes = sum(t.nbytes for t in adapter.values())
            self.bytes_read["adapter"] += nbytes
            t1 = time.perf_counter()
            if self.base is None:  # a late joiner (or the first adapter): the base, once
                self.base = self._read(str(c["base_path"]), v, c, base_digest)
                self.base_digest = base_digest
                self.bytes_read["base"] += sum(t.nbytes for t in self.base.values())
                self.counts["base_read"] += 1
                log.info("weights v%d: read the base %s once (%d bytes)", v, base_digest[:16],
                         self.bytes_read["base"])  # fmt: skip
            t2 = time.perf_counter()
            targets = [t for t in str(c["targets"]).split(",") if t]
            merged = merge_adapters(self.base, adapter, targets, float(c["scale"]))  # type: ignore[arg-type]
        except WeightsRefused as e:
            self._nack(v, str(e))
            return None
        got = digest_of_state(merged, ann.digest_kind, ann.digest_chunk_bytes)
        if got != ann.digest:  # a merge off by a bit: read the merged set as shared_fs does
            log.warning("weights v%d: the merged adapter set's digest %s is not the announced "
                        "%s; reading the merged directory", v, got[:16], ann.digest[:16])  # fmt: skip
            self.counts["merge_mismatch"] += 1
            return self.fallback.handle(ann)
        self.counts["merged"] += 1
        log.info("weights v%d: adapter set of %d bytes read in %.3f s, merged onto base %s and "
                 "checked in %.3f s", v, nbytes, t1 - t0, base_digest[:16],
                 time.perf_counter() - t2)  # fmt: skip
        return VerifiedWeights.of_checked(ann, merged)
