"""The weight-broadcast group of ``publish.transport=collective``: helpers both sides share.

The learner's publisher (weights.collective.learner, rank 0) and every generator's weight
sink (weights.collective.generator, ranks 1..n) meet through a TCPStore the learner hosts; its
address travels in ``WeightAnnounce.collective`` on the weights channel. One delivery round
(one version to the generators that lack it) uses the store keys under the round's prefix::

    <round>/join/<generator id>   generator -> learner: here, ready to receive
    <round>/roster                learner -> generators: JSON list of the ids that joined in time;
                                  a generator's rank is its index + 1 (0 is the learner)
    <round>/pg/...                the process group's own rendezvous (PrefixStore)

then one broadcast of the blob (canonical tensor bytes, weights.digest) as a uint8 tensor from
rank 0. The group is built without torch.distributed's default (world) group, so the learner's
own ranks (megatron, gloo or NCCL) are untouched: ``ProcessGroupGloo`` / ``ProcessGroupNCCL``
on the store directly. Every wait is bounded (``timeout_s``); a dead peer makes the round fail
with an error, never hang.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class CollectiveError(RuntimeError):
    """A round could not complete (a peer missing, dead or too slow, or a bad setting)."""


def split_address(addr: str) -> tuple[str, int]:
    """Split "host:port" into (host, port); ValueError naming the address otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"collective store address {addr!r}: expected HOST:PORT")
    return host, int(port)


def local_address_towards(host: str, port: int) -> str:
    """The local IP address this host uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The learner's store (``port`` 0: any free port; read it from ``.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))  # fmt: skip


def join_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """A generator's client connection to the learner's store at ``addr`` ("host:port")."""
    host, port = split_address(addr)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def roster_key(prefix: str) -> str:
    return f"{prefix}/roster"


def join_key(prefix: str, generator_id: str) -> str:
    return f"{prefix}/join/{generator_id}"


def encode_roster(ids: list[str]) -> str:
    return json.dumps(ids)


def decode_roster(raw: bytes) -> list[str]:
    ids = json.loads(raw.decode())
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise CollectiveError(f"bad roster {raw[:200]!r}: expected a JSON list of ids")
    return ids


def open_group(
    store: dist.Store, prefix: str, rank: int, world: int, *, backend: str, timeout_s: float,
    hostname: str,
) -> Any:  # fmt: skip
    """The round's process group (blocks until all ``world`` ranks arrived, <= timeout_s).

    ``hostname``: the local address gloo binds and advertises (reachable from every peer)."""
    if backend not in BACKENDS:
        raise CollectiveError(f"collective backend {backend!r}: expected one of {BACKENDS}")
    store = dist.PrefixStore(f"{prefix}/pg", store)
    timeout = timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            return dist.ProcessGroupGloo(store, rank, world, opts)
        if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
            raise CollectiveError("collective backend nccl needs CUDA and an NCCL build of torch")
        nopts = dist.ProcessGroupNCCL.Options()
        nopts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, nopts)
    except CollectiveError:
        raise
    except Exception as e:  # a rendezvous that timed out or a peer that vanished
        raise CollectiveError(f"rank {rank}/{world}: could not form the group: {e}") from e


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from rank 0 to every rank of ``group`` in place (<= timeout_s)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    try:
        work = group.broadcast([tensor], opts)
        if not work.wait(timedelta(seconds=timeout_s)):
            raise CollectiveError(f"broadcast did not finish within {timeout_s}s")
    except CollectiveError:
        raise
    except Exception as e:
        raise CollectiveError(f"broadcast failed: {e}") from e
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


DEFAULT_PIPE_BYTES = 4 << 20
"""Default ``publish.collective_chunk_bytes``: the piece a pipelined delivery forwards at a time."""


def check_pipe_bytes(chunk_bytes: Any) -> int:
    """``chunk_bytes`` as an int >= 0 (0: one whole broadcast); ValueError naming it otherwise."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise ValueError(f"collective chunk_bytes {chunk_bytes!r}: expected an integer >= 0 "
                         "(0: one broadcast of the whole blob)")  # fmt: skip
    return chunk_bytes


def pieces(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[(start, end)] covering ``nbytes`` in ``chunk_bytes`` pieces (the last one shorter)."""
    if nbytes <= 0:
        return []
    step = chunk_bytes if chunk_bytes > 0 else nbytes
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def deliver(
    group: Any, tensor: torch.Tensor, rank: int, world: int, *, chunk_bytes: int, timeout_s: float,
) -> None:  # fmt: skip
    """Copy rank 0's ``tensor`` into every rank's ``tensor`` (same size everywhere), <= timeout_s.

    ``chunk_bytes`` 0: one broadcast (gloo's is a tree: log2(world) hops, each a whole copy).
    > 0 on gloo: a pipelined chain 0 -> 1 -> ... -> world-1, piece by piece: rank r forwards
    piece k to r + 1 as soon as it has it, while piece k + 1 arrives, so the hops overlap and
    the time is about one copy + (world - 2) pieces; every link carries the blob once. > 0 on
    nccl: one broadcast per piece (NCCL's broadcast is a pipelined ring already). Every rank
    must pass the same ``chunk_bytes`` (the announcement carries it)."""
    check_pipe_bytes(chunk_bytes)
    n = tensor.numel()
    if n == 0:
        return
    if chunk_bytes == 0:
        broadcast(group, tensor, timeout_s)
        return
    spans = pieces(n, chunk_bytes)
    deadline = time.monotonic() + timeout_s

    def left() -> timedelta:
        s = deadline - time.monotonic()
        if s <= 0:
            raise CollectiveError(f"pipelined delivery did not finish within {timeout_s}s")
        return timedelta(seconds=s)

    try:
        if tensor.is_cuda:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            works = [group.broadcast([tensor[a:b]], opts) for a, b in spans]
            for w in works:
                if not w.wait(left()):
                    raise CollectiveError(f"broadcast did not finish within {timeout_s}s")
            torch.cuda.synchronize(tensor.device)
            return
        sends: list[Any] = []
        recvs = [group.recv([tensor[a:b]], rank - 1, k) for k, (a, b) in enumerate(spans)] \
            if rank > 0 else []  # fmt: skip
        for k, (a, b) in enumerate(spans):
            if recvs:
                recvs[k].wait(left())
            if rank + 1 < world:
                sends.append(group.send([tensor[a:b]], rank + 1, k))
        for w in sends:
            w.wait(left())
    except CollectiveError:
        raise
    except Exception as e:
        raise CollectiveError(f"rank {rank}/{world}: pipelined delivery failed: {e}") from e


def buffer_tensor(nbytes: int, backend: str) -> tuple[bytearray, torch.Tensor]:
    """A receive buffer: (host bytes, the tensor the broadcast writes; shares the bytes on gloo)."""
    host = bytearray(nbytes)
    if backend == "nccl":  # the broadcast writes device memory; the caller copies it back
        return host, torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t = torch.frombuffer(host, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return host, t


def blob_tensor(blob: bytes | bytearray | memoryview, backend: str) -> torch.Tensor:
    """The publisher's blob as the uint8 tensor rank 0 broadcasts (a copy on CUDA for nccl)."""
    import warnings

    with warnings.catch_warnings():  # read-only buffer: rank 0 only reads it
        warnings.simplefilter("ignore", UserWarning)
        t = (
            torch.frombuffer(blob, dtype=torch.uint8)
            if len(blob)
            else torch.empty(0, dtype=torch.uint8)
        )
    return t.cuda() if backend == "nccl" else t
