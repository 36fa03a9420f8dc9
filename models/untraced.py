"""Calling compiled code while another thread of the process compiles.

torch's FX tracing flag is process-wide (``torch.fx._symbolic_trace.is_fx_tracing``): while one
thread traces (dynamo compiling a frame, AOT autograd tracing its backward), a dynamo-compiled
function called from any other thread raises ``RuntimeError("Detected that you are using FX to
symbolically trace a dynamo-optimized function ...")``. A generator thread beside the learner
(generators.placement=thread, pipeline.commands.generator_threads) meets it whenever its
engine compiles or captures a decode graph during the learner's first steps, which compile
theirs: measured on an H100 at 1b, the engine fell back to eager blocks and eager draws for the
whole run. ``untraced`` waits for the flag to clear before the call and runs the call again
when it still met another thread's trace (the calls it wraps are warm-ups and captures, which
may run again); anything else is raised as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NESTED_TRACE = "FX to symbolically trace a dynamo-optimized function"
"""What dynamo's error says when another thread is tracing (torch._dynamo.eval_frame)."""


def tracing() -> bool:
    """Whether some thread of this process is FX-tracing now."""
    import torch.fx._symbolic_trace as fx

    return bool(getattr(fx, "_is_fx_tracing_flag", False))  # (is_fx_tracing() warns each call)


def nested_trace(exc: BaseException) -> bool:
    """``exc`` is dynamo's refusal to run compiled code during another thread's trace."""
    return isinstance(exc, RuntimeError) and NESTED_TRACE in str(exc)


def untraced(call: Callable[[], T], *, limit_s: float = 600.0, poll_s: float = 0.01,
             is_tracing: Callable[[], bool] = tracing,
             sleep: Callable[[float], None] = time.sleep) -> T:  # fmt: skip
    """``call()`` once no thread traces (module doc); again after a ``nested_trace`` error, up
    to ``limit_s`` seconds of waiting in all (then that error is raised)."""
    waited = 0.0
    while True:
        while is_tracing() and waited < limit_s:
            sleep(poll_s)
            waited += poll_s
        try:
            return call()
        except RuntimeError as e:
            if not nested_trace(e) or waited >= limit_s:
                raise
            sleep(poll_s)
            waited += poll_s
