"""The metrics.jsonl row of one training step (without the timeline's ``time/*`` keys, which
pipeline.core.timeline adds): a pure function of what the step trained and the counters the
coordinator keeps, so the coordinator only gathers them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.core.intake import Group
from proto.records import Rollout


def step_row(
    step: int,
    version: int,
    groups: Sequence[Group],
    rolls: Sequence[Rollout],
    flags: Sequence[bool],
    tm: Mapping[str, float],
    per: Sequence[float],
    *,
    fresh: Sequence[bool],
    counts: Mapping[str, int],
    failed: int,
    train_s: float,
    step_s: float,
    elapsed_s: float,
    generators: int,
) -> dict[str, Any]:
    """``tm``: the trainer's metrics (``train/``-prefixed here); ``per``: its per-rollout
    |learner - behaviour| log-prob (``StepResult.mismatch``; -1 or NaN not measured, empty
    when it keeps none); ``fresh``: per rollout, sampled with the weights being trained; ``counts``: the
    intake's counters plus ``released`` (the ledger's re-dispatches)."""
    stal = [v.staleness for g in groups for v in g.verdicts]
    # the task's reward (failed ones out; the step trains on learner.shaping's)
    rewards = [float(r.reward) for r in rolls if r.reward is not None] or [0.0]
    whole = float(tm.get("logprob_mismatch", float("nan")))
    m: dict[str, Any] = {
        "step": step,
        "version": version,
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "staleness_mean": sum(stal) / len(stal),
        "staleness_max": max(stal),
        "stale_kept": sum(flags),
        "dropped_stale_total": counts.get("rollouts_dropped_stale", 0),
        "reward_failed": failed,
        "logprob_mismatch": fresh_mismatch(per, fresh, whole),
        "logprob_mismatch_all": whole,
        "train_s": train_s,
        "step_s": step_s,
        "elapsed_s": elapsed_s,
        "generators": generators,
        "duplicates_total": counts.get("duplicate", 0),
        "refused_total": counts.get("refused", 0),
        "filtered_uniform_total": counts.get("groups_filtered_uniform", 0),
        "reward_nonfinite_total": counts.get("reward_nonfinite", 0),
        "redispatched_total": counts.get("released", 0),
        "tokens": sum(r.num_tokens for r in rolls),
    }
    for key in ("correct", "exact"):
        vals = [float(r.reward_info[key]) for r in rolls if key in r.reward_info]  # type: ignore[arg-type]
        if vals:
            m[f"reward_{key}"] = sum(vals) / len(vals)
    m.update({f"train/{k}": float(v) for k, v in tm.items()})
    # per generator: max |learner - behaviour| log-prob over its rollouts of the step that
    # the trainer measured (any staleness: numerics and policy lag; docs/OBJECTIVES.md)
    if len(per) == len(rolls):
        by_gen: dict[str, float] = {}
        for x, r in zip(per, rolls, strict=True):
            if x == x and x >= 0.0:  # -1: not measured; NaN: none
                by_gen[r.generator_id] = max(float(x), by_gen.get(r.generator_id, 0.0))
        m.update({f"mismatch/{g}": v for g, v in sorted(by_gen.items())})
    return m


def fresh_mismatch(per: Sequence[float], fresh: Sequence[bool], whole: float) -> float:
    """Max |learner - generator| log-prob over the rollouts sampled with the weights being
    trained (staleness 0): numerics, not policy change. From the per-rollout values when the
    trainer keeps them, else its batch value ``whole`` when every rollout is fresh; NaN
    otherwise."""
    if not per or len(per) != len(fresh):  # batch-level value: valid if all are fresh
        return float(whole) if all(fresh) else float("nan")
    vals = [m for m, f in zip(per, fresh) if f and m == m]
    return max(vals) if vals else float("nan")
