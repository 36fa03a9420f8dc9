"""The weight transports by name (publish.transport), and how each side opens its end.

A transport is one way a version travels from the learner to the generators: a learner-side
publisher (a ``weights.publisher.WeightPublisher``) and, when its announces are its own, a
generator-side receiver of them. ``TRANSPORTS`` registers them by name; a new transport is
its module plus one line there.

Every generator has the receiver of the weights channel itself (weights.receiver.
WeightReceiver: announced directories, and the ZMQ chunk stream that is every transport's
fallback). A generator does not know the learner's transport: ``open_receiver`` stacks the
registered receivers on it, each taking the announces it recognises (``collective``: those
with a ``collective`` field) and handing every other record to the one below.

    shared_fs   the announce of RUN_DIR/weights/vN; the engine reads the directory
    shm         shared_fs + the blob once in this host's /dev/shm (weights.shm), read first
    zmq         the announce, then the blob in credit-windowed chunks (weights.publisher)
    collective  a torch.distributed broadcast per version (weights.collective.learner,
                weights.collective.generator), ZMQ chunks for a generator that falls out
    cuda_ipc    shared_fs + the blob in a learner's device buffer, mapped, copied and checked
                on the device by the generators on its host (weights.cuda_ipc)

Over every transport's receiver sits ``weights.adapters.AdapterReceiver``: a version that is
also an adapter set on a base (learner.lora.publish=adapters; the announce's ``adapter``
field) is read as that set and merged onto the base the generator holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weights.adapters import AdapterReceiver
from weights.collective.generator import CollectiveReceiver
from weights.collective.learner import collective_publisher
from weights.cuda_ipc import CudaIpcReceiver, cuda_ipc_publisher
from weights.publisher import (
    LearnerSide,
    PublishSettings,
    WeightPublisher,
    shared_fs_publisher,
    zmq_publisher,
)
from weights.receiver import GeneratorSide, Receiver, WeightReceiver
from weights.shm import shm_publisher

OpenPublisher = Callable[[LearnerSide, PublishSettings, Path], WeightPublisher]
"""(the learner's endpoint, the run's publish settings, RUN_DIR) -> the transport's publisher."""


class OpenReceiver(Protocol):
    """The generator side of a transport with announces of its own: a receiver that takes
    them and hands every other record to ``fallback``."""

    def __call__(
        self, conn: GeneratorSide, fallback: Receiver, generator_id: str, *,
        serving_version: int, max_total_bytes: int,
    ) -> Receiver: ...  # fmt: skip


@dataclass(frozen=True)
class Transport:
    """The two ends of one transport."""

    publisher: OpenPublisher
    """The learner side."""
    receiver: OpenReceiver | None = None
    """The generator side of announces of its own; None: WeightReceiver takes its records."""


TRANSPORTS: dict[str, Transport] = {
    "shared_fs": Transport(shared_fs_publisher),
    "shm": Transport(shm_publisher),
    "zmq": Transport(zmq_publisher),
    "collective": Transport(collective_publisher, CollectiveReceiver),
    "cuda_ipc": Transport(cuda_ipc_publisher, CudaIpcReceiver),
}


def open_publisher(
    transport: str, endpoint: LearnerSide, settings: PublishSettings, run_dir: Path
) -> WeightPublisher:
    """The learner's publisher of ``transport`` (weights.publisher has its loop)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight transport {transport!r}: expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[transport].publisher(endpoint, settings, Path(run_dir))


def open_receiver(
    conn: GeneratorSide, generator_id: str, *, serving_version: int = -1,
    max_total_bytes: int = 1 << 40,
) -> Receiver:  # fmt: skip
    """The generator's receiver of every transport (module docstring): it takes every record
    of the weights channel and hands out each version as ``VerifiedWeights``.
    ``serving_version``: the version the engine serves (already-served announces are
    acknowledged, not loaded again)."""
    rx: Receiver = WeightReceiver(conn, serving_version=serving_version,
                                  max_total_bytes=max_total_bytes)  # fmt: skip
    for t in TRANSPORTS.values():
        if t.receiver is not None:
            rx = t.receiver(conn, rx, generator_id, serving_version=serving_version,
                            max_total_bytes=max_total_bytes)  # fmt: skip
    return AdapterReceiver(conn, rx, generator_id, serving_version=serving_version,
                           max_total_bytes=max_total_bytes)  # fmt: skip


__all__ = ["TRANSPORTS", "Transport", "open_publisher", "open_receiver"]
