"""In-memory implementation of the two channels (pipeline.net.transport.session): the same frames, the
same codec checks and the same session protocol, with bounded queues instead of sockets. It
drives the fast coordinator and generator-loop tests; ``MemoryNetwork`` stands for the
addresses::

    net = MemoryNetwork()
    ep = net.bind("learner", config)                 # a LearnerEndpoint
    conn = net.connect("learner", hello, config)     # a GeneratorConnection (sends Hello)
"""

from __future__ import annotations

import threading
import time
from collections import deque

from pipeline.net.transport.config import Channel, TransportConfig, TransportError
from pipeline.net.transport.session import Clock, GeneratorConnection, LearnerEndpoint, Raw
from proto.records import Goodbye, Hello


class _Box:
    """A bounded, thread-safe FIFO of raw messages: at most ``cap`` messages, and at most
    ``budget`` bytes from one sender (a first message may exceed it alone, as one frame
    being decoded does in libzmq; None: no byte bound)."""

    def __init__(self, cap: int, budget: int | None = None) -> None:
        self.cap, self.budget = cap, budget
        self.q: deque[Raw] = deque()
        self.held: dict[str, int] = {}  # sender -> bytes queued
        self.cv = threading.Condition()

    def put(self, item: Raw) -> bool:
        n, peer = sum(len(p) for p in item[2]), item[1]
        with self.cv:
            held = self.held.get(peer, 0)
            if len(self.q) >= self.cap or (self.budget and held and held + n > self.budget):
                return False
            self.q.append(item)
            self.held[peer] = held + n
            self.cv.notify()
            return True

    def get(self, timeout_s: float) -> Raw | None:
        with self.cv:
            if not self.q and timeout_s > 0:
                self.cv.wait_for(lambda: bool(self.q), timeout_s)
            if not self.q:
                return None
            item = self.q.popleft()
            left = self.held.pop(item[1]) - sum(len(p) for p in item[2])
            if left:
                self.held[item[1]] = left
            return item


class MemoryNetwork:
    """Named in-process 'addresses': ``bind(name)`` a learner, ``connect(name, hello)`` generators.

    A generator whose learner is away queues its frames (up to hwm) and they are delivered
    when a learner binds the name again, as libzmq does for a connecting DEALER.
    """

    def __init__(self) -> None:
        self._bound: dict[str, MemoryLearnerEndpoint] = {}
        self._conns: dict[str, list[MemoryGeneratorConnection]] = {}
        self._lock = threading.Lock()

    def bind(
        self, name: str, config: TransportConfig | None = None, *, clock: Clock = time.monotonic
    ) -> MemoryLearnerEndpoint:
        with self._lock:
            if name in self._bound:
                raise TransportError(f"address {name!r} is already bound")
            ep = MemoryLearnerEndpoint(self, name, config or TransportConfig(), clock)
            self._bound[name] = ep
            conns = list(self._conns.get(name, ()))
        for c in conns:
            c._flush()
        return ep

    def connect(
        self,
        name: str,
        hello: Hello,
        config: TransportConfig | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> MemoryGeneratorConnection:
        conn = MemoryGeneratorConnection(self, name, hello, config or TransportConfig(), clock)
        with self._lock:
            self._conns.setdefault(name, []).append(conn)
        conn._start()
        return conn

    def _route(self, name: str, gid: str) -> MemoryGeneratorConnection | None:
        with self._lock:  # the newest connection with this id wins (ROUTER_HANDOVER)
            live = [c for c in self._conns.get(name, ()) if c.generator_id == gid]
            return live[-1] if live else None

    def _endpoint(self, name: str) -> MemoryLearnerEndpoint | None:
        with self._lock:
            return self._bound.get(name)

    def _unbind(self, name: str, ep: MemoryLearnerEndpoint) -> None:
        with self._lock:
            if self._bound.get(name) is ep:
                del self._bound[name]

    def _disconnect(self, name: str, conn: MemoryGeneratorConnection) -> None:
        with self._lock:
            if conn in self._conns.get(name, []):
                self._conns[name].remove(conn)


class MemoryLearnerEndpoint(LearnerEndpoint):
    def __init__(self, net: MemoryNetwork, name: str, config: TransportConfig, clock: Clock):
        super().__init__(config, clock)
        self._net, self.name = net, name
        self.inbox = _Box(2 * config.hwm, config.recv_budget_bytes)

    def _raw_send(self, channel: Channel, peer: str, frame: bytes) -> bool:
        conn = self._net._route(self.name, peer)
        return conn is not None and conn.inbox.put((channel, "learner", [bytes(frame)]))

    def _raw_recv(self, timeout_s: float) -> Raw | None:
        return self.inbox.get(timeout_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._net._unbind(self.name, self)


class MemoryGeneratorConnection(GeneratorConnection):
    def __init__(
        self, net: MemoryNetwork, name: str, hello: Hello, config: TransportConfig, clock: Clock
    ):
        super().__init__(config, hello, clock)
        self._net, self.name = net, name
        self.inbox = _Box(2 * config.hwm)
        self._outbox: deque[Raw] = deque()
        self._lock = threading.Lock()

    def _start(self) -> None:
        self._tick()  # sends the first Hello

    def _flush(self) -> None:
        with self._lock:
            ep = self._net._endpoint(self.name)
            while ep is not None and self._outbox and ep.inbox.put(self._outbox[0]):
                self._outbox.popleft()

    def _raw_send(self, channel: Channel, peer: str, frame: bytes) -> bool:
        self._flush()
        with self._lock:
            ep = self._net._endpoint(self.name)
            item: Raw = (channel, self.generator_id, [bytes(frame)])
            if not self._outbox and ep is not None:
                return ep.inbox.put(item)
            if len(self._outbox) >= self.config.hwm:
                return False
            self._outbox.append(item)
            return True

    def _raw_recv(self, timeout_s: float) -> Raw | None:
        return self.inbox.get(timeout_s)

    def close(self, reason: str = "shutdown") -> None:
        if not self.closed:
            self._send("control", "learner", Goodbye(self.generator_id, reason))
            self.closed = True
            self._net._disconnect(self.name, self)
