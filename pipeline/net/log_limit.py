"""Rate-limited warnings: what a misbehaving peer sends must not flood the log.

Loop: ``warn(peer, reason, fmt, *args)`` for every refused frame; a (peer, reason) pair
logs at most one line per ``interval_s``, and that line says how many like it were
suppressed since the previous one. Invariant: lines per pair <= 1 + elapsed / interval_s,
and every suppressed warning is counted (``suppressed``, and in the pair's next line).
At most ``max_keys`` pairs are remembered (a peer can invent ids): beyond that the oldest
are forgotten, which can only let a line through early, never hide one for good. The
arguments are the peer's text: they are escaped (pipeline.net.untrusted.escape_args), so a
warning is one line whatever the peer sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pipeline.net.untrusted import escape_args


class Throttle:
    """At most one ``allow(key)`` True per ``interval_s`` per key (Hellos per generator id,
    claim warnings); ``reset(key)`` forgets one. At most ``max_keys`` keys are remembered (the
    oldest forgotten first), which can only let one through early."""

    def __init__(self, interval_s: float, clock: Callable[[], float], *,
                 max_keys: int = 4096) -> None:  # fmt: skip
        self.interval_s, self.clock, self.max_keys = interval_s, clock, max_keys
        self._last: dict[str, float] = {}

    def allow(self, key: str) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last.pop(key, None)
        self._last[key] = now
        while len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        return True

    def reset(self, key: str) -> None:
        self._last.pop(key, None)


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float],
        *,
        max_keys: int = 4096,
    ) -> None:
        self.logger, self.interval_s, self.clock, self.max_keys = (
            logger,
            interval_s,
            clock,
            max_keys,
        )
        self.suppressed = 0  # warnings not printed, all pairs together
        self._keys: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last line, suppressed)

    def warn(self, peer: str, reason: str, fmt: str, *args: Any) -> bool:
        """Log ``fmt % args`` (escaped) unless (peer, reason) logged within interval_s; True
        if logged."""
        now, key = self.clock(), (peer, reason)
        last, held = self._keys.get(key, (None, 0))
        if last is not None and now - last < self.interval_s:
            self._keys[key] = (last, held + 1)
            self.suppressed += 1
            return False
        if held:
            fmt += " (%d more from %s (%s) suppressed in the last %.0fs)"
            args = (*args, held, peer, reason, now - (last or now))
        self._keys.pop(key, None)  # re-insert: the dict stays ordered by last line
        self._keys[key] = (now, 0)
        while len(self._keys) > self.max_keys:
            del self._keys[next(iter(self._keys))]
        self.logger.warning(fmt, *escape_args(args))
        return True
