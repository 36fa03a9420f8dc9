"""Adapter versions on the device (weights.cuda_ipc "Adapters", protocol 1.12): under
learner.lora.publish=adapters with publish.transport=cuda_ipc a version is its adapter set in a
slot of the learner's (kilobytes here, megabytes at Huginn-0125) beside a base packed once; the
generator merges it onto the mapped base into a buffer of its own and serves it only when the
merged set's device digest is the version's, which the learner took from its own merged
weights tensor by tensor. The merged set equals the learner's merge (models.lora's formula) bit
for bit; a torn or corrupted adapter set, a wrong base and an adapter set for other target
modules are refused by name (a Nack) and the version served is kept; the run's last version's
merged directory is written at the end and names the same set. The publisher's 'device' is the
CPU here (the IPC call itself runs on CUDA in tests/weights/test_cuda_ipc.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from models.lora import lora_delta, merged_weight
from proto.codec import Codec
from proto.records import Nack
from tests.weights.test_device_first import _pair as device_first_pair
from tests.weights.test_transports import Sent
from weights import cuda_ipc
from weights import device_digest as dd
from weights.adapter_merge import merge_adapters
from weights.digest import blob_and_meta
from weights.publication import (
    DeviceAdapter,
    DeviceSnapshot,
    Publication,
    verify_publication,
    weights_dir,
)

CONFIG = json.dumps({"architectures": ["Test"], "hidden_size": 8})
TARGETS = ["l1", "l2"]
SCALE = 2.0


def _base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "l1.weight": torch.randn(6, 8, generator=g).to(torch.bfloat16),
        "l2.weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "rope.freqs": torch.randn(3, generator=g),  # an odd-sized fp32 buffer
    }


def _factors(v: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + v)
    base = _base()
    out = {}
    for m in TARGETS:
        o, i = base[f"{m}.weight"].shape
        out[m] = (torch.randn(2, i, generator=g), torch.randn(o, 2, generator=g) * 0.1 * v)
    return out


def _merged(v: int) -> dict[str, torch.Tensor]:
    """The learner's merged weights at version ``v`` (models.lora's formula, written out)."""
    state = _base()
    for m, (a, b) in _factors(v).items():
        state[f"{m}.weight"] = merged_weight(state[f"{m}.weight"], lora_delta(a, b, SCALE))
    state["norm.weight"] = torch.full((8,), 1.0 + v / 8, dtype=torch.bfloat16)  # trained in full
    return state


def _snap(tmp_path: Path, v: int, frozen_calls: list[int] | None = None) -> DeviceSnapshot:
    def frozen(m: str) -> torch.Tensor:
        if frozen_calls is not None:
            frozen_calls.append(v)
        return _base()[f"{m}.weight"]

    ad = DeviceAdapter(_factors(v), ["norm.weight"], frozen, SCALE)
    return DeviceSnapshot(v, _merged(v), {}, CONFIG, weights_dir(tmp_path, v), adapter=ad)


def _pair(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[cuda_ipc.CudaIpcPublisher, cuda_ipc.CudaIpcReceiver, Sent]:
    """test_device_first's pair, whose receiver also 'maps' the base: the publisher's own
    buffer (an announce's base fields carry no slot)."""
    pub, rx, conn = device_first_pair(monkeypatch)

    def mapped(c: dict[str, Any], index: int) -> torch.Tensor:
        if "slot" in c:
            return pub._bufs[int(c["slot"])]  # type: ignore[return-value]
        assert pub._base is not None
        return pub._base.buf

    monkeypatch.setattr(rx, "_map", mapped)
    return pub, rx, conn


def _nacks(conn: Sent) -> list[Nack]:
    return [r for r in conn.sent if isinstance(r, Nack)]


def test_an_adapter_version_travels_as_its_adapter_set_and_merges_to_the_learners_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx, conn = _pair(monkeypatch)
    calls: list[int] = []
    for v in (1, 2):
        p = pub.prepare_device(_snap(tmp_path, v, calls))
        blob, meta = blob_and_meta(_merged(v))
        assert p.on_device_only and p.digest == dd.reference_digest(blob, meta)
        ann = pub.publish(p)
        assert Codec().decode(Codec().encode(ann)) == ann  # valid on the wire (protocol 1.12)
        assert ann.cuda_ipc["holds"] == "adapter" and ann.cuda_ipc["digest"] == ann.digest
        # what crosses: A and B of two modules and the norm, not the set
        ad_bytes = sum(a.nbytes + b.nbytes for a, b in _factors(v).values()) + 16
        assert ann.adapter["bytes"] == ad_bytes < ann.total_bytes
        got = rx.handle(ann)
        assert got is not None and got.version == v
        for k, t in _merged(v).items():
            assert torch.equal(got.state()[k], t), (v, k)
        rx.loaded(v)
    assert calls == [1, 1] and pub.counts["base_packed"] == 1  # the base once (2 weights)
    assert rx.counts["adapter_merged"] == 2 and not _nacks(conn)
    assert len(rx._base_ok) == 1  # the base buffer checked once
    assert {"device_digest", "adapter_digest", "device_pack", "base_pack"} <= p.stage_s.keys()
    # the merge routine is the host path's (weights.adapters) too
    adapter = {f"{m}.lora_{k}": t for m, (a, b) in _factors(2).items()
               for k, t in (("A", a), ("B", b))}  # fmt: skip
    adapter["norm.weight"] = _merged(2)["norm.weight"]
    host = merge_adapters(_base(), adapter, TARGETS, SCALE)
    assert all(torch.equal(host[k], t) for k, t in _merged(2).items())
    pub.close()


def test_a_torn_adapter_set_a_wrong_base_and_other_targets_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx, conn = _pair(monkeypatch)
    ann1 = pub.publish(pub.prepare_device(_snap(tmp_path, 1)))
    assert rx.handle(ann1) is not None
    rx.loaded(1)
    # torn: the slot's adapter set changed after its digest
    ann2 = pub.publish(pub.prepare_device(_snap(tmp_path, 2)))
    pub._bufs[int(ann2.cuda_ipc["slot"])][0:1].bitwise_xor_(0xFF)  # type: ignore[index]
    assert rx.handle(ann2) is None
    assert "torn or corrupted" in _nacks(conn)[-1].reason and rx.serving == 1
    # other target modules: factors for l1 only, announced as l1,l2 -> by name
    ann3 = pub.publish(pub.prepare_device(_snap(tmp_path, 3)))
    bad = dataclasses.replace(ann3, adapter={**ann3.adapter, "targets": "l1,l3"})
    assert rx.handle(bad) is None
    assert "are not the announced targets" in _nacks(conn)[-1].reason
    # a wrong base: the learner's base buffer is not the announced base
    wrong = dataclasses.replace(ann3, adapter={**ann3.adapter, "base_digest": "ab" * 32})
    assert rx.handle(wrong) is None
    reason = _nacks(conn)[-1].reason
    assert "wrong base" in reason and "abababababababab" in reason
    assert rx.serving == 1 and rx.counts["adapter_merged"] == 1
    # the real v3 still loads: nothing refused was kept
    got = rx.handle(ann3)
    assert got is not None and torch.equal(got.state()["l2.weight"], _merged(3)["l2.weight"])
    assert all(n.version in (2, 3) for n in _nacks(conn))
    pub.close()


def test_a_merge_that_differs_from_the_learners_in_a_bit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, rx, conn = _pair(monkeypatch)
    ann = pub.publish(pub.prepare_device(_snap(tmp_path, 1)))
    real = cuda_ipc.write_merged

    def off_by_a_bit(out: torch.Tensor, *a: Any) -> None:  # the generator's merge, one bit off
        real(out, *a)
        out[0:1].bitwise_xor_(1)

    monkeypatch.setattr(cuda_ipc, "write_merged", off_by_a_bit)
    assert rx.handle(ann) is None
    assert rx.counts["merge_mismatch"] == 1 and len(_nacks(conn)) == 1
    pub.close()


def test_the_learner_exports_the_whole_set_once_for_the_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The megatron path's snapshot: the tensors trained in full only, the whole set taken by
    the publisher for its base (``DeviceAdapter.whole``) at its first version alone; every
    version's name is still the learner's merged set's."""
    pub, rx, _ = _pair(monkeypatch)
    taken: list[int] = []
    for v in (1, 2, 3):
        snap = _snap(tmp_path, v)
        assert snap.adapter is not None

        def whole(v: int = v) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            taken.append(v)
            return _merged(v), {}

        snap = dataclasses.replace(snap, state={"norm.weight": _merged(v)["norm.weight"]},
                                   adapter=dataclasses.replace(snap.adapter, whole=whole))  # fmt: skip
        p = pub.prepare_device(snap)
        assert p.digest == dd.reference_digest(*blob_and_meta(_merged(v)))
        got = rx.handle(pub.publish(p))
        assert got is not None and torch.equal(got.state()["l1.weight"], _merged(v)["l1.weight"])
        rx.loaded(v)
    assert taken == [1]
    pub.close()


def test_the_last_adapter_version_gets_its_merged_directory_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, _, _ = _pair(monkeypatch)
    for v in (1, 2):
        pub.publish(pub.prepare_device(_snap(tmp_path, v)))
    assert pub.writer.written == []  # none beside training: an adapter set is not the set
    pub.close()
    assert pub.writer.written == [2] and not weights_dir(tmp_path, 1).exists()
    path = weights_dir(tmp_path, 2)
    assert verify_publication(path)
    on_disk = Publication.from_dir(path, 2)
    assert on_disk.digest == Publication.of_state(_merged(2), 2, None).digest
    assert on_disk.digest_as("mix128") == dd.reference_digest(*blob_and_meta(_merged(2)))


def test_an_adapter_announce_on_the_device_is_checked_on_the_wire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proto.errors import ProtocolError

    pub, _, _ = _pair(monkeypatch)
    ann = pub.publish(pub.prepare_device(_snap(tmp_path, 1)))
    for field, value, says in (("base_digest", "xy", "adapter.base_digest"),
                               ("layout", "", "adapter.layout"),
                               ("digest_kind", "sha256-tree", "adapter.digest_kind")):  # fmt: skip
        bad = dataclasses.replace(ann, adapter={**ann.adapter, field: value})
        with pytest.raises(ProtocolError, match=says):
            bad.validate()
    odd = dataclasses.replace(ann, cuda_ipc={**ann.cuda_ipc, "holds": "merged"}, adapter={})
    with pytest.raises(ProtocolError, match="cuda_ipc.holds"):
        odd.validate()
    pub.close()


_READER = """
import json, sys, time, torch
from proto.codec import Codec
from weights import cuda_ipc
from tests.weights.test_device_first import _pair as device_first_pair
from tests.weights.test_device_adapters import _merged
from tests.weights.test_transports import Sent
rx = cuda_ipc.CudaIpcReceiver(Sent(), _Below(), "gen-0")
for line in sys.stdin:
    ann = Codec().decode(bytes.fromhex(line.strip()))
    t0 = time.perf_counter()
    got = rx.handle(ann)
    dt = time.perf_counter() - t0
    ok = got not in (None, "read-the-directory") and all(
        torch.equal(got.state()[k].cpu(), t) for k, t in _merged(ann.version).items())
    if ok:
        rx.loaded(ann.version)
    print(json.dumps({"v": ann.version, "ok": ok, "s": dt, "counts": dict(rx.counts)}), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_card_another_process_merges_it_to_the_learners_bits(tmp_path: Path) -> None:
    """The real IPC on CUDA: the learner's merged weights, factors and base on the card (the
    merge in fp64 by cuBLAS on both sides), another process maps the adapter slot and the
    base, merges and serves the learner's exact bits; the base is packed once."""
    import os
    import subprocess
    import sys
    import textwrap

    from tests.weights.test_cuda_ipc import ROOT

    pub = cuda_ipc.CudaIpcPublisher(Sent(), slots=2, device_first=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    rows = []
    try:
        for v in (1, 2, 3):
            host = _snap(tmp_path, v)
            assert host.adapter is not None
            ad = host.adapter
            cuda = {f"{m}.weight": _base()[f"{m}.weight"].cuda() for m in TARGETS}
            factors = {m: (a.cuda(), b.cuda()) for m, (a, b) in ad.factors.items()}
            state = {k: t.cuda() for k, t in host.state.items()}
            for m, (a, b) in factors.items():  # the learner's own merge, on the card
                state[f"{m}.weight"] = merged_weight(cuda[f"{m}.weight"], lora_delta(a, b, SCALE))
            ready = torch.cuda.Event()
            ready.record()
            snap = DeviceSnapshot(v, state, {}, CONFIG, host.path, ready, adapter=DeviceAdapter(
                factors, ad.full, lambda m, c=cuda: c[f"{m}.weight"], SCALE))  # fmt: skip
            ann = pub.publish(pub.prepare_device(snap))
            assert ann.cuda_ipc["holds"] == "adapter" and not snap.state
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(Codec().encode(ann).hex() + "\n")
            proc.stdin.flush()
            rows.append(json.loads(proc.stdout.readline()))
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=60)
    assert [r["ok"] for r in rows] == [True, True, True], rows
    assert rows[-1]["counts"].get("adapter_merged") == 3 and pub.counts["base_packed"] == 1
    pub.close()
    assert pub.writer.written == [3]
    on_disk = Publication.from_dir(weights_dir(tmp_path, 3), 3)
    assert on_disk.digest == Publication.of_state(_merged(3), 3, None).digest


def test_the_megatron_learners_adapter_versions_are_its_merged_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real megatron learner (gloo, CPU) with its device-adapter snapshot forced on: its
    snapshots hold the factors and the norms only, the publisher exports the whole set once,
    and every version's device name is the mix128 of the set the learner publishes through
    the host path (its own merged weights), which the receiver's merge reproduces."""
    from models.random_init import init_checkpoint
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.config.run import load_config
    from tests.pipeline.test_epochs import _rollouts

    model = tmp_path / "huginn"
    init_checkpoint("huginn", "tiny", model, seed=0)
    cfg = load_config(None, ["backend=megatron", f"run_dir={tmp_path / 'run'}", "rollout.n=4",
                             "rollout.prompts_per_step=2", "learner.backprop_depth=0",
                             "optimizer.lr=0.05", "learner.lora.rank=4", "learner.lora.alpha=8",
                             "learner.lora.publish=adapters"])  # fmt: skip
    t = MegatronTrainer(cfg, model)
    pub, rx, _ = _pair(monkeypatch)
    try:
        for v in range(3):
            if v:
                t.step(_rollouts(seed=v), [False] * 8)
            t.device_adapters = True
            taken = t.snapshot(tmp_path / "run" / "weights" / f"v{v}", v)
            assert taken is not None and taken.device is not None
            snap = taken.device
            assert snap.adapter is not None and sorted(snap.state) == sorted(snap.adapter.full)
            p = pub.prepare_device(snap)
            t.device_adapters = False
            own = t.publish(tmp_path / "host" / f"v{v}", v)  # the learner's merged set, as ever
            assert own is not None and p.digest == own.digest_as("mix128"), v
            got = rx.handle(pub.publish(p))
            assert got is not None and got.digest == p.digest
            rx.loaded(v)
    finally:
        t.close()
        pub.close()
    assert pub.counts["base_packed"] == 1 and rx.counts["adapter_merged"] == 3
