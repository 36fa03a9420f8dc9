"""The health verdict of a training benchmark's loss and gradient-norm trajectory ("finite" is
not "healthy"): used by benchmarks/trainer_gpu.py and benchmarks/learner_process.py."""

from __future__ import annotations

import math
import statistics
from typing import Any


def health(losses: list[float], grad_norms: list[float], window: int = 3) -> dict[str, Any]:
    """Whether training looks alive, not only finite: "collapse" when `window` consecutive
    steps have a vanishing gradient norm (below 1e-6 x the median norm of the run, or exactly
    0) or the very same loss (relative change below 1e-7) although every step brings new
    rollouts; "spikes" when a norm exceeds 20 x the median; "diverging" when the mean |loss| of
    the last third of the steps is over twice the first third's (6 steps or more); "nonfinite"
    when a loss or norm is not finite; else "ok". Returns the verdict and the steps that
    triggered it."""

    if not all(math.isfinite(x) for x in [*losses, *grad_norms]):
        bad = [i for i, (x, g) in enumerate(zip(losses, grad_norms, strict=True))
               if not (math.isfinite(x) and math.isfinite(g))]  # fmt: skip
        return {"verdict": "nonfinite", "steps": bad}
    med = statistics.median(grad_norms) if grad_norms else 0.0
    flat = [i for i in range(1, len(losses))
            if abs(losses[i] - losses[i - 1]) <= 1e-7 * max(abs(losses[i]), 1e-12)
            or grad_norms[i] == 0.0 or grad_norms[i] < 1e-6 * med]  # fmt: skip
    run = 0
    for j, i in enumerate(flat):
        run = run + 1 if j and flat[j - 1] == i - 1 else 1
        if run >= window:
            return {"verdict": "collapse", "steps": flat}
    spikes = [i for i, g in enumerate(grad_norms) if med > 0 and g > 20 * med]
    if spikes:
        return {"verdict": "spikes", "steps": spikes}
    third = len(losses) // 3
    if third >= 2:  # a sustained rise: the last third's mean |loss| over 2x the first third's
        first = statistics.fmean(abs(x) for x in losses[:third])
        last = statistics.fmean(abs(x) for x in losses[-third:])
        if first > 0 and last > 2 * first:
            return {"verdict": "diverging", "steps": list(range(len(losses) - third, len(losses)))}
    return {"verdict": "ok", "steps": []}
