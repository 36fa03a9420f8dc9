"""A one-thread work lane: the generator loop runs its engine calls and its reward scoring each
on one (generator.loop), so calls of one kind run in submission order, off the loop's thread.

Loop: ``submit(fn)`` queues ``fn`` and returns its Future; the lane's daemon thread runs the
queued calls one at a time, in order, sets each Future's result or exception, then calls
``on_done`` (the loop's connection waker). Invariant: at most one call of a lane runs at a time,
and a call starts only after every call submitted before it finished. ``inline=True`` runs each
call at submit (no thread: tests, and loops without threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any


class Lane:
    """One daemon thread running submitted calls in order (inline=True: run at submit)."""

    def __init__(self, name: str, inline: bool, on_done: Callable[[], None] | None = None) -> None:
        """``on_done``: called on the lane's thread after each call (a thread lane only): the
        loop's connection waker, so the loop acts on a result at once."""
        self.inline = inline
        self._on_done = None if inline else on_done
        self._q: SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = SimpleQueue()
        if not inline:
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        if self.inline:
            self._run(fut, fn)
        else:
            self._q.put((fut, fn))
        return fut

    @staticmethod
    def _run(fut: Future[Any], fn: Callable[[], Any]) -> None:
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the loop thread, which decides
            fut.set_exception(e)

    def _work(self) -> None:
        while (job := self._q.get()) is not None:
            self._run(*job)
            if self._on_done is not None:
                self._on_done()

    def close(self) -> None:
        if not self.inline:
            self._q.put(None)
