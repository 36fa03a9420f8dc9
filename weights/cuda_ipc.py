"""Same-host weights on the device (publish.transport=cuda_ipc): a version goes from the
learner's GPU memory to a generator's without touching the host, checked on the device.

Learner side (``CudaIpcPublisher``): the trainer's snapshot keeps the stored tensors on the
card (``Publication.device_state``, learner.publish); ``prepare`` (the publishing thread,
beside the next step) packs them in the canonical blob layout (weights.digest) into one of
``slots`` device buffers the publisher owns, round robin, and computes the blob's device digest
there (weights.device_digest, one read of the bytes); ``publish`` announces the directory as
shared_fs does, with a ``cuda_ipc`` field (proto.records.WeightAnnounce, protocol 1.9): the
buffer's CUDA IPC handle (shared once per buffer), the card's UUID, the slot and the device
digest. The directory is still written (a checkpoint of the version, other hosts, a generator
that cannot map the buffer) on the publishing thread before the announce, as with shm.

Generator side (``CudaIpcReceiver``, stacked on the weights channel's receiver by
weights.transports.open_receiver): an announce with a ``cuda_ipc`` field whose card this process
sees is mapped (``torch.UntypedStorage._new_shared_cuda``, once per buffer and kept), copied
device to device into a buffer of the generator's own, and its device digest computed on that
copy and compared with the announced one; a match is handed to the engine as views of the
copy (``VerifiedWeights.of_checked``: not hashed again). A copy whose digest differs (a torn
read: the learner refilled the slot while it was copied, or corrupted memory) is refused by
name, counted and logged, and the announce goes to the receiver below, which reads the
directory (checked as read): the generator serves its version until one loads. So does an
announce it cannot map (another card, another host, no CUDA). A receiver in the learner's own
process (a generator thread: generators.placement=thread) takes the buffer itself (CUDA maps no
handle in the process that made it): the same copy and check, no mapping.

Device first (publish.directories=when_free): a version whose snapshot is on the card
(``SnapshotResult.device``, a ``DeviceSnapshot``) is packed and digested on the trainer thread
right after the snapshot (milliseconds; the snapshot's copy is freed at once) and announced as
soon as the coordinator takes the step, named by its device digest (``Publication.on_device``, kind
mix128, no path): no host blob, tree digest or disk write before it, the work that set the pace
of a 7.1 GB version (13 s at Huginn-0125 on an H200). Its directory is written beside training
by ``DirectoryWriter`` when that is free (the slot's bytes copied to a pinned host buffer under
the slot's lock, then the tree digest and the safetensors from there); a version that comes
while one is being written gets none, and ``close`` writes the newest one if it has none, so a
run's last version is always on disk. A generator that cannot map or check such a version has
no directory to read: it refuses it by name (a Nack) and serves what it has.

Adapters (learner.lora.publish=adapters, device first; protocol 1.12): a version whose snapshot
carries its adapter set (``DeviceSnapshot.adapter``: the factors and the tensors trained in
full, megabytes) puts that set in its slot. The base (every other stored tensor, each adapted
weight as before training) is packed once per publisher into a buffer of its own, one frozen
weight at a time, from the first version's whole set, and never refilled. The version is named
by the device digest of the merged set as a generator builds it from the two
(weights.adapter_merge, each merged weight streamed through the lanes and let go: no copy of
the set on the learner); that it is the learner's own merged set is the learner's contract
(tests/learner/test_lora.py: the publication is base + (alpha/r) B A exactly), which replay
checks against digests.jsonl. The announce's ``cuda_ipc.holds`` is "adapter" and its
``adapter`` field carries the adapter blob's digest and layout and the base buffer's digest and
IPC fields. A receiver copies the adapter set out of its slot and checks it, checks the mapped
base against its digest (once per buffer), merges the two into a buffer of its own and serves
the merge only when its device digest is the version's; anything else is refused by name. No
directory is written beside training for such a version (an adapter set is not the set);
``close`` writes the newest one's merged set (merged on the card from the base and its slot).

Invariants: training never waits for a reader (the slot of version v is refilled by version
v + slots without asking who reads it); a reader never serves a half-written set (its copy is
checked after it is made, never the shared buffer before); ``slots`` is at least
publish.max_pending + 1, so no version still being finished shares a slot with the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from models.checkpoint import save_checkpoint
from models.errors import ConfigError
from proto.records import Nack, WeightAnnounce
from weights.adapter_merge import merged_pieces, write_merged
from weights.check import WeightsRefused
from weights.device_digest import KIND, Lanes, device_digest, lanes_digest, padded_size
from weights.digest import DEFAULT_CHUNK_BYTES, TREE, blob_layout, weights_digest, with_sha256
from weights.publication import MANIFEST_NAME, DeviceAdapter, DeviceSnapshot, Publication
from weights.publisher import RETRY_DELAY_S, LearnerSide, PublishSettings, WeightPublisher
from weights.receiver import GeneratorSide, Receiver
from weights.verified import VerifiedWeights

log = logging.getLogger(__name__)
CORRUPT_ENV = "LOOPRL_CORRUPT_IPC"
"""A test hook: ``<version>`` flips one byte of that version's slot after its digest."""

__all__ = ["CORRUPT_ENV", "CudaIpcPublisher", "CudaIpcReceiver", "DirectoryWriter", "card_uuid", "card_visible",
           "cuda_ipc_publisher", "pack", "unpack"]  # fmt: skip


def card_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA card (the same string in every process that sees it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


_VISIBLE: list[set[str]] = []


def card_visible(uuid: str) -> bool:
    """Whether this process sees the CUDA card ``uuid`` (``card_uuid``'s string)."""
    if not _VISIBLE:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _VISIBLE.append({card_uuid(i) for i in range(n)})
    return bool(uuid) and uuid in _VISIBLE[0]


def pack(state: Mapping[str, torch.Tensor], buf: torch.Tensor) -> int:
    """``state``'s tensors copied into the flat uint8 ``buf`` in the canonical blob layout
    (sorted names, each tensor's bytes in C order, no gaps: weights.digest), the bytes after
    the blob up to a whole word zeroed; returns the blob's size."""
    off = 0
    for name in sorted(state):
        t = state[name].detach()
        n = t.numel() * t.element_size()
        if n:  # as bytes: a tensor's offset need not be a multiple of its element size
            buf[off : off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        off += n
    buf[off : padded_size(off)].zero_()
    return off


def unpack(buf: torch.Tensor, tensors: list[Any]) -> dict[str, torch.Tensor]:
    """{name: view of ``buf``} as the announce's tensor metadata lays the blob out."""
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        dtype = getattr(torch, t.dtype)
        if not t.nbytes:
            out[t.name] = torch.empty(list(t.shape), dtype=dtype, device=buf.device)
            continue
        piece = buf[t.offset : t.offset + t.nbytes]
        if t.offset % dtype.itemsize:  # not aligned for a view: a copy of its own
            piece = piece.clone()
        out[t.name] = piece.view(dtype).view(list(t.shape))
    return out


class CudaIpcPublisher(WeightPublisher):
    """publish.transport=cuda_ipc, learner side (module docstring)."""

    def __init__(
        self, endpoint: LearnerSide, *, slots: int = 2, device_first: bool = False, **kw: Any
    ) -> None:
        """``slots``: device buffers, round robin (>= publish.max_pending + 1);
        ``device_first``: publish.directories=when_free (module docstring)."""
        if slots < 2:
            raise ValueError(f"slots: expected >= 2, got {slots}")
        super().__init__(endpoint, chunked=False, **kw)
        self.slots, self.device_first = slots, device_first
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._shared: list[dict[str, Any] | None] = [None] * slots
        self._locks = [threading.Lock() for _ in range(slots)]  # a slot read by the writer
        self._next = 0
        self._ready: dict[int, dict[str, Any]] = {}  # version -> the announce's cuda_ipc field
        self._held: dict[int, tuple[int, Publication, Path | None]] = {}  # slot -> its version
        self._base: _Base | None = None  # the adapters' base (adapter versions)
        self.writer = DirectoryWriter(self)

    def _slot(self, size: int, dev: torch.device) -> tuple[int, torch.Tensor, float]:
        """The next slot, a buffer of ``size`` bytes on ``dev`` in it, its lock held (the
        seconds waited for the writer to let go of it): the caller releases it."""
        i = self._next
        self._next = (i + 1) % self.slots
        t0 = time.perf_counter()
        self._locks[i].acquire()
        waited = time.perf_counter() - t0
        buf = self._bufs[i]
        if buf is None or buf.numel() != size or buf.device != dev:
            self._bufs[i] = self._shared[i] = None  # (the old one freed first)
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, device=dev)
        return i, buf, waited

    def _corrupt(self, version: int, i: int, buf: torch.Tensor) -> None:
        if os.environ.get(CORRUPT_ENV, "") == str(version):
            buf[0:1].bitwise_xor_(0xFF)
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            log.warning("%s=%d: flipped byte 0 of slot %d", CORRUPT_ENV, version, i)

    def prepare_device(self, snap: DeviceSnapshot) -> Publication:
        """publish.directories=when_free: ``snap`` packed into the next slot and digested there,
        its copy let go, and the version as ``Publication.on_device`` (named by that digest;
        stages ``device_pack``, ``device_digest``, ``slot_wait``), its directory offered to
        the writer once announced (``publish``). The coordinator calls it on the trainer thread
        right after the snapshot (pipeline.core.announcing): a few milliseconds of the card's
        bandwidth, and the snapshot's copy is freed before the next step allocates, so the
        learner holds ``slots`` copies of the weights beside training, not ``slots`` + 1."""
        state = snap.state
        if not state:
            raise ValueError(f"weights v{snap.version}: the device snapshot holds no tensors")
        if snap.adapter is not None:
            pub = self._prepare_adapter(snap, snap.adapter)
            assert self._base is not None  # (packed by the first adapter version)
            return _released(pub, self._base.nbytes)  # a generator merges into a set's size
        layout = blob_layout(state)
        nbytes = sum(int(t["nbytes"]) for t in layout)
        i, digest, stages = self._fill(snap.version, state, nbytes, layout, snap.ready)
        state.clear()  # the snapshot's copy is not needed any more
        pub = Publication.on_device(snap.version, digest, layout, tied=snap.tied,
                                    config_json=snap.config_json)  # fmt: skip
        pub.stage_s.update(stages)
        self._held[i] = (snap.version, pub, snap.path)
        return _released(pub, nbytes)

    def _prepare_adapter(self, snap: DeviceSnapshot, ad: DeviceAdapter) -> Publication:
        """An adapter version (module docstring, "Adapters"): the base packed once (from the
        whole set: ``ad.whole()``, or the snapshot's state), the adapter set packed into the
        next slot and digested, and the version named by the device digest of the merged set
        as a generator builds it from the two (weights.adapter_merge, streamed through the
        lanes one weight at a time: no copy of the set). Stages ``base_pack`` (once),
        ``device_pack`` and ``adapter_digest`` (the adapter set's), ``device_digest`` (the
        merged set's), ``slot_wait``."""
        version, state = snap.version, snap.state
        t0 = time.perf_counter()
        if self._base is None:
            given = [*state.values(), *(t for ab in ad.factors.values() for t in ab)]
            if not given:
                raise ValueError(f"weights v{version}: the device snapshot holds no tensors")
            dev = given[0].device
            with _on(dev), _side(dev, snap.ready):  # the export too, after the snapshot's copies
                whole, tied = ad.whole() if ad.whole is not None else (state, snap.tied)
                self._base = _Base(*self._pack_base(whole, ad), blob_layout(whole), dict(tied))
            del whole
        base = self._base
        t1 = time.perf_counter()
        missing = [n for n in ad.full if n not in state]
        if missing:
            raise ValueError(f"weights v{version}: tensors trained in full {missing} not given")
        adapter = {f"{m}.{k}": t for m, (a, b) in ad.factors.items()
                   for k, t in (("lora_A", a), ("lora_B", b))}  # fmt: skip
        adapter.update({n: state[n] for n in ad.full})
        ad_layout = blob_layout(adapter)
        nbytes = sum(int(t["nbytes"]) for t in ad_layout)
        i, ad_digest, stages = self._fill(version, adapter, nbytes, ad_layout, snap.ready)
        field: dict[str, Any] = {
            "digest": ad_digest, "digest_kind": KIND, "digest_chunk_bytes": 0, "bytes": nbytes,
            "layout": json.dumps(ad_layout, separators=(",", ":")), "base_digest": base.digest,
            "base_bytes": base.nbytes, "targets": ",".join(sorted(ad.factors)),
            "scale": float(ad.scale), **{f"base_{k}": v for k, v in base.field.items()
                                         if k in _BASE_KEYS},
        }  # fmt: skip
        t2 = time.perf_counter()
        slot = self._bufs[i]
        assert slot is not None
        with _on(slot.device), _side(slot.device, None):  # after the slot's pack (same stream)
            # the merged set a generator builds from the slot's bytes and the base's
            digest = _merged_digest(field, base.layout, base.buf, slot)
        t3 = time.perf_counter()
        state.clear()
        # the slot holds the adapter set; the version is named by the merged set's digest
        self._ready[version].update(digest=digest, holds="adapter")
        pub = Publication.on_device(version, digest, base.layout, tied=base.tied,
                                    config_json=snap.config_json)  # fmt: skip
        pub = dataclasses.replace(pub, adapter=field)
        pub.stage_s.update(stages)
        pub.stage_s.update(adapter_digest=stages["device_digest"], device_digest=t3 - t2,
                           base_pack=t1 - t0)  # fmt: skip
        self._held[i] = (version, pub, snap.path)
        self.counts["adapter_versions"] += 1
        return pub

    def _pack_base(
        self, state: Mapping[str, torch.Tensor], ad: DeviceAdapter
    ) -> tuple[torch.Tensor, dict[str, Any], str, int]:
        """The base set (every stored tensor of the whole set ``state`` but those trained in
        full, each adapted weight as before training) packed into a buffer of its own, one
        frozen weight at a time, and digested: (buffer, its IPC fields, digest, bytes). Never
        refilled: a generator maps it once, a late one too."""
        full = set(ad.full)
        base = {n: t for n, t in state.items() if n not in full}  # the layout: W as W' is
        adapted = {f"{m}.weight": m for m in ad.factors}
        strays = sorted(set(adapted) - set(base))
        if strays:
            raise ValueError(f"adapted weights {strays} are not stored tensors of the set")
        layout = blob_layout(base)
        nbytes = sum(int(t["nbytes"]) for t in layout)
        dev = next(iter(base.values())).device
        buf = torch.empty(padded_size(nbytes), dtype=torch.uint8, device=dev)
        buf[nbytes:].zero_()
        for meta in layout:  # one frozen weight at a time: no second copy of the set
            name, n, off = meta["name"], int(meta["nbytes"]), int(meta["offset"])
            t = ad.frozen(adapted[name]) if name in adapted else base[name]
            if (t.dtype, t.shape) != (base[name].dtype, base[name].shape):
                # a merge of W in another dtype would not give the published bits
                raise ValueError(f"adapted weight {name}: the base weight is {t.dtype} "
                                 f"{tuple(t.shape)}, the published {base[name].dtype} "
                                 f"{tuple(base[name].shape)}")  # fmt: skip
            if n:
                buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            del t
        digest = device_digest(buf, nbytes, layout)
        self.counts["base_packed"] += 1
        log.info("weights: the adapters' base packed on the device once (%d bytes, %s)", nbytes,
                 digest[:16])  # fmt: skip
        return buf, _share(buf), digest, nbytes

    def merged_blob(self, slot: int, version: int) -> torch.Tensor | None:
        """The merged set of adapter ``version`` in ``slot`` as a new device blob (the base and
        the adapter set merged as a generator merges them): the run's last version's directory
        (``DirectoryWriter.close``); None when the slot holds another version."""
        with self._locks[slot]:
            held, buf = self._held.get(slot), self._bufs[slot]
            if held is None or held[0] != version or buf is None or self._base is None:
                return None
            pub = held[1]
            with _on(buf.device):
                out = torch.zeros(padded_size(pub.nbytes), dtype=torch.uint8, device=buf.device)
                write_merged(
                    out, pub.tensors, *_adapter_sets(pub.adapter, pub.tensors, self._base.buf, buf)
                )
            return out

    def _fill(
        self, version: int, state: Mapping[str, torch.Tensor], nbytes: int, meta: list[Any],
        ready: Any = None,
    ) -> tuple[int, str, dict[str, float]]:  # fmt: skip
        """``state`` packed into the next slot (on the publisher's stream, after ``ready``)
        and its device digest computed there; the announce's cuda_ipc field kept for
        ``publish``. Returns (slot, digest, stages: device_pack, device_digest, slot_wait)."""
        dev = next(iter(state.values())).device
        with _on(dev), _side(dev, ready):  # not behind the next step's kernels
            i, buf, waited = self._slot(padded_size(nbytes), dev)
            try:
                self._held.pop(i, None)
                t0 = time.perf_counter()
                n = pack(state, buf)
                if n != nbytes:
                    raise ValueError(f"v{version}: {n} bytes on the device, {nbytes} in the blob")
                t1 = time.perf_counter()
                digest = device_digest(buf, n, meta)  # synchronises: the bytes are there
                t2 = time.perf_counter()
                self._corrupt(version, i, buf)
                shared = self._shared[i] = self._shared[i] or _share(buf)
            finally:
                self._locks[i].release()
        self._ready[version] = {**shared, "slot": i, "digest": digest, "digest_kind": KIND}
        return i, digest, {"device_pack": t1 - t0, "device_digest": t2 - t1, "slot_wait": waited}

    def held(self, slot: int) -> tuple[int, Publication, Path | None] | None:
        """What ``slot`` holds of a device-first version: (version, its publication, where its
        directory goes), or None."""
        return self._held.get(slot)

    def slot_of(self, version: int) -> int | None:
        """The slot that holds device-first ``version``, or None."""
        return next((i for i, h in list(self._held.items()) if h[0] == version), None)

    def copy_out(self, slot: int, version: int, host: torch.Tensor) -> bool:
        """The first bytes of ``slot`` (``version``'s blob) copied into ``host`` under the
        slot's lock, on a stream of the writer's own; False when the slot holds another
        version by now (nothing copied)."""
        with self._locks[slot]:
            held, buf = self._held.get(slot), self._bufs[slot]
            if held is None or held[0] != version or buf is None:
                return False
            n = held[1].nbytes
            with _on(buf.device), _side(buf.device, None, "writer"):
                host[:n].copy_(buf[:n])  # synchronous: pageable or pinned, the bytes are here
            return True

    @property
    def on_cuda(self) -> bool:
        """Whether its buffers are on a CUDA card (the writer then pins its host buffer)."""
        return any(b is not None and b.is_cuda for b in self._bufs)

    def prepare(self, pub: Publication) -> Publication:
        """``pub``'s device tensors packed into the next slot and its device digest computed
        there (``pub.stage_s["device_pack"]``, ``["device_digest"]``); a publication without
        them (a CPU trainer) is announced as shared_fs."""
        state = pub.device_state
        if not state:
            self.counts["no_device_state"] += 1
            if self.counts["no_device_state"] == 1:
                log.warning("cuda_ipc: weights v%d came with no device tensors (a trainer on "
                            "the CPU, or backend reference): announced as shared_fs (the "
                            "generators read the directory)", pub.version)  # fmt: skip
            return pub
        _, _, stages = self._fill(pub.version, state, len(pub.blob), pub.tensors)
        pub.stage_s.update(stages)
        pub.device_state.clear()  # the snapshot's copy is not needed any more
        return pub

    def publish(self, pub: Publication) -> WeightAnnounce:
        """Announce ``pub``'s directory, with the ``cuda_ipc`` field when it was packed; a
        version on the device only (``prepare_device``) without a directory, its directory
        then offered to the writer."""
        field = self._ready.pop(pub.version, None)
        if pub.on_device_only:
            if field is None:
                raise WeightsRefused(f"weights v{pub.version}: on the device only, not packed")
            self.publish_announce(ann := pub.announce(0, created_at=time.time(), cuda_ipc=field))
            if not pub.adapter:  # an adapter version's directory: the run's last only (close)
                self.writer.offer(int(field["slot"]))
            return ann
        ann = super().publish(pub)
        if field is not None:
            ann = dataclasses.replace(ann, cuda_ipc=field)
            ann.validate()
            self.announce = ann
        return ann

    def close(self) -> None:
        """Write the newest version's directory if it has none (the run's last version is
        always on disk), then free the buffers (a generator that maps one keeps the
        allocation alive until it lets go: torch's reference counter of shared CUDA
        storages)."""
        try:
            self.writer.close(newest=self.version)
        finally:
            super().close()
            self._bufs = [None] * self.slots
            self._shared = [None] * self.slots
            self._base = None


class DirectoryWriter:
    """publish.directories=when_free: the directories of device-only versions, one at a time,
    on a thread of their own (module docstring). ``written``: the versions it wrote;
    ``counts``: ``written``, ``skipped`` (came while busy), ``failed``."""

    def __init__(self, pub: CudaIpcPublisher) -> None:
        self.pub = pub
        self.busy = False
        self.written: list[int] = []
        self.counts: Counter[str] = Counter()
        self._host: torch.Tensor | None = None  # the pinned buffer, reused
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-dir")
        self._lock = threading.Lock()

    def offer(self, slot: int) -> bool:
        """Write the directory of the version in ``slot`` if free (the slot locked while its
        bytes are copied out); False: busy, skipped."""
        held = self.pub.held(slot)
        if held is None or held[2] is None:
            return False
        with self._lock:
            if self.busy:
                self.counts["skipped"] += 1
                return False
            self.busy = True
        self._pool.submit(self._write, slot, *held)
        return True

    def _write(self, slot: int, version: int, pub: Publication, path: Path | None) -> None:
        try:
            self.write(slot, version, pub, path)
        except Exception as e:  # noqa: BLE001 - a directory is a copy: the run goes on
            self.counts["failed"] += 1
            log.warning("weights v%d: its directory %s was not written: %s: %s", version, path,
                        type(e).__name__, e)  # fmt: skip
        finally:
            with self._lock:
                self.busy = False

    def write(self, slot: int, version: int, pub: Publication, path: Path | None) -> None:
        """``pub``'s directory at ``path`` from the bytes in ``slot`` (which must still hold
        ``version``): copied to the host under the slot's lock, then hashed and written."""
        if path is None:
            return
        t0 = time.perf_counter()
        n = pub.nbytes
        host = self._host  # allocated (pinned: seconds for gigabytes) before taking the lock
        if host is None or host.numel() < n:
            self._host = None
            host = self._host = torch.empty(
                max(n, 1), dtype=torch.uint8, pin_memory=self.pub.on_cuda
            )
        if not self._copy(slot, version, pub, host):
            self.counts["gone"] += 1
            return
        t1 = time.perf_counter()
        blob = memoryview(host[:n].numpy().data).toreadonly() if n else memoryview(b"")
        tensors = with_sha256(blob, pub.tensors)
        d = weights_digest(blob, tensors, TREE, DEFAULT_CHUNK_BYTES)
        t2 = time.perf_counter()
        written = Publication(version, d.hex, path, blob, tensors, dict(pub.tied),
                              pub.config_json, d.kind, d.chunk_bytes, d.chunks)  # fmt: skip
        meta = {t["name"]: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="meta")
                for t in tensors}  # fmt: skip
        save_checkpoint(meta, json.loads(pub.config_json or "{}"), path, tied=pub.tied,
                        extra_files={MANIFEST_NAME: written.manifest()},
                        blob=(blob, tensors))  # fmt: skip
        self.written.append(version)
        self.counts["written"] += 1
        log.info("weights v%d: directory %s written beside training (copy %.3f s, digest %.3f "
                 "s, write %.3f s)", version, path, t1 - t0, t2 - t1,
                 time.perf_counter() - t2)  # fmt: skip

    def _copy(self, slot: int, version: int, pub: Publication, host: torch.Tensor) -> bool:
        """``version``'s blob into ``host``: the slot's bytes, or for an adapter version the
        merged set built on the device from the base and the slot's adapter set."""
        if not pub.adapter:
            return self.pub.copy_out(slot, version, host)
        merged = self.pub.merged_blob(slot, version)
        if merged is None:
            return False
        with _on(merged.device):
            host[: pub.nbytes].copy_(merged[: pub.nbytes])
        return True

    def close(self, newest: int) -> None:
        """Wait for the write in progress; then the ``newest`` version's directory if none
        was written (still in its slot: nothing refills it)."""
        self._pool.shutdown(wait=True)
        if newest < 0 or newest in self.written:
            return
        slot = self.pub.slot_of(newest)
        held = None if slot is None else self.pub.held(slot)
        if slot is not None and held is not None:
            _, pub, path = held
            if path is not None and not (path / MANIFEST_NAME).is_file():
                try:
                    self.write(slot, newest, pub, path)
                except Exception as e:  # noqa: BLE001
                    self.counts["failed"] += 1
                    log.warning("weights v%d: its directory %s was not written at the end: "
                                "%s: %s", newest, path, type(e).__name__, e)  # fmt: skip


_BASE_KEYS = ("handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")
"""The base buffer's IPC fields an adapter version's announce carries (``base_<key>``)."""


def _objs(layout: list[dict[str, Any]]) -> list[Any]:
    return [SimpleNamespace(**t) for t in layout]


def _base_layout(c: Mapping[str, Any], tensors: Sequence[Any]) -> list[dict[str, Any]]:
    """The base set's layout of an adapter version (its ``adapter`` field ``c``, the merged
    layout ``tensors``): the merged one less the tensors trained in full, offsets anew."""
    ad_layout = json.loads(str(c["layout"]))
    full = {t["name"] for t in ad_layout if not t["name"].endswith((".lora_A", ".lora_B"))}
    out, off = [], 0
    for t in tensors:
        meta = dict(t) if isinstance(t, Mapping) else dataclasses.asdict(t)
        if meta["name"] in full:
            continue
        out.append({**meta, "offset": off})
        off += int(meta["nbytes"])
    return out


def _adapter_sets(
    c: Mapping[str, Any], tensors: Sequence[Any], base_buf: torch.Tensor, ad_buf: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str], float]:
    """(base, adapter set, targets, scale) of an adapter version, as views of the base's
    buffer and of the adapter set's (``_base_layout``; the set's own layout in ``c``)."""
    base_layout = _base_layout(c, tensors)
    end = sum(int(t["nbytes"]) for t in base_layout)
    if end > base_buf.numel():
        raise WeightsRefused(f"wrong base: the set needs a base of {end} bytes, the base holds "
                             f"{base_buf.numel()}")  # fmt: skip
    targets = [m for m in str(c["targets"]).split(",") if m]
    adapter = unpack(ad_buf, _objs(json.loads(str(c["layout"]))))
    return unpack(base_buf, _objs(base_layout)), adapter, targets, float(c["scale"])


@dataclasses.dataclass
class _Base:
    """The adapters' base on the learner's card (``CudaIpcPublisher._pack_base``) and the
    whole set's layout and ties (every adapter version's merged set has them)."""

    buf: torch.Tensor
    field: dict[str, Any]
    digest: str
    nbytes: int
    layout: list[dict[str, Any]]
    tied: dict[str, str]


def _merged_digest(
    c: Mapping[str, Any], layout: list[dict[str, Any]], base_buf: torch.Tensor,
    ad_buf: torch.Tensor,
) -> str:  # fmt: skip
    """The device digest of the merged set an adapter version's receiver builds (its field
    ``c``, the merged ``layout``, the base's and the adapter set's buffers), each merged
    weight fed to the lanes and let go in turn (weights.adapter_merge.merged_pieces)."""
    lanes = Lanes()
    for _, t in merged_pieces(*_adapter_sets(c, layout, base_buf, ad_buf)):
        lanes.feed(t)
    return lanes_digest(lanes.nbytes, layout, *lanes.total())


READER_MARGIN = 2 << 30
"""Bytes beyond a version's own that a generator's copy of it may need on the card (the merge's
fp64 temporary of the largest weight: 1.41 GiB at Huginn-0125), for ``_released``."""


def _released(pub: Publication, nbytes: int) -> Publication:
    """``pub`` after the learner's CUDA cache is handed back to the card (stage
    ``cache_release``) when the card has less free than a generator's copy of the version
    needs (``nbytes`` + READER_MARGIN): the snapshot's copy and the merge's temporaries, freed
    just now, stay reserved by this process otherwise, where a generator beside it on the card
    allocates its copy of the version (an H100 run of Huginn-0125 with adapters: the
    generator's 6.6 GiB refused at 6.2 GiB free, the learner holding 59 GiB). Only then: a
    release every version costs the next step its allocations afresh (cudaMalloc, a device-wide
    sync in cudaFree) and, with the generator a thread of this process
    (generators.placement=thread), empties the cache its allocations share and holds the
    allocator's lock while the card drains."""
    if torch.cuda.is_available():
        t0 = time.perf_counter()
        free, _ = torch.cuda.mem_get_info()
        if free < nbytes + READER_MARGIN:
            torch.cuda.empty_cache()
            pub.stage_s["cache_release"] = time.perf_counter() - t0
    return pub


def _copied(src: torch.Tensor, nbytes: int, meta: Sequence[Any]) -> tuple[torch.Tensor, str]:
    """A mapped buffer's first ``nbytes`` (a blob laid out as ``meta``) copied into a buffer of
    this process's own, and the copy's device digest: a receiver checks the copy, never the
    shared buffer the learner may refill."""
    size = padded_size(nbytes)
    if src.numel() < size:
        raise ValueError(f"the mapped buffer holds {src.numel()} bytes, {size} announced")
    # on a stream of the reader's own: not queued behind the engine's decode on the stream the
    # caller's thread has current (the process's default stream, in a generator process)
    with _on(src.device), _side(src.device, None, "reader"):
        mine = torch.empty(size, dtype=torch.uint8, device=src.device)
        mine.copy_(src[:size])
        return mine, device_digest(mine, nbytes, meta)


def _on(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``dev`` current for the block (a CUDA device; nothing for the CPU: tests)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


_SIDE: dict[tuple[torch.device, str], Any] = {}


def _side(
    dev: torch.device, ready: Any, name: str = "pack"
) -> contextlib.AbstractContextManager[Any]:
    """A stream of this process's own on ``dev`` (CUDA; one per ``name``), current for the
    block, that waits for ``ready`` (the snapshot's copies) first: the publisher's pack, digest
    and writer's copy run beside the trainer's stream, not queued behind the kernels of the
    step it already launched; a reader's copy and digest (``_copied``) beside the engine's
    decode. A tensor made on it and used on another stream is recorded there by its user
    (generator.torch_engine.weights: ``record_stream`` when served)."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    side = _SIDE.get((dev, name))
    if side is None:
        side = _SIDE[(dev, name)] = torch.cuda.Stream(dev)
    if ready is not None:
        side.wait_event(ready)
    return torch.cuda.stream(side)


_OWN: weakref.WeakValueDictionary[tuple[str, int], torch.Tensor] = weakref.WeakValueDictionary()
"""This process's shared buffers by (handle, offset): a receiver in the same process (a
generator thread of the learner's: generators.placement=thread) takes the buffer itself, as
CUDA does not map a handle in the process that made it."""


def _share(buf: torch.Tensor) -> dict[str, Any]:
    """The IPC fields of ``buf``'s storage (torch's ``_share_cuda_``), hex for the wire."""
    dev, handle, size, offset, ref_handle, ref_offset, event, sync = (
        buf.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    )
    _OWN[(bytes(handle).hex(), int(offset))] = buf
    return {"device_uuid": card_uuid(buf.device), "handle": bytes(handle).hex(), "size": int(size),
            "offset": int(offset), "ref_handle": bytes(ref_handle).hex(),
            "ref_offset": int(ref_offset), "pid": os.getpid(),
            "event": bytes(event or b"").hex(), "event_sync": bool(sync)}  # fmt: skip


def cuda_ipc_publisher(
    endpoint: LearnerSide, settings: PublishSettings, run_dir: Path
) -> CudaIpcPublisher:
    """publish.transport=cuda_ipc: shared_fs's announce, the blob in a device buffer beside it."""
    if not torch.cuda.is_available():
        raise ConfigError("publish.transport=cuda_ipc: this learner sees no CUDA device; "
                          "expected shm or shared_fs on a CPU host")  # fmt: skip
    slots = max(2, settings.max_pending + 1)
    first = getattr(settings, "directories", "every") == "when_free"
    return CudaIpcPublisher(endpoint, slots=slots, chunk_bytes=settings.chunk_bytes,
                            window=settings.window, device_first=first,
                            retry_delay_s=RETRY_DELAY_S)  # fmt: skip


class CudaIpcReceiver:
    """Generator side of cuda_ipc (module docstring); every other record goes to ``fallback``."""

    def __init__(
        self, conn: GeneratorSide, fallback: Receiver, generator_id: str, *,
        serving_version: int = -1, max_total_bytes: int = 1 << 40,
    ) -> None:  # fmt: skip
        self.conn, self.fallback, self.generator_id = conn, fallback, generator_id
        self.serving, self.max_total_bytes = serving_version, max_total_bytes
        self._maps: dict[tuple[int, str, int], torch.Tensor] = {}  # (pid, handle, offset) ->
        self._cards: dict[str, int] | None = None
        self._base_ok: dict[tuple[int, str, int], str] = {}  # a mapped base buffer -> its digest
        self.counts: Counter[str] = Counter()
        self.copy_s = 0.0
        """Seconds of the newest version's copy and check (map, copy, digest)."""

    def handle(self, rec: Any) -> VerifiedWeights | None:
        """One record of the weights channel; a checked set to load, or None."""
        if not isinstance(rec, WeightAnnounce) or not rec.cuda_ipc:
            return self.fallback.handle(rec)
        plain = dataclasses.replace(rec, cuda_ipc={})
        if rec.version <= self.serving or rec.total_bytes > self.max_total_bytes:
            return self.fallback.handle(plain)  # acknowledged again, or refused, there
        try:
            got = self._receive_adapter(rec) if rec.cuda_ipc.get("holds") == "adapter" else (
                self._receive(rec))  # fmt: skip
        except WeightsRefused as e:  # an adapter set that does not fit its base: by name
            self.counts["refused"] += 1
            self._refuse(rec, str(e))
            return None
        except (RuntimeError, ValueError, OSError, KeyError) as e:
            self.counts["unmapped"] += 1
            if not rec.path:
                self._refuse(rec, f"the learner's device buffer cannot be mapped here "
                                  f"({type(e).__name__}: {e})")  # fmt: skip
                return None
            if self.counts["unmapped"] == 1:
                log.warning("weights v%d: the learner's device buffer cannot be mapped here "
                            "(%s: %s); reading the directory (and every later one)",
                            rec.version, type(e).__name__, e)  # fmt: skip
            return self.fallback.handle(plain)
        if got is None:
            if not rec.path:
                self._refuse(rec, "the copy of the learner's device buffer does not match "
                                  "its device digest (torn or corrupted)")  # fmt: skip
                return None
            return self.fallback.handle(plain)
        return got

    def _refuse(self, rec: WeightAnnounce, why: str) -> None:
        """A version on the device only that cannot be taken here: refused by name (a Nack),
        the version served kept (there is no directory to read instead)."""
        self.counts["refused_device_only"] += 1
        reason = (f"weights v{rec.version} lives on the learner's GPU only (publish.directories="
                  f"when_free) and {why}; generators that cannot map it need "
                  "publish.directories=every or another publish.transport")  # fmt: skip
        log.error("%s", reason)
        self.conn.send(Nack("weights", str(rec.version), reason[:2000], rec.version),
                       channel="weights")  # fmt: skip

    def loaded(self, version: int) -> None:
        self.serving = max(self.serving, version)
        self.fallback.loaded(version)

    def load_failed(self, version: int, reason: str) -> None:
        self.fallback.load_failed(version, reason)

    def _card(self, uuid: str) -> int:
        if self._cards is None:
            self._cards = {card_uuid(i): i for i in range(torch.cuda.device_count())}
        if uuid not in self._cards:
            raise ValueError(f"card {uuid} is not visible to this process")
        return self._cards[uuid]

    def _map(self, c: Mapping[str, Any], index: int) -> torch.Tensor:
        # one allocation may hold several buffers (torch's caching allocator): the offset too
        key = (int(c["pid"]), str(c["handle"]), int(c["offset"]))
        if key[0] == os.getpid():  # a buffer of this very process (module docstring)
            own = _OWN.get(key[1:])
            if own is None or own.device.index != index:
                raise ValueError("a buffer of this process that it no longer holds")
            return own
        if key not in self._maps:
            storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                index, bytes.fromhex(str(c["handle"])), int(c["size"]), int(c["offset"]),
                bytes.fromhex(str(c["ref_handle"])), int(c["ref_offset"]),
                bytes.fromhex(str(c.get("event", ""))) or None, bool(c.get("event_sync", False)),
            )  # fmt: skip
            t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
            t.set_(storage)
            self._maps[key] = t
        return self._maps[key]

    def _receive(self, a: WeightAnnounce) -> VerifiedWeights | None:
        """The announced slot copied and checked (module docstring); None when the copy's
        digest differs (refused, counted, logged: the caller reads the directory)."""
        c = a.cuda_ipc
        t0 = time.perf_counter()
        index = self._card(str(c["device_uuid"]))
        mine, got = _copied(self._map(c, index), a.total_bytes, a.tensors)
        self.copy_s = time.perf_counter() - t0
        if got != c["digest"]:
            self.counts["refused"] += 1
            log.error("weights v%d: the copy of the learner's device buffer (slot %s) has device "
                      "digest %s, %s announced (torn by a newer version or corrupted): refused; "
                      "reading the directory %s", a.version, c.get("slot"), got, c["digest"],
                      a.path)  # fmt: skip
            return None
        self.counts["verified"] += 1
        return VerifiedWeights.of_checked(a, unpack(mine, list(a.tensors)))

    def _receive_adapter(self, a: WeightAnnounce) -> VerifiedWeights | None:
        """An adapter version (module docstring, "Adapters"): the adapter set copied out of
        its slot and checked; the base's buffer mapped (once) and checked against the
        announced base digest (once per buffer); the merged set written into a buffer of
        this generator's own and its device digest compared with the version's. None when a
        copy or the merge does not match (refused, counted, logged); WeightsRefused naming a
        base or an adapter set that does not fit."""
        c, ad = a.cuda_ipc, a.adapter
        t0 = time.perf_counter()
        index = self._card(str(c["device_uuid"]))
        mine_ad, got = _copied(self._map(c, index), int(str(ad["bytes"])),
                               json.loads(str(ad["layout"])))  # fmt: skip
        base_c: dict[str, Any] = {"pid": c["pid"]}
        base_c.update({k: ad[f"base_{k}"] for k in _BASE_KEYS if f"base_{k}" in ad})
        base = self._map(base_c, index)
        with _on(base.device):
            if got != ad["digest"]:
                self.counts["refused"] += 1
                log.error("weights v%d: the copy of the adapter set (slot %s) has device digest "
                          "%s, %s announced (torn by a newer version or corrupted): refused",
                          a.version, c.get("slot"), got, ad["digest"])  # fmt: skip
                return None
            key = (int(base_c["pid"]), str(base_c["handle"]), int(base_c["offset"]))
            if self._base_ok.get(key) != ad["base_digest"]:
                layout = _base_layout(ad, a.tensors)
                nb = sum(int(t["nbytes"]) for t in layout)
                held = device_digest(base, nb, layout) if base.numel() >= padded_size(nb) else ""
                if held != ad["base_digest"]:
                    raise WeightsRefused(
                        f"wrong base: the adapter set applies to base {str(ad['base_digest'])[:16]}, "
                        f"the learner's base buffer holds {held[:16] or 'fewer bytes'}"
                    )
                self._base_ok[key] = str(ad["base_digest"])
            mine = torch.empty(padded_size(a.total_bytes), dtype=torch.uint8, device=base.device)
            mine[a.total_bytes :].zero_()
            write_merged(mine, a.tensors, *_adapter_sets(ad, a.tensors, base, mine_ad))
            got = device_digest(mine, a.total_bytes, a.tensors)
        self.copy_s = time.perf_counter() - t0
        if got != c["digest"]:
            self.counts["merge_mismatch"] += 1
            log.error("weights v%d: the adapter set merged onto its base has device digest %s, "
                      "%s announced (a merge that differs from the learner's in a bit): "
                      "refused", a.version, got, c["digest"])  # fmt: skip
            return None
        self.counts["verified"] += 1
        self.counts["adapter_merged"] += 1
        return VerifiedWeights.of_checked(a, unpack(mine, list(a.tensors)))
