"""ZMQ implementation of pipeline.net.transport.session (tcp, ipc or inproc; CURVE via pipeline.net.security).

Sockets: two ROUTERs bound by the learner (control, weights) with ROUTER_MANDATORY (a send
to an unknown or full peer fails instead of vanishing) and ROUTER_HANDOVER (a reconnecting
generator takes its routing id back); two DEALERs per generator with RECONNECT_IVL /
RECONNECT_IVL_MAX. Every socket sets SNDHWM = hwm, RCVHWM = ``config.rcvhwm(...)`` (the
per-connection byte budget), MAXMSGSIZE = the channel's frame limit + grace, TCP keepalive
and TCP_MAXRT instead of ZMTP heartbeats (dead tcp connections are noticed and
re-established; ZMTP heartbeats abort a process paused past the timeout, see ``_socket``)
and a monitor that counts refused handshakes and disconnects. See pipeline.net.transport.session for the order of calls.

Routing id = ``generator_id + NUL + nonce`` (8 random bytes per connection object, the
same on both sockets). The learner strips the nonce (``peer`` is the generator id) and
routes a generator's traffic to the routing id of its newest valid frame. The nonce keeps
a second connection claiming the same id from colliding with (ROUTER_HANDOVER: taking over)
a live one; on CURVE sockets every frame must also come from a key that owns the id it
claims (ZAP User-Id, pipeline.net.security.owns), or it is refused, counted
(``stats.wrong_identity``) and dropped. So a generator holding one allowed key can neither
impersonate another nor take its connection; its own reconnects still hand over.

The learner counts refused frames per routing id (pipeline.net.strikes): a connection with
too many has its frames dropped undecoded for a while. A routing id is any bytes (non-UTF-8
ones decoded with surrogateescape): the transport's log lines escape it
(pipeline.net.untrusted).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from pipeline.net.security import ClientCurve, ServerCurve, check_bind, owns
from pipeline.net.transport.config import CHANNELS, Channel, TransportConfig, TransportError
from pipeline.net.transport.session import (
    Clock,
    GeneratorConnection,
    Incoming,
    LearnerEndpoint,
    Raw,
    _Base,
)
from proto.records import Goodbye, Hello

log = logging.getLogger(__name__)


_DISCONNECTED, _FAILED_AUTH = 0x0200, 0x4000
_MON_EVENTS = _DISCONNECTED | 0x0800 | 0x2000 | _FAILED_AUTH  # + HANDSHAKE_FAILED_{ANY,PROTO}
NONCE_BYTES = 8
MAX_ID_BYTES = 255 - 1 - NONCE_BYTES  # a ZMQ routing id is at most 255 bytes


def split_routing_id(rid: bytes) -> str:
    """The generator id a routing id claims (``id + NUL + nonce``, or a bare id)."""
    if len(rid) > NONCE_BYTES + 1 and rid[-NONCE_BYTES - 1] == 0:
        rid = rid[: -NONCE_BYTES - 1]
    return rid.decode("utf-8", "surrogateescape")


class _Wake:
    """A non-blocking pipe: calling it writes a byte (never blocks; a full pipe is a pending
    wake already), ``drain`` empties it, ``close`` closes both ends (under a lock, so a late
    caller never writes to a descriptor number the process has reused)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self.w >= 0:
                try:
                    os.write(self.w, b"\0")
                except OSError:  # full: a wake is pending anyway
                    pass

    def drain(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except OSError:  # empty
            pass

    def close(self) -> None:
        with self._lock:
            if self.w >= 0:
                os.close(self.r)
                os.close(self.w)
                self.r = self.w = -1


class _ZmqMixin(_Base):
    """Polling both sockets: at most one message per channel waits in ``_pending`` (it is
    refilled only when empty), so the transport itself holds at most two frames."""

    def _setup_zmq(self, context: zmq.Context | None) -> None:
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._socks: dict[Channel, zmq.Socket] = {}
        self._zap: set[zmq.Socket] = set()  # CURVE server sockets: frames carry a ZAP User-Id
        self._mons: dict[zmq.Socket, bool] = {}  # monitor socket -> its socket uses CURVE
        self._poller = zmq.Poller()
        self._pending: deque[tuple[Raw, bytes]] = deque()  # (message, its routing id)
        self._cur_rid = b""  # routing id of the message being handled
        self._rr = 0
        self._wake: _Wake | None = None  # waker(): a pipe whose write ends a recv's wait

    def waker(self) -> Callable[[], None]:
        """A function any thread may call to end this transport's ``recv`` wait at once (it
        returns None): a thread that finished work the receiving loop waits for (a batch, a
        weight load, a training step, a publication) wakes it instead of the loop noticing
        at its next poll timeout. One pipe per transport, closed with it; a call after the
        close does nothing."""
        if self._wake is None:
            self._wake = _Wake()
            self._poller.register(self._wake.r, zmq.POLLIN)
        return self._wake

    def _socket(
        self, channel: Channel, kind: int, curve: Callable[[zmq.Socket], None] | None
    ) -> zmq.Socket:
        cfg = self.config
        s = self._ctx.socket(kind)
        s.linger = cfg.linger_ms
        s.sndhwm = cfg.hwm
        s.rcvhwm = cfg.rcvhwm(self.side, channel)
        s.maxmsgsize = cfg.recv_limit(self.side, channel) + cfg.oversize_grace_bytes
        # No ZMTP heartbeats (the session protocol has its own, pipeline.net.transport.session): in
        # libzmq 4.3.5 a heartbeat timer that fires on a connection whose peer hung up while
        # its receive pipe was full (RCVHWM reached: a process paused, or busy, not reading)
        # writes to it and aborts the process (Assertion failed: !_io_error,
        # stream_engine_base.cpp:310; tests/pipeline/test_pause.py). Dead connections are
        # noticed by TCP instead: keepalive probes after peer_timeout_s of silence, and
        # unacknowledged data for peer_timeout_s (TCP_MAXRT, Linux TCP_USER_TIMEOUT).
        s.heartbeat_ivl = 0
        s.tcp_keepalive = 1
        s.tcp_keepalive_idle = max(1, round(cfg.peer_timeout_s))
        s.tcp_keepalive_intvl = max(1, round(cfg.heartbeat_interval_s))
        s.tcp_keepalive_cnt = 3
        s.tcp_maxrt = max(1000, int(cfg.peer_timeout_s * 1000))
        if curve is not None:
            curve(s)
            if self.side == "learner":
                self._zap.add(s)
        mon = s.get_monitor_socket(_MON_EVENTS)
        self._mons[mon] = curve is not None
        self._poller.register(mon, zmq.POLLIN)
        self._poller.register(s, zmq.POLLIN)
        self._socks[channel] = s
        return s

    def _event(self, mon: zmq.Socket) -> None:
        ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
        if ev == _DISCONNECTED:
            self.stats.disconnects += 1
        else:  # a failed handshake: on a CURVE socket, an unauthenticated peer
            if self._mons[mon] or ev == _FAILED_AUTH:
                self.stats.unauthenticated += 1
            else:
                self.stats.rejected += 1  # not ZMTP at all (a port scan, an HTTP request...)
            self.stats.last_error = f"refused a handshake (zmq event 0x{ev:x})"
            self._warn("?", f"handshake 0x{ev:x}", "refused a handshake (zmq event 0x%x)", ev)

    def _raw_recv(self, timeout_s: float) -> Raw | None:
        if not self._pending:
            ready = dict(self._poller.poll(int(timeout_s * 1000 + 0.999)))
            if self._wake is not None and self._wake.r in ready:
                self._wake.drain()
                self._woken = True
            for mon in self._mons:
                while mon in ready and mon.poll(0):
                    self._event(mon)
            order = CHANNELS if self._rr % 2 == 0 else CHANNELS[::-1]
            self._rr += 1
            for ch in order:  # one message per channel per round: neither starves the other
                s = self._socks[ch]
                if s in ready:
                    frames = s.recv_multipart(copy=False)
                    user = str(frames[-1].get("User-Id")) if s in self._zap else None
                    msg = self._split(ch, [f.bytes for f in frames], user)
                    if msg is not None:
                        self._pending.append(msg)
        if not self._pending:
            return None
        raw, self._cur_rid = self._pending.popleft()
        return raw

    def _split(
        self, channel: Channel, parts: list[bytes], user: str | None
    ) -> tuple[Raw, bytes] | None:
        """(message, its routing id), or None for a message refused before decoding."""
        raise NotImplementedError

    def _send_parts(self, channel: Channel, parts: list[bytes]) -> bool:
        try:
            self._socks[channel].send_multipart(parts, zmq.NOBLOCK, copy=len(parts[-1]) < 65536)
            return True
        except zmq.Again:  # the peer's queue is full (hwm)
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: no such peer connected
                return False
            raise

    def _close_zmq(self, linger_ms: int) -> None:
        for s in self._socks.values():
            s.disable_monitor()
        for m in self._mons:
            m.close(0)
        for s in self._socks.values():
            s.close(linger_ms)
        self._socks.clear()
        self._mons.clear()
        if self._wake is not None:
            self._poller.unregister(self._wake.r)
            self._wake.close()

    def _term(self) -> None:
        if self._own_ctx:
            self._ctx.term()


class ZmqLearnerEndpoint(_ZmqMixin, LearnerEndpoint):
    """Binds ``control`` and ``weights`` (e.g. "tcp://10.0.0.5:5555"; port "*" picks a free
    one, see ``.endpoints``). Non-loopback addresses need ``security`` or ``insecure=True``."""

    def __init__(
        self,
        config: TransportConfig,
        *,
        control: str,
        weights: str,
        security: ServerCurve | None = None,
        insecure: bool = False,
        context: zmq.Context | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        LearnerEndpoint.__init__(self, config, clock)
        self._routes: dict[str, bytes] = {}  # generator id -> routing id of its newest frame
        self._replying: str | None = None
        binds: dict[Channel, str] = {"control": control, "weights": weights}
        curves = {ch: check_bind(ep, security, insecure=insecure) for ch, ep in binds.items()}
        self._setup_zmq(context)
        self._security = security if any(curves.values()) else None
        self.endpoints: dict[Channel, str] = {}
        try:
            if self._security is not None:
                self._security.start(self._ctx)
            for ch, ep in binds.items():
                apply = self._security.apply if self._security and curves[ch] else None
                s = self._socket(ch, zmq.ROUTER, apply)
                s.router_mandatory = 1
                s.router_handover = 1
                s.bind(ep)
                self.endpoints[ch] = str(s.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            self.close()
            raise

    def _split(
        self, channel: Channel, parts: list[bytes], user: str | None
    ) -> tuple[Raw, bytes] | None:
        rid, peer = parts[0], split_routing_id(parts[0])
        if user is not None and not owns(user, peer):  # CURVE: the key must own the id
            self.stats.wrong_identity += 1
            why = f"the CURVE key {user!r} does not own generator id {peer!r}"
            self.stats.last_error = why
            self._warn(peer, f"identity {user}", "refused frames on %s: %s", channel, why)
            return None
        return (channel, peer, parts[1:]), rid

    def _strike_key(self, peer: str) -> bytes | None:
        return self._cur_rid  # the connection (its nonce): an impostor cannot mute the real one

    def _accept(self, channel: Channel, peer: str, parts: list[bytes]) -> Incoming | None:
        self._replying = peer  # replies to this frame go back to the connection it came on
        try:
            inc = super()._accept(channel, peer, parts)
        finally:
            self._replying = None
        if inc is not None:
            self._routes[peer] = self._cur_rid  # traffic for peer follows its newest frame
        return inc

    def _raw_send(self, channel: Channel, peer: str, frame: bytes) -> bool:
        if peer == self._replying:
            rid = self._cur_rid
        else:
            rid = self._routes.get(peer) or peer.encode("utf-8", "surrogateescape")
        return self._send_parts(channel, [rid, frame])

    def forget(self, peer: str) -> None:
        super().forget(peer)
        self._routes.pop(peer, None)

    def expired_peers(self) -> list[str]:
        gone = super().expired_peers()
        for g in gone:
            self._routes.pop(g, None)
        return gone

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_zmq(0)
        if self._security is not None:
            self._security.stop()  # after the sockets that talk to it, before the context
        self._term()


class ZmqGeneratorConnection(_ZmqMixin, GeneratorConnection):
    """Connects to the learner's ``control`` and ``weights`` endpoints and sends Hello."""

    def __init__(
        self,
        config: TransportConfig,
        hello: Hello,
        *,
        control: str,
        weights: str,
        security: ClientCurve | None = None,
        context: zmq.Context | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        GeneratorConnection.__init__(self, config, hello, clock)
        gid = self.generator_id
        if len(gid.encode()) > MAX_ID_BYTES:
            raise TransportError(f"generator id {gid!r} is over {MAX_ID_BYTES} bytes")
        if security is not None and security.name and not owns(security.name, gid):
            raise TransportError(
                f"generator id {gid!r} does not belong to CURVE key {security.name!r}: the "
                f"learner would refuse it; use {security.name!r} or '{security.name}:SUFFIX'"
            )
        rid = gid.encode() + b"\0" + os.urandom(NONCE_BYTES)
        self._setup_zmq(context)
        try:
            for ch, ep in (("control", control), ("weights", weights)):
                curve = security.apply if security is not None and security.wants(ep) else None
                s = self._socket(ch, zmq.DEALER, curve)  # type: ignore[arg-type]
                s.routing_id = rid
                s.reconnect_ivl = config.reconnect_ivl_ms
                s.reconnect_ivl_max = config.reconnect_ivl_max_ms
                s.connect(ep)
        except BaseException:
            self.close(None)
            raise
        self._tick()  # sends the first Hello

    def _split(
        self, channel: Channel, parts: list[bytes], user: str | None
    ) -> tuple[Raw, bytes] | None:
        return (channel, "learner", parts), b""

    def _raw_send(self, channel: Channel, peer: str, frame: bytes) -> bool:
        return self._send_parts(channel, [frame])

    def close(self, reason: str | None = "shutdown") -> None:
        """Send Goodbye(reason) (None: don't), wait up to linger_ms to flush it, release."""
        if self.closed:
            return
        if reason is not None and "control" in self._socks:
            self._send("control", "learner", Goodbye(self.generator_id, reason))
        self.closed = True
        self._close_zmq(self.config.linger_ms)
        self._term()
