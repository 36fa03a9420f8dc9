"""weights.adapters: adapter-only versions (learner.lora.publish=adapters), both ends.

The learner (a real trainer of either backend, real files): its first version is the full set
and writes the base; each later one also carries its adapter set, a small fraction of the
bytes. The generator's receiver (over the real weights.receiver.WeightReceiver, a fake
connection): a late joiner reads the base once, then every version is the adapter set merged
to the announced merged digest bit for bit; a wrong base, an adapter set for other target
modules and a corrupted adapter set are refused by name (a Nack) and nothing reaches the
engine, which keeps serving its version."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.config.run import load_config
from proto.records import Ack, Nack, WeightAnnounce
from tests.pipeline.test_epochs import _rollouts  # one batch of rollouts for a step
from weights.adapters import ADAPTER_DIR, BASE_DIR, AdapterReceiver
from weights.digest import digest_of_state
from weights.publication import Publication
from weights.receiver import WeightReceiver

_RUN = ["rollout.n=4", "rollout.prompts_per_step=2", "learner.backprop_depth=0",
        "optimizer.lr=0.05", "learner.lora.rank=4", "learner.lora.alpha=8",
        "learner.lora.publish=adapters"]  # fmt: skip


class _Conn:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, record: Any, *, channel: Any = None) -> bool:
        self.sent.append(record)
        return True

    def nacks(self) -> list[Nack]:
        return [r for r in self.sent if isinstance(r, Nack)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.random_init import init_checkpoint

    d = tmp_path_factory.mktemp("m") / "huginn"
    init_checkpoint("huginn", "tiny", d, seed=0)
    return d


def _publish_three(backend: str, model: Path, run_dir: Path) -> list[Publication]:
    """v0, v1, v2 of a real trainer (a step between each)."""
    cfg = load_config(None, [f"backend={backend}", f"run_dir={run_dir}", *_RUN])
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer

        t: Any = ReferenceTrainer(cfg, model)
    else:
        from pipeline.backends.megatron_adapter import MegatronTrainer

        t = MegatronTrainer(cfg, model)
    pubs = []
    try:
        for v in range(3):
            if v:
                t.step(_rollouts(seed=v), [False] * 8)
            pub = t.publish(run_dir / "weights" / f"v{v}", v)
            assert pub is not None
            pubs.append(pub)
    finally:
        t.close() if hasattr(t, "close") else None
    return pubs


@pytest.fixture(scope="module", params=["reference", "megatron"])
def published(request: Any, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    run_dir = tmp_path_factory.mktemp(f"run-{request.param}")
    return run_dir, _publish_three(request.param, model, run_dir)


def test_the_first_version_is_full_then_adapter_sets(published: Any) -> None:
    run_dir, (v0, v1, v2) = published
    assert not v0.adapter  # the line's first version: the full set, as ever
    assert (run_dir / "weights" / BASE_DIR / "model.safetensors").is_file()
    base = Publication.from_dir(run_dir / "weights" / BASE_DIR, 0)
    for pub in (v1, v2):
        a = pub.adapter
        assert a["base_digest"] == base.digest and a["scale"] == 2.0
        assert a["path"] == str((Path(pub.path) / ADAPTER_DIR).resolve())
        ad = Publication.from_dir(a["path"], pub.version)
        assert ad.digest == a["digest"] and len(ad.blob) == a["bytes"]
        targets = a["targets"].split(",")
        assert len(targets) == 16 and "transformer.core_block.0.attn.Wqkv" in targets
        # the adapter set: A and B of the 16 linears, the 17 norms; a fraction of the set
        assert len(ad.tensors) == 2 * 16 + 17
        assert a["bytes"] < len(pub.blob) / 4, (a["bytes"], len(pub.blob))
        pub.announce(0).validate()  # the announce carries it (protocol 1.10)
    # the base is v0's set without its norms (B = 0 at v0: W' = W bit for bit)
    full0 = Publication.from_dir(v0.path, 0)
    sha0 = {t["name"]: t["sha256"] for t in full0.tensors}
    assert all(sha0[t["name"]] == t["sha256"] for t in base.tensors)
    assert len(full0.tensors) - len(base.tensors) == 17


def test_a_late_joiner_reads_the_base_once_then_merges_each_adapter_set(published: Any) -> None:
    _, (_, v1, v2) = published
    conn = _Conn()
    rx = AdapterReceiver(conn, WeightReceiver(conn, serving_version=-1), "g0")
    for pub in (v1, v2):
        w = rx.handle(pub.announce(0))
        assert w is not None and w.version == pub.version and w.digest == pub.digest
        state = w.state()
        assert digest_of_state(state, pub.digest_kind, pub.digest_chunk_bytes) == pub.digest
        rx.loaded(pub.version)
    assert rx.counts["base_read"] == 1 and rx.counts["merged"] == 2
    assert not rx.counts["merge_mismatch"] and not conn.nacks()
    assert [r.version for r in conn.sent if isinstance(r, Ack)] == [1, 2]
    # bytes read: the base once, then the adapter sets alone
    assert rx.bytes_read["adapter"] == v1.adapter["bytes"] + v2.adapter["bytes"]
    assert rx.bytes_read["adapter"] < len(v2.blob) / 2


def test_an_announce_from_a_card_this_process_sees_goes_to_the_device_copy(
    published: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda_ipc beside the adapter set: where the learner's card is ours, the receivers below
    (the device copy, checked there) take it, not the host merge; elsewhere the adapter set."""
    import dataclasses

    from weights import adapters, cuda_ipc

    _, (_, v1, _) = published
    ipc = {"device_uuid": "GPU-learner", "handle": "01" * 8, "size": 1, "offset": 0,
           "ref_handle": "02", "ref_offset": 0, "pid": 1, "slot": 0, "digest": "0" * 64,
           "digest_kind": "mix128"}  # fmt: skip
    ann = dataclasses.replace(v1.announce(0), cuda_ipc=ipc)
    below: list[Any] = []

    class Below(WeightReceiver):
        def handle(self, rec: Any) -> Any:
            below.append(rec)
            return "the device copy"

    conn = _Conn()
    rx = AdapterReceiver(conn, Below(conn, serving_version=-1), "g0")
    assert not cuda_ipc.card_visible("GPU-learner")  # another host's card: the adapter set
    w = rx.handle(ann)
    assert w is not None and w.digest == v1.digest and rx.counts["merged"] == 1 and not below
    monkeypatch.setattr(adapters, "card_visible", lambda uuid: uuid == "GPU-learner")
    assert rx.handle(dataclasses.replace(ann, version=9)) == "the device copy"
    assert below[-1].cuda_ipc == ipc and rx.counts["device_copy"] == 1


def _receiver_holding(v1: Publication) -> tuple[_Conn, AdapterReceiver]:
    conn = _Conn()
    rx = AdapterReceiver(conn, WeightReceiver(conn, serving_version=-1), "g0")
    assert rx.handle(v1.announce(0)) is not None
    rx.loaded(v1.version)
    return conn, rx


def _refused(rx: AdapterReceiver, conn: _Conn, ann: WeightAnnounce, why: str) -> None:
    assert rx.handle(ann) is None  # nothing to the engine: it keeps serving its version
    assert rx.serving == 1
    assert conn.nacks() and why in conn.nacks()[-1].reason, conn.nacks()
    assert conn.nacks()[-1].version == ann.version


def test_a_wrong_base_is_refused_by_name(published: Any) -> None:
    _, (_, v1, v2) = published
    conn, rx = _receiver_holding(v1)
    ann = v2.announce(0)
    ann.adapter["base_digest"] = "ab" * 32
    _refused(rx, conn, ann, "wrong base")


def test_an_adapter_for_other_target_modules_is_refused_by_name(published: Any) -> None:
    _, (_, v1, v2) = published
    conn, rx = _receiver_holding(v1)
    ann = v2.announce(0)
    ann.adapter["targets"] = ann.adapter["targets"].replace("mlp.fc", "mlp.gate")
    _refused(rx, conn, ann, "are not the announced targets")
    # a base without the announced modules (another model's base): refused by name
    rx.base = {k: v for k, v in (rx.base or {}).items() if ".mlp.fc." not in k}
    _refused(rx, conn, v2.announce(0), "adapter set for other target modules")


def test_a_corrupted_adapter_set_is_refused(published: Any, tmp_path: Path) -> None:
    _, (_, v1, v2) = published
    conn, rx = _receiver_holding(v1)
    bad = tmp_path / "adapter"
    shutil.copytree(v2.adapter["path"], bad)
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    ann = v2.announce(0)
    ann.adapter["path"] = str(bad)
    _refused(rx, conn, ann, "adapter set of v2")
    # the real one still merges afterwards
    assert rx.handle(v2.announce(0)) is not None


@pytest.mark.parametrize("backend", ["reference", "megatron"])
def test_a_resumed_learner_keeps_the_base_and_its_generators_merge_on(
    backend: str, model: Path, tmp_path: Path
) -> None:
    """A learner that saves after v1 and a new one that resumes there: the new one's first
    version is whole again and finds the base it would write already there (same digest: the
    frozen weights did not change), so a generator that holds it merges the next adapter set
    without reading the base again."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"backend={backend}", f"run_dir={run_dir}", *_RUN])

    def trainer() -> Any:
        if backend == "reference":
            from pipeline.backends.reference_trainer import ReferenceTrainer

            return ReferenceTrainer(cfg, model)
        from pipeline.backends.megatron_adapter import MegatronTrainer

        return MegatronTrainer(cfg, model)

    conn = _Conn()
    rx = AdapterReceiver(conn, WeightReceiver(conn, serving_version=-1), "g0")
    t = trainer()
    try:
        t.publish(run_dir / "weights" / "v0", 0)
        t.step(_rollouts(seed=1), [False] * 8)
        v1 = t.publish(run_dir / "weights" / "v1", 1)
        t.save(run_dir, {"cursor": 1}, 2)
    finally:
        t.close() if hasattr(t, "close") else None
    assert rx.handle(v1.announce(0)) is not None
    rx.loaded(1)
    t = trainer()
    try:
        ckpt = t.latest(run_dir)
        assert ckpt is not None
        t.load(ckpt)
        pubs = []
        for v in (2, 3):
            t.step(_rollouts(seed=v), [False] * 8)
            pubs.append(t.publish(run_dir / "weights" / f"v{v}", v))
        assert t.line.counts["base_kept"] == 1 and not t.line.counts["base_written"]
    finally:
        t.close() if hasattr(t, "close") else None
    v2, v3 = pubs
    assert not v2.adapter and v3.adapter["base_digest"] == v1.adapter["base_digest"]
    w = rx.handle(v3.announce(0))
    assert w is not None and w.digest == v3.digest and rx.counts["base_read"] == 1
    assert not conn.nacks()


@pytest.mark.parametrize("backend", ["reference", "megatron"])
def test_an_embedding_trained_in_full_travels_in_the_adapter_set(
    backend: str, model: Path, tmp_path: Path
) -> None:
    """learner.lora.train_embeddings with adapter versions: the tied embedding is left out of
    the base (with its tie: megatron's publication names it) and travels in each adapter set;
    the merge reaches the merged digest."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"backend={backend}", f"run_dir={run_dir}", *_RUN,
                             "learner.lora.train_embeddings=true"])  # fmt: skip
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer

        t: Any = ReferenceTrainer(cfg, model)
    else:
        from pipeline.backends.megatron_adapter import MegatronTrainer

        t = MegatronTrainer(cfg, model)
    try:
        v0 = t.publish(run_dir / "weights" / "v0", 0)
        t.step(_rollouts(seed=1), [False] * 8)
        v1 = t.publish(run_dir / "weights" / "v1", 1)
    finally:
        t.close() if hasattr(t, "close") else None
    assert v1.adapter and not v0.adapter
    assert backend == "reference" or v0.tied == {"lm_head.weight": "transformer.wte.weight"}
    base = Publication.from_dir(run_dir / "weights" / BASE_DIR, 0)
    assert "transformer.wte.weight" not in {m["name"] for m in base.tensors}
    ad = Publication.from_dir(v1.adapter["path"], 1)
    assert "transformer.wte.weight" in {m["name"] for m in ad.tensors}
    conn = _Conn()
    rx = AdapterReceiver(conn, WeightReceiver(conn, serving_version=-1), "g0")
    w = rx.handle(v1.announce(0))
    assert w is not None and w.digest == v1.digest and rx.counts["merged"] == 1
