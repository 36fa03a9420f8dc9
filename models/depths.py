"""Exit depths (docs/CONTRACTS.md 2) as code: one owner of their rules and of their layout over
a replay's positions, which the reference replay, the learner's replay and batches and the
learner's door import instead of restating them.

``exit_depths[t]`` is the number of core iterations run at the position that sampled response
token t, token 0 included (the last prompt position samples it and follows the exit policy where
the family's official code does: ``models.exits.token0_follows_policy``); the other prompt
positions run the run's full depth D, recorded with the rollout (``Rollout.full_depth``). Streams
recorded before that field ran the last prompt position at D too, so there D =
``exit_depths[0]`` (``full=None``). ``full_depth`` checks a depth list against a model and
returns D; ``position_depths`` lays the depths out over the positions a replay feeds (the
prompt, then every response token but the last).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["full_depth", "position_depths"]


def full_depth(
    exit_depths: Sequence[int] | np.ndarray, model_depth: int, full: int | None = None
) -> int:
    """The full depth D after checking contract 2: D in [1, model_depth] and every depth in
    [1, D]. ValueError naming the broken rule otherwise (also for an empty list).
    `full`: the recorded full depth (`Rollout.full_depth`); None (or 0: a stream recorded
    before that field, whose last prompt position ran D) = exit_depths[0].
    `model_depth` is the deepest full depth allowed: the run's exit policy's max depth (which
    may exceed the model's trained depth), or MAX_DEPTH (255) where no policy is known."""
    if len(exit_depths) == 0:
        raise ValueError("exit_depths is empty (a completion has at least one token)")
    d = [int(x) for x in exit_depths]
    recorded = bool(full)
    full = int(full) if recorded else d[0]  # type: ignore[arg-type]
    what = "full_depth" if recorded else "exit_depths[0] (the full depth)"
    if not 1 <= full <= model_depth:
        raise ValueError(
            f"{what} = {full} must be in [1, {model_depth}] (the exit policy's max depth)"
        )
    lo, hi = min(d), max(d)
    if lo < 1 or hi > full:
        raise ValueError(
            f"exit_depths must be in [1, {what.split(' ')[0]} = {full}], got {lo}..{hi} "
            "(contract 2)"
        )
    return full


def position_depths(
    prompt_len: int, exit_depths: Sequence[int] | np.ndarray, full: int | None = None
) -> np.ndarray:
    """int64 [prompt_len - 1 + T]: the depth run at each position a replay feeds (prompt
    positions 0..P-2 at the full depth `full`, None or 0 = exit_depths[0] (older streams);
    position P-1+t at exit_depths[t])."""
    d = np.asarray(exit_depths, dtype=np.int64)
    if prompt_len < 1 or d.size < 1:
        raise ValueError("position_depths needs a prompt and at least one response token")
    return np.concatenate([np.full(prompt_len - 1, int(full) if full else d[0], np.int64), d])
