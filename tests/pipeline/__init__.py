"""Tests of pipeline/: transports, security, staleness gate, ledger, weight sync."""

from __future__ import annotations

import numpy as np

from pipeline.net.transport.config import TransportConfig
from proto.records import Hello, Rollout


def fast_zmq(**overrides: object) -> TransportConfig:
    """Transport settings for tests over real ZeroMQ sockets on loopback: quick heartbeats,
    retries and reconnects, no linger; `overrides` set any other field."""
    settings: dict[str, object] = dict(
        heartbeat_interval_s=0.1,
        peer_timeout_s=2.0,
        hello_retry_s=0.05,
        hello_retry_max_s=0.2,
        reconnect_ivl_ms=20,
        reconnect_ivl_max_ms=100,
        linger_ms=0,
    )
    settings.update(overrides)
    return TransportConfig(**settings)  # type: ignore[arg-type]


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def hello(gid: str = "gen-0", weight_version: int = -1) -> Hello:
    return Hello(gid, "host", 1234, ["huginn"], 4, weight_version, 0.0)


def rollout(
    work_id: str = "w0",
    index: int = 0,
    gid: str = "gen-0",
    version: int = 0,
    token_versions: list[int] | None = None,
    n_tokens: int = 3,
) -> Rollout:
    tv = None if token_versions is None else np.asarray(token_versions, np.int64)
    t = n_tokens if tv is None else len(tv)
    return Rollout(
        rollout_id=f"{work_id}/{index}",
        work_id=work_id,
        prompt_id="p0",
        sample_index=index,
        generator_id=gid,
        latent_seed=index,
        prompt_tokens=np.array([1, 2], np.int32),
        tokens=np.arange(t, dtype=np.int32),
        logprobs=np.full(t, -0.5, np.float32),
        exit_depths=np.full(t, 4, np.uint8),
        weight_version=version,
        token_versions=tv,
    )
