"""generator.lane.Lane: calls run in submission order, one at a time, off the submitting thread
(inline: at submit); a call's exception lands in its Future; on_done follows every call."""

from __future__ import annotations

import threading
import time

import pytest

from generator.lane import Lane


def test_thread_lane_runs_calls_in_order_one_at_a_time() -> None:
    running, order, overlaps = [0], [], []
    done = threading.Semaphore(0)
    lane = Lane("test-lane", inline=False, on_done=done.release)
    main = threading.get_ident()

    def call(i: int) -> int:
        running[0] += 1
        overlaps.append(running[0] > 1)
        assert threading.get_ident() != main
        time.sleep(0.002 * (5 - i % 5))  # later calls are shorter: order is the lane's doing
        order.append(i)
        running[0] -= 1
        return i * i

    futures = [lane.submit(lambda i=i: call(i)) for i in range(20)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(20)]
    for _ in range(20):
        assert done.acquire(timeout=10)  # on_done once per call
    lane.close()
    assert order == list(range(20)) and not any(overlaps)


def test_inline_lane_runs_at_submit_and_keeps_exceptions() -> None:
    calls = []
    lane = Lane("inline", inline=True, on_done=lambda: calls.append("woken"))
    fut = lane.submit(lambda: calls.append("ran") or 7)
    assert fut.done() and fut.result() == 7 and calls == ["ran"]  # inline: no waker

    def boom() -> None:
        raise RuntimeError("engine exploded")

    bad = lane.submit(boom)
    with pytest.raises(RuntimeError, match="engine exploded"):
        bad.result(timeout=0)
    lane.close()
