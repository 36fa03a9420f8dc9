"""publish.directories=when_free (weights.cuda_ipc, device first): a version whose snapshot is
on the learner's card is announced once packed, named by its device digest (mix128) with no
directory and no host blob; its directory is written beside training when the writer is free
(a version that comes while one is written gets none), the run's last version always, and
what is written is the same set (its tree digest, its mix128 digest by the numpy spec); a
generator that cannot map or check a device-only version refuses it by name (a Nack) and keeps
what it serves; the announcer records the mix128 name in digests.jsonl before announcing it,
never building the host blob; the config resolves and refuses the key. The publisher's
'device' here is the CPU (the IPC call itself runs on CUDA in tests/weights/test_cuda_ipc.py)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import LearnerConfig, LoraConfig
from models.cost import Host
from models.errors import ConfigError
from pipeline.backends.results import SnapshotResult
from pipeline.config.outputs import PublishSection
from pipeline.config.run import load_config
from pipeline.config.sections import ModelSection
from pipeline.core.announcing import WeightAnnouncer
from pipeline.core.timeline import StepTimeline
from proto.codec import Codec
from proto.errors import ProtocolError
from proto.records import Nack
from tests.pipeline.test_device_defaults import H100, on
from tests.weights.test_cuda_ipc import _Below, _state
from tests.weights.test_transports import Sent
from weights import cuda_ipc
from weights import device_digest as dd
from weights.digest import blob_and_meta
from weights.pending import PublicationQueue, Snapshot
from weights.publication import (
    DeviceSnapshot,
    Publication,
    read_manifest,
    verify_publication,
    weights_dir,
)

CONFIG = json.dumps({"architectures": ["Test"], "hidden_size": 8})


def _snap(tmp_path: Path, v: int) -> DeviceSnapshot:
    return DeviceSnapshot(v, _state(v), {}, CONFIG, weights_dir(tmp_path, v))


def _pair(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[cuda_ipc.CudaIpcPublisher, cuda_ipc.CudaIpcReceiver, Sent]:
    """A device-first publisher and a receiver whose 'mapping' is the publisher's own slot."""
    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2, device_first=True)
    fields = {"device_uuid": "GPU-test", "handle": "01" * 8, "size": 0, "offset": 0,
              "ref_handle": "02", "ref_offset": 0, "pid": 1}  # fmt: skip
    monkeypatch.setattr(cuda_ipc, "_share", lambda buf: dict(fields))
    conn = Sent()
    rx = cuda_ipc.CudaIpcReceiver(conn, _Below(), "gen-0")
    monkeypatch.setattr(rx, "_card", lambda uuid: 0)
    monkeypatch.setattr(rx, "_map", lambda c, i: pub._bufs[int(c["slot"])])
    return pub, rx, conn


def _wait_idle(pub: cuda_ipc.CudaIpcPublisher) -> None:
    for _ in range(500):
        if not pub.writer.busy:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the directory writer never finished")


def test_a_version_is_announced_from_the_device_and_its_directory_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx, _ = _pair(monkeypatch)
    p1 = pub.prepare_device(_snap(tmp_path, 1))
    blob, meta = blob_and_meta(_state(1))
    want = dd.reference_digest(blob, meta)
    assert p1.on_device_only and p1.path is None and not len(p1.blob)
    assert (p1.digest, p1.digest_kind, p1.nbytes) == (want, "mix128", len(blob))
    assert {"device_pack", "device_digest", "slot_wait"} <= p1.stage_s.keys()
    ann = pub.publish(p1)
    assert ann.path == "" and ann.digest_kind == "mix128" and ann.digest == want
    assert ann.cuda_ipc["digest"] == want and ann.total_bytes == len(blob)
    assert Codec().decode(Codec().encode(ann)) == ann  # valid on the wire (protocol 1.11)
    got = rx.handle(ann)
    assert got is not None and got.version == 1
    for k, t in _state(1).items():
        assert torch.equal(got.state()[k], t), k
    _wait_idle(pub)  # the directory, written beside training from the slot's bytes
    path = weights_dir(tmp_path, 1)
    assert pub.writer.written == [1] and verify_publication(path)
    on_disk = Publication.from_dir(path, 1)
    assert read_manifest(path)["digest"] == on_disk.digest
    assert on_disk.digest == Publication.of_state(_state(1), 1, None).digest  # the same set
    assert on_disk.digest_as("mix128") == want  # what replay and a resume compare
    pub.close()


def test_a_version_that_comes_while_one_is_written_gets_none_and_the_last_always_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, _, _ = _pair(monkeypatch)
    gate, started = threading.Event(), threading.Event()
    real = cuda_ipc.save_checkpoint

    def slow(*a: Any, **kw: Any) -> Any:
        started.set()
        assert gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(cuda_ipc, "save_checkpoint", slow)
    pub.publish(pub.prepare_device(_snap(tmp_path, 1)))
    assert started.wait(30) and pub.writer.busy
    for v in (2, 3):  # v1 is being written: these get no directory now
        pub.publish(pub.prepare_device(_snap(tmp_path, v)))
    assert pub.writer.counts["skipped"] == 2
    gate.set()
    _wait_idle(pub)
    assert pub.writer.written == [1] and not weights_dir(tmp_path, 2).exists()
    pub.close()  # the newest (v3) written at the end
    assert pub.writer.written == [1, 3] and not weights_dir(tmp_path, 2).exists()
    assert Publication.from_dir(weights_dir(tmp_path, 3), 3).digest_as("mix128") == (
        dd.reference_digest(*blob_and_meta(_state(3)))
    )


def test_a_device_only_version_that_cannot_be_taken_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx, conn = _pair(monkeypatch)
    ann1 = pub.publish(pub.prepare_device(_snap(tmp_path, 1)))
    pub.publish(pub.prepare_device(_snap(tmp_path, 2)))
    pub.prepare_device(_snap(tmp_path, 3))  # slot 0 refilled: v1's announce reads v3's bytes
    assert rx.handle(dataclasses.replace(ann1, version=4)) is None
    nack = conn.sent[-1]
    assert isinstance(nack, Nack) and nack.kind == "weights" and nack.version == 4
    assert "device digest" in nack.reason and "publish.directories=every" in nack.reason
    assert rx.fallback.handed == [] and rx.counts["refused"] == 1  # nothing to read below

    def not_here(uuid: str) -> int:
        raise ValueError(f"card {uuid} is not visible to this process")

    monkeypatch.setattr(rx, "_card", not_here)
    assert rx.handle(dataclasses.replace(ann1, version=5)) is None
    assert "cannot be mapped here" in conn.sent[-1].reason and rx.fallback.handed == []
    pub.close()


def test_the_announce_names_a_device_only_version_consistently() -> None:
    blob, meta = blob_and_meta(_state(1))
    digest = dd.reference_digest(blob, meta)
    p = Publication.on_device(1, digest, [{k: v for k, v in m.items() if k != "sha256"}
                                          for m in meta])  # fmt: skip
    with pytest.raises(ProtocolError, match="needs the cuda_ipc field"):
        p.announce(0).validate()
    with pytest.raises(ValueError, match="on the device only"):
        p.announce(1 << 20)
    with pytest.raises(ValueError, match="on the device only, no host blob"):
        p.digest_as("mix128")
    host = Publication.of_state(_state(1), 1, None)
    assert host.digest_as("mix128") == digest  # the numpy spec over the host blob


class _DeviceTrainer:
    """A trainer whose snapshot is 'on the device': finish() must never run."""

    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult:
        def finish() -> Publication:
            raise AssertionError("the host blob was built for a device-first version")

        return SnapshotResult(finish, {"gather": 0.0},
                              DeviceSnapshot(version, _state(version), {}, CONFIG, out_dir))  # fmt: skip


def test_the_announcer_records_the_device_name_first_and_builds_no_host_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, _, _ = _pair(monkeypatch)
    status: list[int] = []
    a = WeightAnnouncer(
        load_config(None, ["publish.keep=0"]).publish, tmp_path, trainer=_DeviceTrainer(),  # type: ignore[arg-type]
        publisher=pub, pending=PublicationQueue(1), timeline=StepTimeline(),
        set_status=status.append,
    )  # fmt: skip
    for v in (1, 2):
        made = a.prepare(v, step=v)
        assert isinstance(made, Snapshot)
        a.hand_over(made)
        a.announce_ready(wait=True)
    lines = [
        json.loads(x) for x in (tmp_path / "weights" / "digests.jsonl").read_text().splitlines()
    ]
    want = [dd.reference_digest(*blob_and_meta(_state(v))) for v in (1, 2)]
    assert [(d["version"], d["digest"], d["digest_kind"]) for d in lines] == [
        (1, want[0], "mix128"), (2, want[1], "mix128")]  # fmt: skip
    assert status == [1, 2] and a.last_digest == want[1] and pub.announce is not None
    assert pub.announce.digest == want[1] and a.announced_bytes == pub.announce.total_bytes
    a.close()
    pub.close()
    assert (tmp_path / "weights" / "v2" / "manifest.json").is_file()  # the last, on disk


def test_the_key_resolves_for_the_transport_and_is_refused_where_it_cannot_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = on(Host(False), monkeypatch)
    assert cpu.publish.transport == "shared_fs" and cpu.publish.directories == "every"
    for bad, match in (
        (["publish.transport=shm", "publish.directories=when_free"], "needs publish.transport cuda_ipc"),
        (["publish.directories=sometimes"], "publish.directories"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            load_config(None, bad)
    gpu = on(H100, monkeypatch, model=ModelSection(size="1b"))
    assert gpu.publish.transport == "cuda_ipc" and gpu.publish.directories == "when_free"
    assert any(c.startswith("publish.directories=when_free") for c in gpu.device_choices)
    lora = on(H100, monkeypatch, model=ModelSection(size="1b"),
              learner=LearnerConfig(lora=LoraConfig(rank=4, publish="adapters")))  # fmt: skip
    # adapter versions are announced from the device too (their adapter set on a base)
    assert lora.publish.transport == "cuda_ipc" and lora.publish.directories == "when_free"
    kept = on(H100, monkeypatch, publish=PublishSection(directories="every"))
    assert kept.publish.directories == "every"  # a set key is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_card_another_process_serves_it_and_the_directory_is_the_same_set(
    tmp_path: Path,
) -> None:
    """Device first on CUDA: the snapshot on the card, packed on the publisher's stream after
    its ready event, announced without a directory, copied and checked by a reader process;
    the writer's directory (pinned copy) is the same set by both digests."""
    import os
    import subprocess
    import sys
    import textwrap

    from tests.weights.test_cuda_ipc import _READER, ROOT

    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2, device_first=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    rows, anns = [], []
    try:
        for v in (1, 2):
            state = {k: t.cuda() for k, t in _state(v % 2).items()}
            ready = torch.cuda.Event()
            ready.record()
            snap = DeviceSnapshot(v, state, {}, CONFIG, weights_dir(tmp_path, v), ready)
            ann = pub.publish(pub.prepare_device(snap))
            assert ann.path == "" and ann.digest_kind == "mix128" and not snap.state
            anns.append(ann)
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(Codec().encode(ann).hex() + "\n")
            proc.stdin.flush()
            rows.append(json.loads(proc.stdout.readline()))
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=60)
    assert [r["ok"] for r in rows] == [True, True], rows
    pub.close()  # v1 written when announced (the writer was free), v2 at the end at the latest
    for v, ann in zip((1, 2), anns):
        assert ann.digest == dd.reference_digest(*blob_and_meta(_state(v % 2)))
        if v in pub.writer.written:
            on_disk = Publication.from_dir(weights_dir(tmp_path, v), v)
            assert on_disk.digest_as("mix128") == ann.digest
    assert 2 in pub.writer.written
