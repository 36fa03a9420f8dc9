"""What a tick graph decides on the device, row by row, at one shape and with no host sync
(`models.engine.tickgraph.GraphTicker`): after a tick, each row's exit (`decide`, the
exit policy at the row's own depth); at a readout, which exited rows read out (`first_rows`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from models.exits import (
    ExitCarry,
    ExitPolicy,
    SampledGate,
    StepInfo,
    exit_step_logprob,
    should_exit,
)
from models.noise import exit_uniform


def decide(
    policy: ExitPolicy | None, max_depth: int, mode: str, running: Tensor, it: Tensor,
    new: Tensor, state: Tensor, gate: Tensor | None, seeds: Tensor, pos: Tensor, stop: Tensor,
    elp: Tensor, forced: Tensor, remaining: Tensor | None, cumulative: Tensor | None,
    free: Tensor | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """After a tick's core iteration (new states ``new`` of every row, ``running`` the rows
    that iterated): the rows' new (state, iterations, stop, exit log-prob[, OuroGate's
    remaining, cumulative]). Rows not running keep theirs; rows ``free`` (prompt positions fed
    through the ticks, `GraphTicker.feed_prompts`) exit at the max depth only. Tensors in,
    tensors out, no host sync: `GraphTicker` runs it eagerly, or compiled (fast mode: its
    elementwise ops fused)."""
    state_out = torch.where(running[:, None], new, state)
    depth = it + running.to(it.dtype)
    if policy is None:
        return state_out, depth, stop, elp
    info = StepInfo(depth, max_depth, new, state, mode=mode, gate_logit=gate)
    if isinstance(policy, SampledGate):
        info.uniform = exit_uniform(seeds, pos, depth, check=False)
    carry = None
    if remaining is not None and cumulative is not None:  # OuroGate: each row's own
        carry = ExitCarry(remaining=remaining, cumulative=cumulative)
    hit, after = should_exit(policy, info, carry)
    if free is not None:
        hit = torch.where(free, depth >= max_depth, hit)
    stop_out = stop | (running & hit)
    elp_out = elp
    if isinstance(policy, SampledGate):
        assert gate is not None
        term = exit_step_logprob(gate, hit, depth, policy.min_depth, forced, mode)
        elp_out = torch.where(running, elp + term.to(elp.dtype), elp)
    if carry is None:
        return state_out, depth, stop_out, elp_out
    assert remaining is not None and cumulative is not None
    assert after.remaining is not None and after.cumulative is not None
    return (state_out, depth, stop_out, elp_out, torch.where(running, after.remaining, remaining),
            torch.where(running, after.cumulative, cumulative))  # fmt: skip


_DECIDE: list[Callable[..., tuple[Tensor, ...]]] = []


def compiled_decide() -> Callable[..., tuple[Tensor, ...]]:
    """`decide` under torch.compile (one per process; fast mode)."""
    if not _DECIDE:
        _DECIDE.append(torch.compile(decide, dynamic=False))
    return _DECIDE[0]


def first_rows(w: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The first ``n`` rows of mask ``w`` [B] by index, at a fixed shape (no host sync):
    (sel [B]: w's first n True rows, idx [n]: distinct row indices, sel's rows first in order,
    then rows not selected, valid [n]: sel[idx])."""
    one = w.to(torch.int64)
    sel = w & (torch.cumsum(one, 0) <= n)
    si = sel.to(torch.int64)
    n_sel = si.sum()
    rank = torch.where(sel, torch.cumsum(si, 0) - 1, n_sel + torch.cumsum(1 - si, 0) - 1)
    rows = torch.arange(w.shape[0], device=w.device)
    perm = torch.empty_like(rank).scatter_(0, rank, rows)
    idx = perm[:n]
    return sel, idx, sel.index_select(0, idx)


__all__ = ["compiled_decide", "decide", "first_rows"]
