"""weights.transports: the registry names the transports the config accepts, each side opens its
end from it, and the shm transport's learner side keeps its /dev/shm files with the
directories (written beside the next step, pruned after each announce, removed at the end)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.config.run import load_config
from proto.records import Ack, WeightAnnounce
from weights import shm
from weights.adapters import AdapterReceiver
from weights.collective.generator import CollectiveReceiver
from weights.cuda_ipc import CudaIpcReceiver
from weights.publication import Publication, weights_dir
from weights.receiver import WeightReceiver
from weights.transports import TRANSPORTS, open_publisher, open_receiver


class Sent:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, *args: Any, **kw: Any) -> bool:
        self.sent.append(args[-1])
        return True


def test_the_registry_names_the_configs_transports() -> None:
    section = load_config(None, []).publish  # pipeline's PublishSection, where it is defined
    assert sorted(TRANSPORTS) == sorted(sys.modules[type(section).__module__].WEIGHT_TRANSPORTS)


def test_the_generators_receiver_takes_every_transports_records() -> None:
    """One receiver for any transport: the adapter sets' on top (weights.adapters), then
    cuda_ipc's and collective's (each takes its own announces), the chunk stream's below them;
    an announced directory comes out as a VerifiedWeights to read."""
    conn = Sent()
    top = open_receiver(conn, "gen-0", serving_version=1)
    assert isinstance(top, AdapterReceiver) and top.serving == 1
    rx = top.fallback
    assert isinstance(rx, CudaIpcReceiver) and isinstance(rx.fallback, CollectiveReceiver)
    assert isinstance(rx.fallback.fallback, WeightReceiver)
    assert rx.serving == rx.fallback.serving == rx.fallback.fallback.serving == 1
    rx = top
    ann = WeightAnnounce(2, "ab" * 32, 0, 0, 0, path="/run/weights/v2")
    got = rx.handle(ann)
    assert got is not None and got.version == 2 and got.directory == "/run/weights/v2"
    assert rx.handle(ann) is None  # heard again while it loads: handed out once
    rx.loaded(2)
    (ack,) = conn.sent
    assert isinstance(ack, Ack) and (ack.kind, ack.version) == ("weights", 2)
    assert rx.handle(WeightAnnounce(1, "ab" * 32, 0, 0, 0, path="/run/weights/v1")) is None


def test_shm_publisher_writes_beside_prunes_and_removes_its_files(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    run = tmp_path / "run"
    settings = load_config(None, ["publish.transport=shm", "publish.keep=2"]).publish
    pub = open_publisher("shm", Sent(), settings, run)
    assert isinstance(pub, shm.ShmPublisher) and not pub.chunked
    pub.root = root
    for v in (1, 2, 3):
        p = Publication.of_state({"w": torch.full((4,), float(v))}, v, weights_dir(run, v))
        p = pub.prepare(p)  # the publishing thread's part: the /dev/shm copy
        assert shm.shm_file(p.path, root).read_bytes() == bytes(p.blob)  # type: ignore[arg-type]
        assert p.stage_s["shm_write"] >= 0
        ann = pub.publish(p)
        assert ann.version == v and ann.num_chunks == 0 and ann.path.endswith(f"v{v}")
    assert shm.shm_versions(run / "weights", root) == [2, 3]  # publish.keep=2
    pub.close()
    assert shm.shm_versions(run / "weights", root) == []
