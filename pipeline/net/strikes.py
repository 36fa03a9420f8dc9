"""Refused frames per connection: a connection that keeps sending frames the learner refuses
gets its frames dropped undecoded for a while.

Each frame costs its receiver a decode of at most the channel's frame limit (a compressed
frame is refused before decompression when it declares more, proto.codec). What one
connection can make the learner decode in vain is bounded here: loop, for every frame of
connection ``key``: ``muted(key)`` first (True: drop it undecoded, unanswered), else decode
it, and ``strike(key)`` if it was refused. A key's window opens at its first strike and
lasts ``window_s``; its ``limit``-th strike within the window mutes it until the window
closes; the next strike opens a new window. Invariant: at most ``limit`` refused frames of
one key are decoded per ``window_s`` (so at most ``limit`` x the frame limit decompressed
bytes), whatever it sends; frames it sends while muted cost a receive and a dict lookup.
Honest peers send no refused frames and are never muted; a muted key never affects another.

The key is the connection's routing id (generator id + a random nonce,
pipeline.net.transport.zmq): a peer claiming a generator's id cannot get that generator
muted; a new connection starts a new count, at the price of a TCP (+ CURVE) handshake. At
most ``max_keys`` keys are remembered (the oldest forgotten first), which can only give a
connection its ``limit`` decodes early, never mute one.
"""

from __future__ import annotations

from collections.abc import Callable

STRIKE_LIMIT = 8
"""Refused frames of one connection decoded per window; the next ones are dropped undecoded."""
STRIKE_WINDOW_S = 10.0
"""Length of a connection's window (s), from its first refused frame."""


class Strikes:
    """Refused frames per key within a window; ``muted(key)`` once ``limit`` of them."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        limit: int = STRIKE_LIMIT,
        window_s: float = STRIKE_WINDOW_S,
        max_keys: int = 4096,
    ) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError(f"need limit >= 1 and window_s > 0, got {limit}, {window_s}")
        self.clock, self.limit, self.window_s, self.max_keys = clock, limit, window_s, max_keys
        self._windows: dict[bytes, tuple[float, int]] = {}  # key -> (window start, strikes)

    def _current(self, key: bytes) -> tuple[float, int] | None:
        got = self._windows.get(key)
        if got is not None and self.clock() - got[0] >= self.window_s:
            del self._windows[key]
            return None
        return got

    def muted(self, key: bytes) -> bool:
        """Whether ``key``'s frames are to be dropped undecoded now."""
        got = self._current(key)
        return got is not None and got[1] >= self.limit

    def strike(self, key: bytes) -> bool:
        """Count a refused frame of ``key``; True if it mutes the key (once per window)."""
        start, n = self._current(key) or (self.clock(), 0)
        self._windows.pop(key, None)  # re-insert: the dict stays ordered by last strike
        self._windows[key] = (start, n + 1)
        while len(self._windows) > self.max_keys:
            del self._windows[next(iter(self._windows))]
        return n + 1 == self.limit

    def remaining_s(self, key: bytes) -> float:
        """Seconds until ``key``'s window closes (0 if it has none)."""
        got = self._current(key)
        return 0.0 if got is None else max(0.0, got[0] + self.window_s - self.clock())
