"""weights.device_digest and weights.cuda_ipc: the device digest's kernel equals its numpy spec
(under Triton's interpreter here, on the card where there is one) and changes with any moved,
flipped or renamed byte; a packed device buffer holds exactly the canonical blob; the
publisher announces the slot with its digest, and the receiver serves a checked copy, refuses a
torn or corrupted one by name (the directory is read instead, the served version kept) and
reads the directory where it cannot map the buffer. The real two-process IPC runs on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from models.errors import ConfigError
from pipeline.config.run import load_config
from proto.codec import Codec
from proto.records import WeightAnnounce
from tests.weights.test_transports import Sent
from weights import cuda_ipc
from weights import device_digest as dd
from weights.digest import blob_and_meta
from weights.publication import Publication, weights_dir
from weights.transports import open_publisher

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = dd.triton is not None


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {  # an odd bf16 count before an fp32 tensor: offsets not aligned to 4
        "a.weight": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "b.freqs": torch.randn(5, 3, generator=g),
        "c.mask": torch.tensor([True, False, True]),
        "d.empty": torch.empty(0),
        "e.bias": torch.randn(11, generator=g).to(torch.bfloat16),
    }


def _buf(blob: bytes) -> torch.Tensor:
    buf = torch.zeros(dd.padded_size(len(blob)), dtype=torch.uint8)
    if blob:
        buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return buf


def check_kernel(device: str) -> dict[str, Any]:
    """The kernel's lanes against the spec's on blobs of awkward sizes (also run on CUDA)."""
    dd.INTERPRET[0] = device == "cpu"
    g = torch.Generator().manual_seed(1)
    sizes = [0, 1, 3, 4, 5, 4 * dd.BLOCK - 1, 4 * dd.BLOCK, 3 * 4 * dd.BLOCK + 7]
    same = []
    for n in sizes:
        blob = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        got = dd.device_lanes(_buf(blob).to(device), n)
        same.append(got == dd.reference_lanes(blob))
    blob, meta = blob_and_meta(_state())
    whole = dd.device_digest(_buf(bytes(blob)).to(device), len(blob), meta)
    # tensor by tensor where they are (no packed blob): odd offsets go through the staging
    # buffer, whole words straight through the kernel at their index in the blob
    big = {**_state(), "f.big": torch.randn(3 * dd.BLOCK + 5, generator=g).to(torch.bfloat16),
           "g.words": torch.randn(2 * dd.BLOCK, generator=g)}  # fmt: skip
    big_blob, big_meta = blob_and_meta(big)
    lanes = dd.Lanes(staging=4 * dd.BLOCK)
    for name in sorted(big):
        lanes.feed(big[name].to(device))
    streamed = dd.lanes_digest(lanes.nbytes, big_meta, *lanes.total())
    dd.INTERPRET[0] = False
    return {"lanes": same, "digest": whole == dd.reference_digest(blob, meta),
            "state": streamed == dd.reference_digest(big_blob, big_meta)}  # fmt: skip


_CHECK = """
import json
from tests.weights.test_cuda_ipc import check_kernel
print(json.dumps(check_kernel("cpu")))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this host")
def test_device_digest_kernel_equals_its_spec_under_the_interpreter() -> None:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"lanes": [True] * 8, "digest": True, "state": True}, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_digest_kernel_equals_its_spec_on_cuda() -> None:
    assert check_kernel("cuda") == {"lanes": [True] * 8, "digest": True, "state": True}


def test_device_digest_changes_with_a_flipped_bit_moved_words_and_names() -> None:
    blob, meta = blob_and_meta(_state())
    base = dd.reference_digest(blob, meta)
    raw = bytearray(blob)
    flipped = bytearray(raw)
    flipped[100] ^= 0x01
    swapped = bytearray(raw)
    swapped[0:4], swapped[4:8] = raw[4:8], raw[0:4]
    assert raw[0:4] != raw[4:8]
    renamed = [dict(m) for m in meta]
    renamed[0]["name"] = "a.weigh"
    reshaped = [dict(m) for m in meta]
    reshaped[0]["shape"] = [7, 33]
    others = {dd.reference_digest(bytes(flipped), meta), dd.reference_digest(bytes(swapped), meta),
              dd.reference_digest(blob, renamed), dd.reference_digest(blob, reshaped)}  # fmt: skip
    assert len(others) == 4 and base not in others
    # the lanes are sums over words: a blob's pieces (whole words) sum to the whole
    a1, b1 = dd.reference_lanes(blob, piece_words=7)
    assert (a1, b1) == dd.reference_lanes(blob) and len(base) == 64


def test_pack_lays_out_the_canonical_blob_and_unpack_reads_it_back() -> None:
    state = _state()
    blob, meta = blob_and_meta(state)
    buf = torch.full((dd.padded_size(len(blob)) + 16,), 0xAB, dtype=torch.uint8)
    assert cuda_ipc.pack(state, buf) == len(blob)
    assert buf[: len(blob)].numpy().tobytes() == bytes(blob)
    assert not buf[len(blob) : dd.padded_size(len(blob))].any()  # the word's tail zeroed
    ann = WeightAnnounce(1, "ab" * 32, len(blob), 0, 0, tensors=[_meta(m) for m in meta])
    back = cuda_ipc.unpack(buf, list(ann.tensors))
    assert sorted(back) == sorted(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def _meta(m: dict[str, Any]) -> Any:
    from proto.records import TensorMeta

    return TensorMeta(**m)


class _Below:
    """The receiver under cuda_ipc's (weights.receiver's part): what it was handed."""

    def __init__(self) -> None:
        self.handed: list[Any] = []
        self.serving = -1

    def handle(self, rec: Any) -> Any:
        self.handed.append(rec)
        return "read-the-directory"

    def loaded(self, version: int) -> None:
        self.serving = version

    def load_failed(self, version: int, reason: str) -> None:
        pass


def _cpu_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[cuda_ipc.CudaIpcPublisher, cuda_ipc.CudaIpcReceiver]:
    """A publisher and a receiver whose 'mapping' is the publisher's own slot (the CPU: the
    IPC call itself is what the CUDA test below makes)."""
    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2)
    fields = {"device_uuid": "GPU-test", "handle": "01" * 8, "size": 0, "offset": 0,
              "ref_handle": "02", "ref_offset": 0, "pid": os.getpid()}  # fmt: skip
    monkeypatch.setattr(cuda_ipc, "_share", lambda buf: dict(fields))
    rx = cuda_ipc.CudaIpcReceiver(Sent(), _Below(), "gen-0")
    monkeypatch.setattr(rx, "_card", lambda uuid: 0)
    monkeypatch.setattr(rx, "_map", lambda c, i: pub._bufs[int(c["slot"])])
    return pub, rx


def _publication(tmp_path: Path, v: int) -> Publication:
    state = _state(v)
    return Publication.of_state(state, v, weights_dir(tmp_path, v), device_state=state)


def test_the_receiver_serves_a_checked_copy_and_refuses_a_torn_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx = _cpu_pair(monkeypatch)
    p1 = pub.prepare(_publication(tmp_path, 1))
    assert not p1.device_state and p1.stage_s["device_digest"] >= 0
    ann = pub.publish(p1)
    c = ann.cuda_ipc
    assert c["slot"] == 0 and c["digest_kind"] == "mix128"
    assert c["digest"] == dd.reference_digest(p1.blob, p1.tensors)
    assert Codec().decode(Codec().encode(ann)).cuda_ipc == c  # it travels as it is
    got = rx.handle(ann)
    assert got is not None and got.version == 1 and got.directory == ""
    for k, t in _state(1).items():
        assert torch.equal(got.state()[k], t), k
    assert rx.counts == {"verified": 1}
    # v2 goes to slot 1; v3 refills slot 0 while a slow reader of v1 would still copy it:
    p2 = pub.prepare(_publication(tmp_path, 2))
    ann2 = pub.publish(p2)
    assert ann2.cuda_ipc["slot"] == 1
    pub.prepare(_publication(tmp_path, 3))  # slot 0 now holds v3's bytes
    late = rx.handle(dataclasses_replace(ann, version=4))  # v1's announce (as a newer one)
    assert late == "read-the-directory" and rx.counts["refused"] == 1
    assert rx.fallback.handed[-1].cuda_ipc == {}  # the plain announce went below
    # a byte flipped in the slot after its digest (the test hook) is refused by name
    monkeypatch.setenv(cuda_ipc.CORRUPT_ENV, "5")
    ann5 = pub.publish(pub.prepare(_publication(tmp_path, 5)))
    assert rx.handle(ann5) == "read-the-directory" and rx.counts["refused"] == 2


def dataclasses_replace(a: WeightAnnounce, **kw: Any) -> WeightAnnounce:
    import dataclasses

    return dataclasses.replace(a, **kw)


def test_an_announce_it_cannot_map_reads_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx = _cpu_pair(monkeypatch)

    def not_here(uuid: str) -> int:
        raise ValueError(f"card {uuid} is not visible to this process")

    monkeypatch.setattr(rx, "_card", not_here)
    ann = pub.publish(pub.prepare(_publication(tmp_path, 1)))
    assert rx.handle(ann) == "read-the-directory" and rx.counts == {"unmapped": 1}
    rx.loaded(1)
    assert rx.serving == rx.fallback.serving == 1
    # served already: the announce goes below (which acknowledges it again)
    assert rx.handle(ann) == "read-the-directory" and rx.counts == {"unmapped": 1}
    # a CPU trainer's publication (no device tensors): the directory's announce alone
    plain = Publication.of_state(_state(2), 2, weights_dir(tmp_path, 2))
    assert pub.publish(pub.prepare(plain)).cuda_ipc == {}


def test_the_run_config_takes_cuda_ipc_and_a_cpu_learner_refuses_it(tmp_path: Path) -> None:
    cfg = load_config(None, ["publish.transport=cuda_ipc", "publish.max_pending=2"])
    assert cfg.publish.transport == "cuda_ipc"
    if torch.cuda.is_available():
        pub = open_publisher("cuda_ipc", Sent(), cfg.publish, tmp_path)
        assert isinstance(pub, cuda_ipc.CudaIpcPublisher) and pub.slots == 3
        return
    with pytest.raises(ConfigError, match="publish.transport=cuda_ipc: this learner sees no CUDA"):
        open_publisher("cuda_ipc", Sent(), cfg.publish, tmp_path)


_READER = """
import json, sys, time, torch
from proto.codec import Codec
from weights import cuda_ipc
from tests.weights.test_cuda_ipc import _Below, _state
from tests.weights.test_transports import Sent
rx = cuda_ipc.CudaIpcReceiver(Sent(), _Below(), "gen-0")
out = []
for line in sys.stdin:
    ann = Codec().decode(bytes.fromhex(line.strip()))
    t0 = time.perf_counter()
    got = rx.handle(ann)
    dt = time.perf_counter() - t0
    ok = got not in (None, "read-the-directory") and all(
        torch.equal(got.state()[k].cpu(), t) for k, t in _state(ann.version % 2).items())
    out.append({"v": ann.version, "ok": ok, "s": dt, "counts": dict(rx.counts)})
    print(json.dumps(out[-1]), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_processes_on_one_card(tmp_path: Path) -> None:
    """The learner's slot mapped by another process: served, then a torn copy refused."""
    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        rows = []
        for v in (1, 2):
            state = {k: t.cuda() for k, t in _state(v % 2).items()}
            p = Publication.of_state(state, v, weights_dir(tmp_path, v), device_state=state)
            ann = pub.publish(pub.prepare(p))
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(Codec().encode(ann).hex() + "\n")
            proc.stdin.flush()
            rows.append(json.loads(proc.stdout.readline()))
        # v3 into slot 0, then v1's slot announced again as v4: the reader copies v3's bytes
        state = {k: t.cuda() for k, t in _state(1).items()}
        pub.prepare(Publication.of_state(state, 3, weights_dir(tmp_path, 3), device_state=state))
        slot0 = {
            **(pub._shared[0] or {}),
            "slot": 0,
            "digest": ann.cuda_ipc["digest"],
            "digest_kind": "mix128",
        }  # v2's digest, slot 0's handle
        torn = dataclasses_replace(ann, version=4, cuda_ipc=slot0)
        proc.stdin.write(Codec().encode(torn).hex() + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        rows.append(json.loads(proc.stdout.readline()))  # type: ignore[union-attr]
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=60)
    assert [r["ok"] for r in rows] == [True, True, False], rows
    assert rows[-1]["counts"] == {"verified": 2, "refused": 1}, rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_receiver_in_the_learners_own_process(tmp_path: Path) -> None:
    """generators.placement=thread: the announce's handle is this process's own buffer, which
    CUDA would not map here; the receiver takes the buffer itself, copies and checks it as
    across processes (a torn copy refused), and a buffer the publisher let go is not served."""
    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2)
    rx = cuda_ipc.CudaIpcReceiver(Sent(), _Below(), "gen-0")
    anns = []
    for v in (1, 2):
        state = {k: t.cuda() for k, t in _state(v % 2).items()}
        p = Publication.of_state(state, v, weights_dir(tmp_path, v), device_state=state)
        anns.append(pub.publish(pub.prepare(p)))
        assert anns[-1].cuda_ipc["pid"] == os.getpid()
        got = rx.handle(anns[-1])
        assert got is not None and got != "read-the-directory", rx.counts
        for k, t in _state(v % 2).items():
            assert torch.equal(got.state()[k].cpu(), t), k
        # the generator's own copy, not a view of the learner's slot
        slot = pub._bufs[int(anns[-1].cuda_ipc["slot"])]
        assert slot is not None
        assert all(t.untyped_storage().data_ptr() != slot.untyped_storage().data_ptr()
                   for t in got.state().values())  # fmt: skip
        del slot  # (the test's own reference would keep the buffer alive below)
    assert rx.counts == {"verified": 2} and not rx._maps  # nothing mapped
    state = {k: t.cuda() for k, t in _state(1).items()}
    pub.prepare(Publication.of_state(state, 3, weights_dir(tmp_path, 3), device_state=state))
    torn = dataclasses_replace(anns[1], version=4, cuda_ipc={**anns[0].cuda_ipc,
                               "digest": anns[1].cuda_ipc["digest"]})  # fmt: skip
    assert rx.handle(torn) == "read-the-directory" and rx.counts["refused"] == 1
    pub._bufs = [None, None]  # the publisher lets its buffers go
    pub._shared = [None, None]
    import gc

    gc.collect()
    late = dataclasses_replace(anns[1], version=5)
    assert rx.handle(late) == "read-the-directory" and rx.counts["unmapped"] == 1


def test_the_cache_goes_back_to_the_card_only_when_a_reader_would_lack_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuda_ipc._released: the learner's CUDA cache is emptied after a version only when the
    card's free memory is below the version's bytes + READER_MARGIN (a generator process must
    allocate its copy); otherwise the next step keeps its cached blocks (and a generator thread
    of the same process its allocations). The CUDA calls are stood in for: this is the rule."""
    from weights import cuda_ipc as ci
    from weights.publication import Publication

    calls: list[str] = []
    free = {"bytes": 0}
    monkeypatch.setattr(ci.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ci.torch.cuda, "mem_get_info", lambda: (free["bytes"], 80 << 30))
    monkeypatch.setattr(ci.torch.cuda, "empty_cache", lambda: calls.append("empty"))
    version = 1_100_000_000  # a 1b version's bytes
    pub = Publication.on_device(3, "d" * 32, [], tied={}, config_json="{}")
    free["bytes"] = 25 << 30  # plenty: kept
    assert "cache_release" not in ci._released(pub, version).stage_s and calls == []
    free["bytes"] = version + ci.READER_MARGIN  # exactly enough: kept
    assert "cache_release" not in ci._released(pub, version).stage_s and calls == []
    free["bytes"] = version + ci.READER_MARGIN - 1  # a byte short: released, timed
    assert "cache_release" in ci._released(pub, version).stage_s and calls == ["empty"]
