"""Settings, counters and errors of the transport (pipeline.net.transport: both channels, both
sides).

Memory bound of the receive side (docs/PROTOCOL.md, "Flow control"): libzmq queues at most
RCVHWM whole messages per connection (ZMQ HWMs are per pipe) and decodes one more, each at
most the channel's frame limit + ``oversize_grace_bytes`` (ZMQ_MAXMSGSIZE), so
:meth:`TransportConfig.rcvhwm` picks the largest RCVHWM with
``(RCVHWM + 1) * (limit + grace) <= recv_budget_bytes``; the in-memory transport bounds the
bytes queued per sender the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.errors import ConfigError

Channel = Literal["control", "weights"]
CHANNELS: tuple[Channel, Channel] = ("control", "weights")
ACK_MAX_FRAME = 64 << 10  # the learner's weights socket only ever receives small acks


class TransportError(ConfigError):
    """Bad transport settings or use (never raised for what a peer sends)."""


class ConnectTimeout(TransportError):
    """A generator heard nothing from its learner within its connect timeout."""


@dataclass(frozen=True)
class TransportConfig:
    """Settings of both channels (the run config's ``transport`` section; `looprl run` hands
    the same values to its generators); both ends must use the same values."""

    max_frame_bytes: int = 256 << 20
    """Largest control frame (either way) and largest weights frame the learner sends."""
    weights_max_frame_bytes: int = 64 << 20
    """Largest frame a generator accepts on the weights channel."""
    oversize_grace_bytes: int = 1 << 20
    """Frames up to limit + grace are decoded and answered; larger ones drop the connection."""
    recv_budget_bytes: int = 1 << 30
    """Most bytes queued from one connection: RCVHWM = budget // (limit + grace) - 1."""
    heartbeat_interval_s: float = 1.0
    """Heartbeat period, both directions (s; the learner tells its generators in Welcome)."""
    peer_timeout_s: float = 10.0
    """Silence after which the other side is considered gone (s): a generator's work is then
    dispatched again."""
    hello_retry_s: float = 0.5
    """First Hello resend delay while no Welcome; doubles."""
    hello_retry_max_s: float = 10.0
    """Cap of the Hello resend delay."""
    reconnect_ivl_ms: int = 100
    """ZMQ_RECONNECT_IVL: first reconnect attempt."""
    reconnect_ivl_max_ms: int = 5000
    """ZMQ_RECONNECT_IVL_MAX: backoff cap."""
    hwm: int = 1000
    """Queued messages per peer going out (ZMQ SNDHWM), and the cap of RCVHWM."""
    compression_level: int = 1
    """Zstd level of control frames (weights go uncompressed)."""
    linger_ms: int = 200
    """How long close() waits to flush a Goodbye."""
    log_interval_s: float = 10.0
    """At most one warning per peer and reason per interval; the rest are only counted."""

    def __post_init__(self) -> None:
        if min(self.max_frame_bytes, self.weights_max_frame_bytes) < 1024:
            raise TransportError("max_frame_bytes and weights_max_frame_bytes must be >= 1024")
        if not 0 < self.heartbeat_interval_s < self.peer_timeout_s:
            raise TransportError("need 0 < heartbeat_interval_s < peer_timeout_s")
        if not 0 < self.hello_retry_s <= self.hello_retry_max_s:
            raise TransportError("need 0 < hello_retry_s <= hello_retry_max_s")
        if not 0 < self.reconnect_ivl_ms <= self.reconnect_ivl_max_ms:
            raise TransportError("need 0 < reconnect_ivl_ms <= reconnect_ivl_max_ms")
        if self.hwm < 1 or self.oversize_grace_bytes < 0 or self.linger_ms < 0:
            raise TransportError("hwm must be >= 1; grace and linger >= 0")
        if self.log_interval_s < 0:
            raise TransportError(f"log_interval_s must be >= 0, got {self.log_interval_s}")
        biggest = max(self.max_frame_bytes, self.weights_max_frame_bytes)
        if self.recv_budget_bytes < 2 * (biggest + self.oversize_grace_bytes):
            raise TransportError(
                f"recv_budget_bytes {self.recv_budget_bytes} must hold two of the largest "
                f"frames: >= 2 x (frame limit {biggest} + oversize_grace_bytes "
                f"{self.oversize_grace_bytes}); raise it or lower the frame limits"
            )

    def recv_limit(self, side: str, channel: Channel) -> int:
        """Largest frame ``side`` decodes on ``channel`` (the codec limit)."""
        if channel == "control":
            return self.max_frame_bytes
        return ACK_MAX_FRAME if side == "learner" else self.weights_max_frame_bytes

    def rcvhwm(self, side: str, channel: Channel) -> int:
        """ZMQ RCVHWM of ``side``'s ``channel`` socket: (rcvhwm + 1) frames fit the budget."""
        frame = self.recv_limit(side, channel) + self.oversize_grace_bytes
        return max(1, min(self.hwm, self.recv_budget_bytes // frame - 1))


@dataclass
class TransportStats:
    sent: int = 0  # frames handed to the network
    received: int = 0  # frames decoded and delivered to the caller
    rejected: int = 0  # frames refused: malformed, oversized, multipart, wrong channel, muted
    # frames dropped undecoded and unanswered: their connection sent STRIKE_LIMIT refused
    # frames within STRIKE_WINDOW_S (pipeline.net.strikes); counted in ``rejected`` too
    muted: int = 0
    wrong_identity: int = 0  # frames refused: the CURVE key does not own the claimed id
    unroutable: int = 0  # sends refused: unknown / gone peer, or its queue is full
    unauthenticated: int = 0  # CURVE handshakes refused (no key, unknown key, wrong server)
    # connections closed: peers leaving, libzmq dropping an over-limit frame, and each
    # generator's start-up probe (generator_cli.probe_learner: one per endpoint it probes)
    disconnects: int = 0
    reconnects: int = 0  # generator: learner lost and re-Hello started
    warnings_suppressed: int = 0  # warning lines not printed (log_interval_s rate limit)
    last_error: str = ""
