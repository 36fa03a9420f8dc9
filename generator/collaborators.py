"""The generator's collaborators, as structural types: connection and engine.

generator/ never imports pipeline/; these Protocols are what generator.loop (and its
generator.outbox) needs, written so that pipeline.net.transport.session.GeneratorConnection satisfies
them as it is, and generator.engine.LoopedEngine (or a fake in tests) is the Engine. The weight
receiver and what it hands the engine (weights.verified.VerifiedWeights) are weights'.
Helpers: the Hello a generator introduces itself with and the one-thread work lane that keeps
engine calls in order.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from proto.records import Hello, Rollout, WorkItem
from weights.verified import VerifiedWeights

Channel = Literal["control", "weights"]
ToRollouts = Callable[[WorkItem, list[Any], str], list[Rollout]]
"""(item, its samples, generator_id) -> one Rollout per sample (generator.engine.to_rollouts)."""


class Received(Protocol):
    """What ``Connection.recv`` returns (pipeline.net.transport.session.Incoming)."""

    @property
    def channel(self) -> Channel: ...
    @property
    def record(self) -> Any: ...


class Connection(Protocol):
    """The generator's link to the learner (pipeline.net.transport.session.GeneratorConnection).

    It sends Hello when created and again whenever it lost the learner (``ready`` False
    until the next Welcome, which ``recv`` also returns); it sends heartbeats carrying the
    last ``set_status``; ``close(reason)`` sends Goodbye. Used from one thread only.
    """

    ready: bool

    def send(self, record: Any, *, channel: Channel = "control") -> bool: ...
    def recv(self, timeout_s: float = 0.0) -> Received | None: ...
    def set_status(self, weight_version: int, inflight: int) -> None: ...
    def close(self, reason: str = "shutdown") -> None: ...


class Engine(Protocol):
    """The sampling engine (generator.engine.LoopedEngine); called from one thread only.
    ``load_weights`` gets a weights.verified.VerifiedWeights and serves its checked state
    (``state()``, read on this thread) as its version."""

    @property
    def weight_version(self) -> int: ...
    def generate(self, items: list[WorkItem]) -> list[list[Any]]: ...
    # an engine a multi-turn driver (generator.multiturn) drives also takes
    # generate(items, sampling_offsets=[per item: the turn]): models.reference.sampling_seed
    def load_weights(self, weights: VerifiedWeights) -> None: ...


def make_hello(
    generator_id: str, max_inflight: int, weight_version: int, families: Sequence[str] = ()
) -> Hello:
    """The Hello this process introduces itself with."""
    return Hello(
        generator_id, socket.gethostname(), os.getpid(), list(families), max_inflight,
        weight_version, time.time(),
    )  # fmt: skip
