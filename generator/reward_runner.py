"""Running reward functions safely: per-call timeouts, error capture, worker recycling.

:class:`RewardRunner` calls a reward (generator.rewards) in worker processes (default; a
worker that runs past its timeout is killed and replaced, so a hung reward never blocks
later calls), in threads (cheaper; a timed-out thread is abandoned, not stopped) or inline
(no timeout). A call that raises, times out, returns something that is not a finite number
or kills its worker yields ``RewardResult(reward=None, info={"error": ..., "kind": ...})``
with kind ``exception``, ``timeout``, ``invalid`` or ``crash``; the runner itself only
raises :class:`generator.rewards.RewardError`, for bad settings or a reward that cannot be
loaded. ``python -m generator.reward_runner [CALLS]`` prints the per-call overhead of each
mode as one JSON line (docs/REWARDS.md).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from generator.rewards import RewardError, RewardFn, Scalar, Task, resolve_reward

log = logging.getLogger(__name__)

MODES = ("process", "thread", "inline")
CHUNK = 16  # the most calls handed to one worker at once (balance vs per-message cost)


@dataclass(frozen=True)
class RewardResult:
    """One scored completion: reward None on failure; info the function's scalars, or
    {"error": text, "kind": "exception" | "timeout" | "invalid" | "crash" | "remote"}; elapsed_s the
    call's wall time (s) as the runner saw it."""

    reward: float | None
    info: Task = field(default_factory=dict)
    elapsed_s: float = 0.0


Call = tuple[str, list[int], Task]
_Outcome = tuple[float | None, Task]


def _failure(kind: str, error: str) -> _Outcome:
    return None, {"error": error[:2000], "kind": kind}


def _scalar(v: Any) -> Scalar:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if hasattr(v, "item") and callable(v.item):  # numpy / torch scalars
        try:
            item = v.item()
            if item is None or isinstance(item, bool | int | float | str):
                return item  # type: ignore[no-any-return]
        except Exception:  # not a one-element array: fall through to text
            pass
    return str(v)[:2000]


def invoke(fn: RewardFn, text: str, tokens: list[int], task: Task) -> _Outcome:
    """Call ``fn`` and check its result; never raises (except KeyboardInterrupt)."""
    try:
        out = fn(text, tokens, task)
    except (Exception, SystemExit) as e:  # e.reward_kind: e.g. "remote" (remote_reward)
        return _failure(getattr(e, "reward_kind", "exception"), f"{type(e).__name__}: {e}")
    info: Any = {}
    if isinstance(out, tuple) and len(out) == 2:
        out, info = out
    if isinstance(out, bool) or not isinstance(out, int | float) and not hasattr(out, "item"):
        return _failure("invalid", f"reward returned {type(out).__name__}, expected a float")
    try:
        value = float(out)
    except (TypeError, ValueError) as e:
        return _failure("invalid", f"reward returned {out!r}: {e}")
    if not math.isfinite(value):
        return _failure("invalid", f"reward returned {value}, expected a finite float")
    if not isinstance(info, dict):
        return _failure("invalid", f"reward info is a {type(info).__name__}, expected a dict")
    return value, {str(k): _scalar(v) for k, v in info.items()}


def _worker_main(conn: Connection, path: str) -> None:
    """Reward worker process: resolve ``path``, then answer calls until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    try:
        fn = resolve_reward(path)
        warm = getattr(fn, "warm_up", None)  # e.g. the math reward imports math-verify
        if callable(warm):
            warm()
    except Exception as e:
        conn.send(("fatal", str(e)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            calls = conn.recv()
        except (EOFError, OSError):
            return
        if calls is None:
            return
        for c in calls:  # a chunk of calls: one answer per call, as each finishes
            conn.send(("done", invoke(fn, *c)))


class RewardRunner:
    """Scores completions with one reward function under a per-call timeout.

    mode "process": ``workers`` spawned processes (the reward runs in a clean interpreter,
      never a fork of the vLLM process; a reward function's optional ``warm_up()`` attribute
      runs there before the worker reports ready, so that no call's timeout pays for
      imports); a call past ``timeout_s`` kills its worker, which is
      replaced while the others keep serving. Calls and results cross a local pipe (pickle,
      between our own processes only).
    mode "thread": ``workers`` calls at once in daemon threads; a timed-out thread cannot be
      stopped: it is abandoned (counted in ``stats["abandoned"]``) and keeps running.
    mode "inline": calls run in the caller's thread with no timeout (tests, trusted rewards).

    ``score_many`` runs calls concurrently and returns results in call order. Not
    thread-safe: use one runner per thread. ``close()`` stops the workers.
    """

    def __init__(
        self,
        reward: str | RewardFn,
        *,
        timeout_s: float = 10.0,
        workers: int = 2,
        mode: str = "process",
        start_timeout_s: float = 60.0,
    ) -> None:
        if mode not in MODES:
            raise RewardError(f"reward mode {mode!r} must be one of {MODES}")
        if not timeout_s > 0 or workers < 1:
            raise RewardError(f"need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        if mode == "process" and not isinstance(reward, str):
            raise RewardError("mode 'process' needs the reward as a dotted path, not a callable")
        self.fn = resolve_reward(reward) if isinstance(reward, str) else reward
        self.path = reward if isinstance(reward, str) else getattr(reward, "__qualname__", "?")
        self.mode, self.timeout_s, self.workers = mode, timeout_s, workers
        self.start_timeout_s = start_timeout_s
        self.stats: dict[str, int] = dict.fromkeys(
            ("calls", "failed", "timeouts", "recycled", "abandoned"), 0
        )
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = [None] * workers
        self._conns: list[Connection | None] = [None] * workers
        self._q: queue.SimpleQueue[tuple[int, int, _Outcome]] = queue.SimpleQueue()
        self._gen = [0] * workers  # thread mode: results of an abandoned generation are ignored
        self._closed = False
        if mode == "process":
            for i in range(workers):
                self._spawn(i)
            for i in range(workers):
                self._await_ready(i)

    # -- process workers
    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(
            target=_worker_main, args=(child, self.path), daemon=True, name=f"reward-{i}"
        )
        p.start()
        child.close()
        self._procs[i], self._conns[i] = p, parent

    def _await_ready(self, i: int) -> None:
        conn = self._conns[i]
        assert conn is not None
        if not conn.poll(self.start_timeout_s):
            self._kill(i)
            raise RewardError(f"reward worker did not start within {self.start_timeout_s}s")
        try:
            kind, msg = conn.recv()
        except EOFError:
            kind, msg = "fatal", "reward worker exited while starting"
        if kind != "ready":
            self._kill(i)
            raise RewardError(f"reward worker for {self.path!r} could not start: {msg}")

    def _kill(self, i: int) -> None:
        p, conn = self._procs[i], self._conns[i]
        if conn is not None:
            conn.close()
        if p is not None and p.is_alive():
            p.kill()
            p.join(5.0)
        self._procs[i], self._conns[i] = None, None

    def _recycle(self, i: int) -> None:
        self._kill(i)
        self.stats["recycled"] += 1
        self._spawn(i)
        self._await_ready(i)

    # -- scoring
    def score(self, text: str, tokens: Sequence[int], task: Task) -> RewardResult:
        """Score one completion (see the class docstring)."""
        return self.score_many([(text, list(tokens), task)])[0]

    def score_many(self, calls: Sequence[Call]) -> list[RewardResult]:
        """Score every call (text, tokens, task); results in call order."""
        if self._closed:
            raise RewardError("RewardRunner is closed")
        todo = [(t, [int(x) for x in toks], dict(task)) for t, toks, task in calls]
        self.stats["calls"] += len(todo)
        if self.mode == "inline":
            out = []
            for c in todo:
                t0 = time.perf_counter()
                out.append(self._result(invoke(self.fn, *c), time.perf_counter() - t0))
            return out
        return self._run_concurrent(todo)

    def _result(self, outcome: _Outcome, elapsed: float) -> RewardResult:
        reward, info = outcome
        if reward is None:
            self.stats["failed"] += 1
        return RewardResult(reward, info, elapsed)

    def _run_concurrent(self, todo: list[Call]) -> list[RewardResult]:
        """Calls go to the workers in chunks (one message or one thread per chunk, not per
        call: a thread start or a pipe round trip per call cost 0.1-0.5 ms, more than a
        cheap reward); a worker answers each call as it finishes, in order. The timeout is
        still per call: the clock of a slot's first unanswered call starts when the chunk
        is handed over or when the call before it is answered. A call past its timeout (or
        whose worker died) fails alone; the rest of its chunk goes back to the queue."""
        results: list[RewardResult | None] = [None] * len(todo)
        pending = deque(range(len(todo)))
        assigned: dict[int, deque[int]] = {}  # slot -> call indices handed over, unanswered
        head_t0: dict[int, float] = {}  # slot -> start of its first unanswered call
        while pending or assigned:
            for slot in range(self.workers):
                if slot not in assigned and pending:
                    size = max(1, min(CHUNK, -(-len(pending) // self.workers)))
                    chunk = deque(pending.popleft() for _ in range(min(size, len(pending))))
                    assigned[slot], head_t0[slot] = chunk, time.monotonic()
                    self._start(slot, [todo[ci] for ci in chunk])
            deadline = min(head_t0[s] for s in assigned) + self.timeout_s
            for slot, outcome, dead in self._poll(assigned, max(0.0, deadline - time.monotonic())):
                now = time.monotonic()
                results[assigned[slot].popleft()] = self._result(outcome, now - head_t0[slot])
                head_t0[slot] = now
                if dead:  # the worker is gone (already replaced): its chunk's rest is requeued
                    pending.extendleft(reversed(assigned[slot]))
                    assigned[slot].clear()
                if not assigned[slot]:
                    del assigned[slot], head_t0[slot]
            now = time.monotonic()
            for slot in [s for s in assigned if now - head_t0[s] >= self.timeout_s]:
                chunk = assigned.pop(slot)
                t0 = head_t0.pop(slot)
                self.stats["timeouts"] += 1
                msg = f"reward {self.path!r} ran past its {self.timeout_s}s timeout"
                results[chunk.popleft()] = self._result(_failure("timeout", msg), now - t0)
                pending.extendleft(reversed(chunk))
                self._abandon(slot)
        return [r for r in results if r is not None]

    def _start(self, slot: int, calls: list[Call]) -> None:
        if self.mode == "process":
            conn = self._conns[slot]
            assert conn is not None
            conn.send(calls)
            return
        gen = self._gen[slot]

        def target() -> None:
            for call in calls:
                if gen != self._gen[slot]:
                    return  # abandoned after a timeout: the rest of the chunk was requeued
                self._q.put((slot, gen, invoke(self.fn, *call)))

        threading.Thread(target=target, daemon=True, name=f"reward-{slot}").start()

    def _poll(
        self, assigned: dict[int, deque[int]], timeout: float
    ) -> list[tuple[int, _Outcome, bool]]:
        """Answered calls of busy slots, in order per slot, waiting up to ``timeout`` for the
        first: (slot, outcome, the worker died)."""
        out: list[tuple[int, _Outcome, bool]] = []
        if self.mode == "thread":
            try:
                item: tuple[int, int, _Outcome] | None = self._q.get(timeout=timeout)
                while item is not None:
                    slot, gen, outcome = item
                    if gen == self._gen[slot] and slot in assigned:
                        out.append((slot, outcome, False))
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            return out
        by_conn: dict[Any, int] = {self._conns[s]: s for s in assigned}
        for ready in wait(list(by_conn), timeout):
            slot = by_conn[ready]
            conn = self._conns[slot]
            assert conn is not None
            answered = 0
            try:  # drain what this worker has answered so far (at most its chunk)
                while answered < len(assigned[slot]) and (answered == 0 or conn.poll()):
                    out.append((slot, conn.recv()[1], False))
                    answered += 1
            except (EOFError, OSError):
                proc = self._procs[slot]
                if proc is not None:
                    proc.join(1.0)
                code = None if proc is None else proc.exitcode
                out.append(
                    (slot, _failure("crash", f"reward worker exited (exit code {code})"), True)
                )
                self._recycle(slot)
        return out

    def _abandon(self, slot: int) -> None:
        if self.mode == "process":
            self._recycle(slot)
        else:
            self._gen[slot] += 1
            self.stats["abandoned"] += 1
            log.warning("abandoned a reward thread that ran past %ss", self.timeout_s)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for i, conn in enumerate(self._conns):
            if conn is not None:
                try:
                    conn.send(None)
                except OSError:
                    pass
                p = self._procs[i]
                if p is not None:
                    p.join(1.0)
                self._kill(i)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_overhead(calls: int = 2000, workers: int = 2) -> dict[str, float]:
    """Mean microseconds per call of a trivial reward, per mode, scored one at a time and
    in batches of 64: the runner's own cost."""
    out: dict[str, float] = {}
    for mode in MODES:
        with RewardRunner("generator.rewards:exact_match", mode=mode, workers=workers) as r:
            c: Call = ("42", [1, 2], {"answer": "42"})
            r.score_many([c] * 8)  # warm up
            t0 = time.perf_counter()
            for _ in range(calls // 10):
                r.score(*c)
            out[f"{mode}_single_us"] = 1e6 * (time.perf_counter() - t0) / (calls // 10)
            t0 = time.perf_counter()
            for _ in range(calls // 64):
                r.score_many([c] * 64)
            out[f"{mode}_batch64_us"] = 1e6 * (time.perf_counter() - t0) / (calls // 64 * 64)
    return {k: round(v, 1) for k, v in out.items()}


if __name__ == "__main__":  # python -m generator.reward_runner [CALLS]: one JSON line
    print(json.dumps(measure_overhead(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)))
