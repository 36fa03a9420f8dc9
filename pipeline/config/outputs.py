"""The run config's output sections (pipeline.config.run.RunConfig composes them with
pipeline.config.sections'): how weights are published (`publish`), checkpoints (`checkpoint`),
the recorded rollout stream (`record`) and the metrics (`metrics`). One frozen dataclass per
section, each validating its own values (a bad value is a models.errors.ConfigError naming the
key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, get_args

from pipeline.config.sections import _check
from weights.collective.group import DEFAULT_PIPE_BYTES

__all__ = ["COLLECTIVE", "COLLECTIVE_BACKENDS", "CUDA_IPC", "FSYNC", "SHARED_FS", "SHM", "WEIGHT_TRANSPORTS",
           "ZMQ", "CheckpointSection", "MetricsSection", "PublishSection", "RecordSection",
           "WeightTransport"]  # fmt: skip

WeightTransport = Literal["shared_fs", "shm", "zmq", "collective", "cuda_ipc"]
"""How a weight version reaches the generators (publish.transport; PublishSection.transport)."""
SHARED_FS: Final = "shared_fs"
"""Announce RUN_DIR/weights/vN, a directory on storage every host mounts."""
SHM: Final = "shm"
"""shared_fs, plus one copy per version in /dev/shm for the generators on the learner's host."""
ZMQ: Final = "zmq"
"""Stream the blob as WeightChunks over the weights socket."""
COLLECTIVE: Final = "collective"
"""torch.distributed broadcast (ZMQ chunks for a generator that falls out of it)."""
CUDA_IPC: Final = "cuda_ipc"
"""shared_fs, plus the blob in a device buffer of the learner's that the generators on its host
map, copy and check on the device (a CUDA learner)."""
WEIGHT_TRANSPORTS: tuple[WeightTransport, ...] = get_args(WeightTransport)
WEIGHT_TRANSPORT_ALIASES = {"disk": SHARED_FS, "chunks": ZMQ}  # the transports' former names
if TYPE_CHECKING:
    _TransportSetting = WeightTransport
else:  # OmegaConf sees a str: 2.3 refuses a Literal annotation, 2.4 would refuse the former
    _TransportSetting = str  # names before __post_init__ maps them; its check validates, once

COLLECTIVE_BACKENDS = ("gloo", "nccl")
FSYNC = ("always", "batch", "never")
DIRECTORIES = ("every", "when_free")
"""publish.directories' values (PublishSection.directories)."""


@dataclass(frozen=True)
class PublishSection:
    """Weight publication after training steps."""

    every: int = 1
    """Publish a new weight version every this many steps."""
    transport: _TransportSetting = "auto"  # type: ignore[assignment]  # resolved at load
    """auto: shm on a CUDA host with local generators, else shared_fs (pipeline.config.device);
    shared_fs: announce RUN_DIR/weights/vN (storage every host mounts); shm: shared_fs plus
    one copy per version in /dev/shm that generators on the learner's host map and check
    (weights.shm; others read the directory); zmq: stream the
    blob over the weights socket; collective: torch.distributed broadcast; cuda_ipc (a CUDA
    learner): shared_fs plus the blob in a device buffer the generators on its host map, copy
    and check on the device (weights.cuda_ipc) (old names disk, chunks are accepted)."""
    directories: str = "auto"  # resolved at load (pipeline.config.device)
    """Which versions get their directory RUN_DIR/weights/vN. every: each one, written (blob,
    tree digest, safetensors) before it is announced. when_free (transport cuda_ipc only): each
    version is announced from the learner's GPU as soon as it is packed and named by its
    device digest (kind mix128), and its directory is written beside training only when the
    writer is free (a version that comes while one is being written gets none), the run's last
    version always; a generator that cannot map the learner's buffer gets nothing then (use
    every, or another transport, for generators on other hosts). With
    learner.lora.publish=adapters a version is its adapter set on a base packed once
    (protocol 1.12), and only the run's last version gets a directory (its merged set, at the
    end). auto: when_free under cuda_ipc, else every."""
    chunk_bytes: int = 4 << 20
    """zmq (and collective's fallback): bytes per WeightChunk."""
    window: int = 4
    """zmq (and collective's fallback): uncredited chunks in flight per generator."""
    keep: int = 3
    """Published versions kept on disk (older ones deleted; 0 keeps all)."""
    max_pending: int = 1
    """Versions being hashed and written while the next steps train: a step's weights are
    copied when it ends, the rest of the publication runs beside the next step and the
    version is announced when its digest is ready (generators get it then; staleness is
    counted from the trainer's weights, so a bound means the same). A step that would exceed
    this waits. Above 1 the pending versions are finished on as many threads, overlapping
    (one's blob beside the previous one's disk write). 0: each version is written and
    announced before the next step starts."""
    collective_host: str = "127.0.0.1"
    """collective: the learner's address generators reach its TCPStore and gloo ranks at."""
    collective_port: int = 0
    """collective: the TCPStore's port (0: any free port; the announce carries it)."""
    collective_backend: str = "gloo"
    """collective: gloo (CPU tensors, any host) or nccl (CUDA on both sides)."""
    collective_timeout_s: float = 5.0
    """collective: bound of each wait of a round (join, group, broadcast); keep it below
    transport.peer_timeout_s (the generator's loop waits in the receive)."""
    collective_chunk_bytes: int = DEFAULT_PIPE_BYTES
    """collective: piece size of the pipelined delivery (gloo: a chain learner -> generator 1
    -> 2 -> ..., each forwarding a piece while the next arrives; nccl: one broadcast per
    piece); 0: one broadcast of the whole blob (gloo's tree, log2(N+1) whole copies)."""

    def __post_init__(self) -> None:
        if self.transport in WEIGHT_TRANSPORT_ALIASES:
            object.__setattr__(self, "transport", WEIGHT_TRANSPORT_ALIASES[self.transport])
        _check(self.every >= 1, "publish.every", self.every, "must be >= 1")
        _check(self.chunk_bytes >= 1, "publish.chunk_bytes", self.chunk_bytes, "must be >= 1")
        _check(self.window >= 1, "publish.window", self.window, "must be >= 1")
        _check(self.transport in (*WEIGHT_TRANSPORTS, "auto"), "publish.transport",
               self.transport, f"must be one of {(*WEIGHT_TRANSPORTS, 'auto')}")  # fmt: skip
        _check(self.keep >= 0, "publish.keep", self.keep, "must be >= 0")
        _check(self.directories in ("auto", *DIRECTORIES), "publish.directories",
               self.directories, f"must be one of {('auto', *DIRECTORIES)}")  # fmt: skip
        _check(not isinstance(self.max_pending, bool) and isinstance(self.max_pending, int)
               and self.max_pending >= 0, "publish.max_pending", self.max_pending,
               "must be an integer >= 0 (0: publish before the next step starts)")  # fmt: skip
        _check(self.collective_backend in COLLECTIVE_BACKENDS, "publish.collective_backend",
               self.collective_backend, f"must be one of {COLLECTIVE_BACKENDS}")  # fmt: skip
        _check(self.collective_timeout_s > 0, "publish.collective_timeout_s",
               self.collective_timeout_s, "must be > 0")  # fmt: skip
        _check(0 <= self.collective_port < 65536, "publish.collective_port",
               self.collective_port, "must be in [0, 65536)")  # fmt: skip
        _check(not isinstance(self.collective_chunk_bytes, bool)
               and isinstance(self.collective_chunk_bytes, int)
               and (self.collective_chunk_bytes == 0 or self.collective_chunk_bytes >= 1 << 16),
               "publish.collective_chunk_bytes", self.collective_chunk_bytes,
               "must be 0 (one whole broadcast) or an integer >= 65536 (64 KiB)")  # fmt: skip
        _check(bool(self.collective_host), "publish.collective_host", self.collective_host,
               "must be an address the generators can reach")  # fmt: skip

    @property
    def chunked(self) -> bool:
        """Whether versions travel as WeightChunks too (zmq; collective's fallback), not as the
        announced directory alone (shared_fs, shm)."""
        return self.transport in (ZMQ, COLLECTIVE)


@dataclass(frozen=True)
class CheckpointSection:
    """Learner checkpoints (trainer state + pipeline state)."""

    every: int = 20
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep: int = 2
    """Checkpoints kept (0 keeps all)."""
    final: bool = True
    """Write a checkpoint when the run ends (its last step, or SIGTERM / SIGINT). False: none at
    the end (a benchmark, or a host whose disk cannot hold the optimizer state: a Huginn-0125
    checkpoint with Adam is ~57 GB); ``checkpoint.every`` still applies."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        _check(
            isinstance(self.final, bool), "checkpoint.final", self.final, "must be true or false"
        )
        _check(self.keep >= 0, "checkpoint.keep", self.keep, "must be >= 0 (0 keeps all)")


@dataclass(frozen=True)
class RecordSection:
    """The rollout stream (RUN_DIR/stream) and the step log replay follows."""

    enabled: bool = True
    """Record every accepted rollout (before it is acknowledged) and every step's batch."""
    fsync: str = "batch"
    """Stream durability: always, batch (fsync per intake) or never."""

    def __post_init__(self) -> None:
        _check(self.fsync in FSYNC, "record.fsync", self.fsync, f"must be one of {FSYNC}")


@dataclass(frozen=True)
class MetricsSection:
    """Where metrics go (RUN_DIR/metrics.jsonl always)."""

    tensorboard: bool = True
    """Also write TensorBoard events to RUN_DIR/tb (skipped with a warning if unavailable)."""
    plot: bool = True
    """Write RUN_DIR/metrics.png at the end (needs matplotlib)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    wandb: bool = False
    """Also log to Weights & Biases (imported only then; offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "looprl"
    """Weights & Biases project name."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: the learner process's steps first..last under torch.profiler, into
    RUN_DIR/profile (a Chrome trace, a kernel table, each CUDA stream's busy and overlapping
    seconds: pipeline.core.profiling); each generator process `looprl run` starts profiles its
    engine batches first..last (a batch a step in a steady run) into RUN_DIR/profile/gen<i>
    (a generator thread is in the learner's trace); [] (the default) profiles nothing."""

    def __post_init__(self) -> None:
        p = self.profile_steps
        _check(len(p) == 0 or (len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                    for x in p) and 1 <= p[0] <= p[1]),
               "metrics.profile_steps", p, "must be [] or [first, last] with 1 <= first <= last")  # fmt: skip
