"""models.untraced: compiled code called from one thread while another thread FX-traces (a
generator thread beside the learner compiling, generators.placement=thread). The real dynamo
refusal first (a compiled function called while the process-wide flag is up), then the
helper: it waits for the flag, calls again after that refusal, passes any other error through
and gives up after its limit."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.fx._symbolic_trace as fx

from models.untraced import NESTED_TRACE, nested_trace, untraced


def _compiled() -> object:
    return torch.compile(lambda x: x * 2 + 1, backend="eager")


def test_dynamo_refuses_compiled_code_during_another_threads_trace() -> None:
    f = _compiled()
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1)  # (compiled once, outside any trace)
    fx._is_fx_tracing_flag = True  # what a thread tracing sets, for the whole process
    try:
        with pytest.raises(RuntimeError) as e:
            f(x)
        assert nested_trace(e.value) and NESTED_TRACE in str(e.value)
    finally:
        fx._is_fx_tracing_flag = False


def test_untraced_waits_for_the_other_threads_trace_to_end() -> None:
    f = _compiled()
    x = torch.arange(4.0)
    f(x)
    fx._is_fx_tracing_flag = True
    released = []

    def other_thread_ends_its_trace() -> None:
        time.sleep(0.3)
        released.append(time.monotonic())
        fx._is_fx_tracing_flag = False

    t = threading.Thread(target=other_thread_ends_its_trace)
    t.start()
    try:
        out = untraced(lambda: f(x), limit_s=30.0)
        done = time.monotonic()
    finally:
        t.join()
        fx._is_fx_tracing_flag = False
    assert torch.equal(out, x * 2 + 1)
    assert released and done >= released[0]  # called only once the flag was down


def test_untraced_calls_again_after_the_refusal_and_passes_other_errors() -> None:
    calls = []

    def refused_twice() -> int:
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("Detected that you are using " + NESTED_TRACE + ". Not supported.")
        return 7

    slept: list[float] = []
    assert untraced(refused_twice, is_tracing=lambda: False, sleep=slept.append) == 7
    assert len(calls) == 3 and len(slept) == 2

    def broken() -> int:
        raise RuntimeError("inductor: something else")

    with pytest.raises(RuntimeError, match="something else"):
        untraced(broken, is_tracing=lambda: False, sleep=slept.append)

    def always_refused() -> int:
        raise RuntimeError(NESTED_TRACE)

    with pytest.raises(RuntimeError, match="dynamo-optimized"):  # gives up past the limit
        untraced(always_refused, limit_s=0.05, poll_s=0.01, is_tracing=lambda: False,
                 sleep=lambda s: None)  # fmt: skip
    # a flag that never clears: the call is made at the limit (and its own error raised)
    assert untraced(lambda: 3, limit_s=0.05, poll_s=0.01, is_tracing=lambda: True,
                    sleep=lambda s: None) == 3  # fmt: skip
