"""Pieces of the collective-transport tests: a trainer publishing real tensors, an engine that
checks and keeps what it loads, and a real generator loop (ZMQ connection, the product's
receiver: the collective one with the chunk receiver as fallback) runnable in a thread or a
spawned process."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from generator.collaborators import make_hello
from generator.loop import GeneratorLoop
from generator.reward_runner import RewardRunner
from models.checkpoint import save_checkpoint
from pipeline.net.transport.config import TransportConfig
from pipeline.net.transport.zmq import ZmqGeneratorConnection
from tests.pipeline.fakes import FakeTrainer
from weights.collective.generator import CollectiveReceiver
from weights.digest import tensor_bytes
from weights.publication import Publication
from weights.transports import open_receiver
from weights.verified import VerifiedWeights

TCFG = TransportConfig(heartbeat_interval_s=0.5, peer_timeout_s=30.0)


def state_for(version: int) -> dict[str, torch.Tensor]:
    """The weights of ``version``: fp32 and bf16 tensors, ~1.1 MB, different per version."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "model.layers.0.mlp.weight": torch.randn(512, 512, generator=g),
        "model.norm.weight": torch.randn(1000, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 256, generator=g),
    }


class StateTrainer(FakeTrainer):
    """Publishes ``state_for(version)`` as a real HF-layout directory."""

    def publish(self, out_dir: Path, version: int) -> Publication:
        save_checkpoint(state_for(version), {"architectures": ["Fake"]}, out_dir)
        return Publication.from_dir(out_dir, version)


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(tensor_bytes(a[k]) == tensor_bytes(b[k]) for k in a)


class KeepingEngine:
    """Checks the digest of what it loads (as generator.engine.LoopedEngine) and keeps a copy."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def generate(self, items: list[Any]) -> list[list[Any]]:
        return [[] for _ in items]

    def load_weights(self, weights: VerifiedWeights) -> None:
        state = weights.state()  # the engines' own rule: checked (views of checked bytes)
        self.loaded[weights.version] = {k: v.clone() for k, v in state.items()}
        self.weight_version = weights.version


class Receiver:
    """One generator: the product's GeneratorLoop on a real ZMQ connection, on its own thread."""

    def __init__(self, gid: str, control: str, weights: str) -> None:
        self.gid = gid
        self.engine = KeepingEngine()
        self.conn = ZmqGeneratorConnection(TCFG, make_hello(gid, 2, 0), control=control,
                                           weights=weights)  # fmt: skip
        stack = open_receiver(self.conn, gid, serving_version=0)  # the product's whole stack
        sink: Any = stack
        while not isinstance(sink, CollectiveReceiver):  # (adapters', cuda_ipc's above it)
            sink = sink.fallback
        self.sink: CollectiveReceiver = sink
        self.chunks = self.sink.fallback  # the chunk receiver under it
        self.loop = GeneratorLoop(
            self.engine, self.conn, RewardRunner(_zero_reward, mode="inline"),
            to_rollouts=lambda item, s, g: [], generator_id=gid, max_inflight=2,
            weights=stack, poll_s=0.005,
        )  # fmt: skip
        self.thread = threading.Thread(target=self.loop.run, name=gid, daemon=True)

    def start(self) -> Receiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), f"{self.gid} did not stop"


def _zero_reward(text: str, tokens: list[int], task: dict[str, Any]) -> float:
    return 0.0


def child(gid: str, control: str, weights: str, die_in_round: bool, device: int = -1) -> None:
    """A receiver in a process of its own (spawned; the test kills it by pid).

    ``die_in_round``: the process exits at once after joining a round's rendezvous, before
    the group forms (a generator dying mid-round). ``device`` >= 0: the one GPU it sees (an
    NCCL rank of its own; CUDA_VISIBLE_DEVICES as a generator host gives it, so that every
    thread's current device is that GPU, before anything initialises CUDA here)."""
    if device >= 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    if die_in_round:
        import weights.collective.group as coll

        def die(*a: Any, **k: Any) -> Any:
            os._exit(3)

        coll.open_group = die  # type: ignore[assignment]
    r = Receiver(gid, control, weights).start()
    while True:
        time.sleep(1.0)
        if not r.thread.is_alive():
            return
