"""The two channels between the learner (rank 0) and its generators (docs/PROTOCOL.md).

control  learner ROUTER (bind) <-> generator DEALER (connect), routing id = generator id
         (+ a per-connection nonce; with CURVE the key must own the id, zmq.py):
         Hello/Welcome, Heartbeat, WorkItem, Rollout(Batch), WorkReturn, Ack/Nack, Goodbye.
weights  a second ROUTER (own port) <-> a second DEALER, same routing id: WeightAnnounce +
         WeightChunk out, Ack(kind="chunk") credits and Ack/Nack(kind="weights") back.
         Per-generator ROUTER, not PUB: PUB drops silently at a slow subscriber's HWM, has
         no back channel for credits and misses late joiners; ROUTER_MANDATORY sends fail
         visibly, so weights.publisher keeps <= window chunks in flight per generator.

Order of calls (ZMQ: pipeline.net.transport.zmq; in-memory: pipeline.net.transport.memory; same behaviour)::

    learner:   ep = ZmqLearnerEndpoint(cfg, control=..., weights=..., security=...)  # binds
               loop: inc = ep.recv(timeout_s)     # Incoming(channel, peer, record) | None
                     ep.send(peer, record, channel=...) -> bool (False: unknown/full peer)
                     ep.expired_peers()           # silent > peer_timeout_s: treat as dead
               ep.set_status(weight_version, inflight); ep.close()
    generator: conn = ZmqGeneratorConnection(cfg, hello, control=..., weights=...)  # Hello
               loop: inc = conn.recv(timeout_s)   # a Welcome sets conn.ready (again)
                     conn.send(record, channel=...) -> bool
               conn.set_status(weight_version, inflight); conn.close(reason)  # Goodbye

``recv`` does the housekeeping (heartbeats, liveness, re-Hello): call it at least once per
heartbeat interval. A generator that hears nothing for ``peer_timeout_s``, or gets
``ErrorMsg("hello_first")`` from a learner that does not know it (restarted), re-sends
Hello with exponential backoff until a Welcome; libzmq reconnects underneath. A malformed,
oversized, multipart or out-of-place frame is counted (``stats.rejected``), answered with
``ErrorMsg("protocol")`` and skipped; beyond limit + ``oversize_grace_bytes`` libzmq
(ZMQ_MAXMSGSIZE) drops the connection instead. A frame's body decompresses to at most the
channel's frame limit (each receiving codec's ``max_message_bytes``; a frame declaring more
is refused before anything is allocated, proto.codec), and the learner decodes at most
``STRIKE_LIMIT`` refused frames of one connection per ``STRIKE_WINDOW_S``, dropping the
rest undecoded (``stats.muted``, pipeline.net.strikes). Warnings about what a peer sends are
rate-limited (``log_interval_s``, pipeline.net.log_limit) and their arguments escaped
(pipeline.net.untrusted). What is queued from one connection is bounded in bytes
(``recv_budget_bytes``, pipeline.net.transport.config). Not thread-safe: one thread per
object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipeline.net.log_limit import RateLimitedLog, Throttle
from pipeline.net.strikes import STRIKE_LIMIT, STRIKE_WINDOW_S, Strikes
from pipeline.net.transport.config import (
    CHANNELS,
    Channel,
    ConnectTimeout,
    TransportConfig,
    TransportError,
    TransportStats,
)
from pipeline.net.untrusted import EscapeArgs
from proto.codec import Codec
from proto.errors import ProtocolError
from proto.records import (
    Ack,
    ErrorMsg,
    Goodbye,
    Heartbeat,
    Hello,
    Nack,
    Rollout,
    RolloutBatch,
    WeightAnnounce,
    WeightChunk,
    Welcome,
    WorkItem,
    WorkReturn,
)

log = logging.getLogger(__name__)
log.addFilter(EscapeArgs())  # peer ids and texts in its lines are escaped wherever they go

Clock = Callable[[], float]
Raw = tuple[Channel, str, list[bytes]]

# What each side accepts on each channel; anything else is rejected like a malformed frame.
_ACCEPTS: dict[tuple[str, Channel], tuple[type, ...]] = {
    ("learner", "control"): (
        Hello, Heartbeat, Rollout, RolloutBatch, WorkReturn, Ack, Nack, Goodbye, ErrorMsg,
    ),
    ("learner", "weights"): (Ack, Nack, ErrorMsg),
    ("generator", "control"): (Welcome, Heartbeat, WorkItem, Ack, Nack, Goodbye, ErrorMsg),
    ("generator", "weights"): (WeightAnnounce, WeightChunk, ErrorMsg),
}  # fmt: skip


@dataclass(frozen=True)
class Incoming:
    """One decoded record: the channel it came on and its sender ("learner" or a generator id)."""

    channel: Channel
    peer: str
    record: Any


class _Base:
    side = ""

    def __init__(self, config: TransportConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.stats = TransportStats()
        lim = config.recv_limit
        peer = "generator" if self.side == "learner" else "learner"
        # A body decompresses to at most the frame limit: a bomb costs what a frame may.
        self._dec = {
            ch: Codec(max_frame_bytes=lim(self.side, ch), max_message_bytes=lim(self.side, ch))
            for ch in CHANNELS
        }
        self._enc = {
            ch: Codec(
                level=config.compression_level if ch == "control" else 0,
                max_frame_bytes=lim(peer, ch),
                max_message_bytes=lim(peer, ch),
            )
            for ch in CHANNELS
        }
        self._log = RateLimitedLog(log, config.log_interval_s, clock)
        self._strikes = Strikes(clock, limit=STRIKE_LIMIT, window_s=STRIKE_WINDOW_S)
        self._mute_log = Throttle(config.log_interval_s, clock)
        self.closed = False
        self._woken = False  # set by a transport's wake_on fd: recv returns None at once

    def _strike_key(self, peer: str) -> bytes | None:
        """The connection a refused frame from ``peer`` counts against (pipeline.net.strikes),
        or None: never muted (the in-memory transport's peers live in this process; a
        generator does not mute its learner)."""
        return None

    def _warn(self, peer: str, reason: str, fmt: str, *args: Any) -> None:
        """A warning about what ``peer`` did: at most one line per (peer, reason) per
        ``log_interval_s``; the others are counted in ``stats.warnings_suppressed``."""
        if not self._log.warn(peer, reason, fmt, *args):
            self.stats.warnings_suppressed += 1

    # Provided by subclasses: frames in and out (ZMQ / memory), and the side's protocol:
    # _tick() does the housekeeping and returns the seconds until it is due again.
    _raw_send: Callable[[Channel, str, bytes], bool]
    _raw_recv: Callable[[float], Raw | None]
    _tick: Callable[[], float]
    _on_valid: Callable[[Incoming], None]

    def _send(self, channel: Channel, peer: str, record: Any) -> bool:
        if self.closed:
            raise TransportError("send on a closed transport")
        if channel not in CHANNELS:
            raise TransportError(f"unknown channel {channel!r}; use one of {CHANNELS}")
        ok = self._raw_send(channel, peer, self._enc[channel].encode(record))
        if ok:
            self.stats.sent += 1
        else:
            self.stats.unroutable += 1
        return ok

    def send_frame(
        self, frame: bytes, *, peer: str = "learner", channel: Channel = "control"
    ) -> bool:
        """Send pre-encoded bytes unchanged (forwarding, and tests of the receiving side)."""
        return self._raw_send(channel, peer, frame)

    def recv(self, timeout_s: float = 0.0) -> Incoming | None:
        """The next valid record, or None after ``timeout_s`` (0: poll once)."""
        if self.closed:
            raise TransportError("recv on a closed transport")
        end, skipped = time.monotonic() + max(0.0, timeout_s), 0
        while True:
            due = self._tick()
            raw = self._raw_recv(max(0.0, min(end - time.monotonic(), due)))
            if raw is None and self._woken:  # another thread finished work: the caller acts
                self._woken = False
                return None
            if raw is not None:
                inc = self._accept(*raw)
                if inc is not None:
                    self._on_valid(inc)
                    return inc
                skipped += 1  # past the deadline, skip at most 64 bad frames per call
            if time.monotonic() >= end and (raw is None or skipped >= 64):
                return None

    def _accept(self, channel: Channel, peer: str, parts: list[bytes]) -> Incoming | None:
        key = self._strike_key(peer)
        if key is not None and self._strikes.muted(key):  # dropped undecoded, unanswered
            self.stats.rejected += 1
            self.stats.muted += 1
            self.stats.warnings_suppressed += 1  # a warning not printed (the mute notice was)
            return None
        rec, why, kind = None, "", ""
        if len(parts) != 1:
            why, kind = f"expected 1 frame per message, got {len(parts)}", "multipart"
        else:
            try:
                rec = self._dec[channel].decode(parts[0])
            except ProtocolError as e:
                why, kind = str(e), "malformed"
        if not why and not isinstance(rec, _ACCEPTS[(self.side, channel)]):
            why = f"{type(rec).__name__} is not accepted on the {channel} channel"
            kind = "wrong channel"
        if isinstance(rec, Hello) and rec.generator_id != peer:
            why = f"hello.generator_id {rec.generator_id!r} differs from the routing id {peer!r}"
            kind = "hello id"
        if why:
            self.stats.rejected += 1
            self.stats.last_error = why
            self._warn(peer, kind, "rejected a frame from %s on %s: %s", peer, channel, why)
            self._send(channel, peer, ErrorMsg("protocol", why[:4000]))
            if key is not None and self._strikes.strike(key) and self._mute_log.allow(peer):
                log.warning(
                    "ignoring frames from %s for %.0f s: %d refused frames within %.0f s "
                    "(counted in stats.muted)",
                    peer, self._strikes.remaining_s(key), STRIKE_LIMIT, STRIKE_WINDOW_S,
                )  # fmt: skip
            return None
        self.stats.received += 1
        return Incoming(channel, peer, rec)


class LearnerEndpoint(_Base):
    """Learner side: binds both channels; peers are generators, registered by their Hello."""

    side = "learner"

    def __init__(self, config: TransportConfig, clock: Clock) -> None:
        super().__init__(config, clock)
        self._peers: dict[str, float] = {}  # registered generator -> last heard (clock)
        self._nagged: dict[str, float] = {}  # unregistered sender -> last hello_first reply
        self._next_hb = clock()
        self._status = (-1, 0)

    def send(self, peer: str, record: Any, *, channel: Channel = "control") -> bool:
        """Queue ``record`` for generator ``peer``; False if it is unknown or its queue is full."""
        return self._send(channel, peer, record)

    def set_status(self, weight_version: int, inflight: int) -> None:
        self._status = (weight_version, inflight)

    def peers(self) -> list[str]:
        """Generators registered by a Hello and not yet expired or gone."""
        return list(self._peers)

    def expired_peers(self) -> list[str]:
        """Generators silent for more than peer_timeout_s; each is returned once, then forgotten."""
        now = self.clock()
        gone = [g for g, t in self._peers.items() if now - t > self.config.peer_timeout_s]
        for g in gone:
            del self._peers[g]
        return gone

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def _tick(self) -> float:
        now = self.clock()
        if now >= self._next_hb:
            self._next_hb = now + self.config.heartbeat_interval_s
            hb = Heartbeat("learner", time.time(), *self._status)
            for g in list(self._peers):
                self._send("control", g, hb)
        return max(0.001, self._next_hb - now)

    def _on_valid(self, inc: Incoming) -> None:
        now, rec, peer = self.clock(), inc.record, inc.peer
        if isinstance(rec, Hello):
            self._peers[peer] = now
            self._nagged.pop(peer, None)
        elif isinstance(rec, Goodbye):
            self._peers.pop(peer, None)
        elif peer in self._peers:
            self._peers[peer] = now
        elif now - self._nagged.get(peer, -1e18) >= self.config.heartbeat_interval_s:
            self._nagged[peer] = now  # a generator we do not know (we restarted?): ask for Hello
            self._send(inc.channel, peer, ErrorMsg("hello_first", "unknown generator: send Hello"))


class GeneratorConnection(_Base):
    """Generator side: connects both channels; ``ready`` once a Welcome answered our Hello."""

    side = "generator"

    def __init__(self, config: TransportConfig, hello: Hello, clock: Clock) -> None:
        gid = hello.generator_id
        if not gid or len(gid.encode()) > 255 or gid.startswith("\0"):
            raise TransportError(
                f"generator id {gid!r} must be 1..255 bytes, not starting with NUL"
            )
        super().__init__(config, clock)
        self.hello = hello
        self.welcome: Welcome | None = None
        self.ready = False
        now = clock()
        self._last_heard = now
        self._retry = config.hello_retry_s
        self._next_hello = now
        self._interval = config.heartbeat_interval_s
        self._timeout = config.peer_timeout_s
        self._next_hb = now
        self._inflight = 0
        self._connect_deadline: float | None = None
        self._next_report: float | None = None  # None: not watching (see watch_connect)
        self._report_every = 5.0
        self._started = now
        self.target = "the learner"
        self._hint = ""

    @property
    def generator_id(self) -> str:
        return self.hello.generator_id

    def watch_connect(self, timeout_s: float, target: str, hint: str = "") -> None:
        """Until the first Welcome: log one line naming ``target`` every few seconds (with
        ``hint``, a likely cause), and raise ConnectTimeout from ``recv`` after ``timeout_s``
        (0: wait forever). Later silences re-Hello forever (a learner may be restarting)."""
        now = self.clock()
        self._started, self.target, self._hint = now, target, hint
        self._connect_deadline = now + timeout_s if timeout_s > 0 else None
        self._report_every = min(5.0, max(1.0, timeout_s / 4)) if timeout_s > 0 else 5.0
        self._next_report = now + self._report_every

    def no_answer(self) -> str:
        """Why we are still waiting: the target, for how long, the last error and the hint."""
        waited = self.clock() - self._started
        why = self.stats.last_error or "no reply to Hello"
        return f"no answer from {self.target} after {waited:.0f}s ({why}){self._hint}"

    def send(self, record: Any, *, channel: Channel = "control") -> bool:
        """Queue ``record`` for the learner (queued while it is away, up to hwm)."""
        return self._send(channel, "learner", record)

    def set_status(self, weight_version: int, inflight: int) -> None:
        self.hello = replace(self.hello, weight_version=weight_version)
        self._inflight = inflight

    def _rehello(self, why: str) -> None:
        log.warning("generator %s: %s; sending Hello again", self.generator_id, why)
        self.ready = False
        self.stats.reconnects += 1
        self._retry = self.config.hello_retry_s
        self._next_hello = self.clock()

    def _tick(self) -> float:
        now = self.clock()
        if self.welcome is None and self._next_report is not None:
            if self._connect_deadline is not None and now >= self._connect_deadline:
                raise ConnectTimeout(f"generator {self.generator_id}: {self.no_answer()}")
            if now >= self._next_report:
                log.warning("generator %s: %s; still trying", self.generator_id, self.no_answer())
                self._next_report = now + self._report_every
        if self.ready and now - self._last_heard > self._timeout:
            self._rehello(f"learner silent for {now - self._last_heard:.1f}s")
        if not self.ready and now >= self._next_hello:
            self._send("control", "learner", self.hello)
            self._next_hello = now + self._retry
            self._retry = min(2 * self._retry, self.config.hello_retry_max_s)
        if self.ready and now >= self._next_hb:
            v = self.hello.weight_version
            self._send(
                "control", "learner", Heartbeat(self.generator_id, time.time(), v, self._inflight)
            )
            self._next_hb = now + self._interval
        nxt = self._next_hb if self.ready else self._next_hello
        if self.ready:
            nxt = min(nxt, self._last_heard + self._timeout)
        elif self.welcome is None and self._next_report is not None:
            nxt = min(nxt, self._next_report, self._connect_deadline or nxt)
        return max(0.001, nxt - now)

    def _on_valid(self, inc: Incoming) -> None:
        now, rec = self.clock(), inc.record
        self._last_heard = now
        if isinstance(rec, Welcome):
            self.welcome, self.ready = rec, True
            self._interval = rec.heartbeat_interval_s
            self._timeout = max(self.config.peer_timeout_s, 3 * rec.heartbeat_interval_s)
            self._next_hb = now + self._interval
        elif isinstance(rec, ErrorMsg) and rec.code == "hello_first" and self.ready:
            self._rehello("the learner does not know us")
        elif isinstance(rec, Goodbye):
            self.ready = False
            self._next_hello = now + self.config.hello_retry_s
