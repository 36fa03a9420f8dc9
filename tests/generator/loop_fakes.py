"""Fakes of the GeneratorLoop and Outbox tests (tests/generator/test_loop.py,
tests/generator/test_outbox.py): a scripted engine, clock and connection, and helpers that
drive a loop."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from generator.collaborators import Channel
from generator.engine import check_newer
from generator.loop import GeneratorLoop
from generator.reward_runner import RewardRunner
from proto.records import (
    Goodbye,
    Rollout,
    WeightAnnounce,
    Welcome,
    WorkItem,
)
from weights.transports import open_receiver
from weights.verified import VerifiedWeights

GID = "gen-test"
DIGEST = "ab" * 32


@dataclass
class FakeSample:
    tokens: list[int]
    latent_seed: int
    weight_version: int


class FakeEngine:
    """Deterministic tokens (a function of the latent seed); logs every call in ``log``."""

    inflight_updates = False

    def __init__(self, log: list[tuple[Any, ...]], version: int = 0) -> None:
        self.log, self.weight_version = log, version
        self.max_batch = 0
        self.gate: threading.Event | None = None  # generate waits for it when set
        self.load_gate: threading.Event | None = None  # load_weights waits for it when set
        self.fail = False

    def generate(self, items: Sequence[WorkItem]) -> list[list[FakeSample]]:
        self.log.append(("generate", [i.work_id for i in items], self.weight_version))
        self.max_batch = max(self.max_batch, len(items))
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise RuntimeError("engine exploded")
        return [
            [
                FakeSample([3 + (int(s) + k) % 7 for k in range(4)], int(s), self.weight_version)
                for s in it.latent_seeds
            ]
            for it in items
        ]

    def load_weights(self, weights: VerifiedWeights) -> None:
        version = weights.version
        check_newer(version, self.weight_version)  # as the real engines refuse it
        self.log.append(("load", version, weights.digest, weights))
        if self.load_gate is not None:
            self.load_gate.wait()
        self.weight_version = version


def to_rollouts(item: WorkItem, samples: list[FakeSample], gid: str) -> list[Rollout]:
    n = len(samples[0].tokens) if samples else 0
    return [
        Rollout(
            rollout_id=f"{item.work_id}/{j}",
            work_id=item.work_id,
            prompt_id=item.prompt_id,
            sample_index=j,
            generator_id=gid,
            latent_seed=s.latent_seed,
            prompt_tokens=item.prompt_tokens,
            tokens=np.asarray(s.tokens, np.int32),
            logprobs=np.full(n, -1.0, np.float32),
            exit_depths=np.full(n, 4, np.uint8),
            weight_version=s.weight_version,
        )
        for j, s in enumerate(samples)
    ]


class FakeClock:
    """Monotonic time that moves only when told to."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@dataclass
class Inc:
    channel: Channel
    record: Any


@dataclass
class FakeConnection:
    """Scripted link: the test puts records in ``inbox``; sends, statuses and the Goodbye are
    logged. Like pipeline's connection it is ``ready`` after a Welcome came through ``recv``.
    ``refuse``: ``send`` returns False and keeps nothing (the transport could not queue it)."""

    log: list[tuple[Any, ...]]
    inbox: queue.Queue[Inc] = field(default_factory=queue.Queue)
    ready: bool = False
    refuse: bool = False
    closed: str | None = None
    statuses: list[tuple[int, int]] = field(default_factory=list)
    sent: list[Any] = field(default_factory=list)

    def push(self, *records: Any, channel: Channel = "control") -> None:
        for r in records:
            self.inbox.put(Inc(channel, r))

    def send(self, record: Any, *, channel: str = "control") -> bool:
        assert self.closed is None, "send after close"
        if self.refuse:
            return False
        self.sent.append(record)
        self.log.append(("send", type(record).__name__, record))
        return True

    def recv(self, timeout_s: float = 0.0) -> Inc | None:
        try:
            inc = self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(inc.record, Welcome):
            self.ready = True
        self.log.append(("recv", type(inc.record).__name__))
        return inc

    def set_status(self, weight_version: int, inflight: int) -> None:
        self.statuses.append((weight_version, inflight))

    def close(self, reason: str = "shutdown") -> None:
        self.send(Goodbye(GID, reason))
        self.closed = reason

    def of(self, cls: type) -> list[Any]:
        return [r for r in self.sent if isinstance(r, cls)]


def item(wid: str, n: int = 2, min_version: int = 0, task: dict | None = None) -> WorkItem:
    return WorkItem(
        work_id=wid,
        prompt_id=f"p-{wid}",
        prompt_tokens=np.array([1, 5, 6], np.int32),
        latent_seeds=np.arange(n, dtype=np.uint64) + 11,
        max_tokens=4,
        task=task or {},
        min_weight_version=min_version,
    )


def rollouts(wid: str, n: int = 2, tokens: int = 4) -> list[Rollout]:
    """The ``n`` rollouts of a finished work item ``wid``, ``tokens`` completion tokens each."""
    samples = [FakeSample([3] * tokens, 11 + j, 0) for j in range(n)]
    return to_rollouts(item(wid, n), samples, GID)


def length_reward(text: str, tokens: list[int], task: dict) -> float:
    if task.get("fail"):
        raise ValueError("bad task")
    return float(len(tokens))


def make(
    version: int = 0,
    *,
    threaded: bool = False,
    reward: Callable[..., Any] = length_reward,
    engine_cls: type[FakeEngine] | None = None,
    **kw: Any,
) -> tuple[GeneratorLoop, FakeEngine, FakeConnection, list[tuple[Any, ...]]]:
    log: list[tuple[Any, ...]] = []
    engine, conn = (engine_cls or FakeEngine)(log, version), FakeConnection(log)
    opts: dict[str, Any] = dict(max_inflight=4, batch_wait_s=0.0, threaded=threaded)
    opts.update(kw)
    loop = GeneratorLoop(
        engine,
        conn,
        RewardRunner(reward, mode="inline"),
        to_rollouts=to_rollouts,
        generator_id=GID,
        weights=open_receiver(conn, GID, serving_version=version),
        **opts,
    )
    return loop, engine, conn, log


def generated(engine: FakeEngine) -> list[tuple[Any, ...]]:
    return [e[1:] for e in engine.log if e[0] == "generate"]


def spin(loop: GeneratorLoop, n: int = 5) -> None:
    for _ in range(n):
        loop.step(0.0)


def welcome(version: int = 0) -> Welcome:
    return Welcome("run-1", GID, version, 1.0)


def on_disk(version: int) -> WeightAnnounce:
    return WeightAnnounce(version, DIGEST, 0, 0, 0, path=f"/ckpt/v{version}")


def kinds(log: list[tuple[Any, ...]]) -> list[str]:
    """The log as 'recv:X' / 'send:X' / 'generate' / 'load' events."""
    return [f"{e[0]}:{e[1]}" if e[0] in ("send", "recv") else e[0] for e in log]


class InflightEngine(FakeEngine):
    """A FakeEngine that swaps weights between the steps of a running generate
    (inflight_updates): load_weights during generate stages the version; generate applies it
    while it waits on its gate."""

    inflight_updates = True

    def __init__(self, log: list[tuple[Any, ...]], version: int = 0) -> None:
        super().__init__(log, version)
        self.running = threading.Event()
        self.staged: int | None = None

    def generate(self, items: Sequence[WorkItem]) -> list[list[FakeSample]]:
        self.running.set()
        try:
            while self.gate is not None and not self.gate.wait(0.005):
                self._apply()  # between two "steps"
            self.gate = None
            self._apply()
            return super().generate(items)
        finally:
            self.running.clear()

    def _apply(self) -> None:
        if self.staged is not None:
            self.log.append(("swap", self.staged))
            self.weight_version, self.staged = self.staged, None

    def load_weights(self, weights: VerifiedWeights) -> None:
        if self.running.is_set():
            check_newer(weights.version, self.weight_version)
            self.log.append(("stage", weights.version))
            self.staged = weights.version
            return
        super().load_weights(weights)
