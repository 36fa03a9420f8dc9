"""Per-loop token statistics of the megatron policy (objective.loop_weighting; docs/LEARNER.md
"Per-loop credit"): for every response token t and loop k = 1..e_t, the log-prob and entropy
of the sampled token under the distribution read out after core iteration k.

    out = loop_forward(model, mb, row_stats, gate=False)
    out["logp"], out["entropy"]               # [B, L] the exit readout (the usual statistics)
    out["loop_logp"], out["loop_entropy"]     # [B, L, K] per loop, 0 where k > e_t
    out["loop_gate"]                          # [B, L, K] exit-gate logits (gate=True: Ouro)

One forward: after core iteration k (`LoopedGPT.forward`'s loop_fn) the family's readout of the
whole state tensor (every position at min(k, its depth) under last_exited, at k under full), the
head on the rows of the tokens with e_t >= k, and `row_stats` of those rows. The readout, head and
statistics of a loop run under activation checkpointing: the backward recomputes them from the
loop's state, so one loop's [tokens, vocab] logits (and one readout) live at a time, never
[loops, tokens, vocab]. Gradients reach the core only where the forward keeps them
(learner.backprop_depth: token t's iterations i < e_t - k carry none); the readout and head get
the gradient of every loop.

A packed micro-batch (learner.max_tokens_per_micro) runs packed: a loop's rows are found at
their packed positions (`PackedInputs.packed_of`) and its gate logits go back to the rows'
layout (`PackedInputs.unpack`), so every output keeps the padded rows' layout and, in exact
numerics, their bits (tests/learner/test_packed_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from learner.batching import TrainBatch, flat_index, to_device
from learner.objectives.loops import (
    ExitSum,
    add_loop_columns,
    response_depths,
    row_full_depths,
    spread,
    tap,
)
from learner.replay import full_vocab_logits, unwrap
from models import numerics as nx

__all__ = ["RowStats", "exit_forward", "loop_forward"]

RowStats = Callable[[Tensor, Tensor], dict[str, Tensor]]
"""row_stats(logits [N, V] full vocabulary, targets [N]) -> {"logp", "entropy"} [N]."""


def loop_forward(model: Any, mb: TrainBatch, row_stats: RowStats, *, gate: bool,
                 exit_min_depth: int | None = None, gate_grad: bool = False) -> dict:  # fmt: skip
    """The module docstring's outputs for a micro-batch on the model's device; with
    ``exit_min_depth`` (a sampled exit) also "exit_logp", "exit_entropy" [B, L] as
    `exit_forward` computes them, in the same pass; ``gate_grad``: "loop_gate" carries its
    gradient (objective.exit_pdf_gradient)."""
    from learner.model_specs import looped_inputs

    core = unwrap(model)
    mode = nx.check_mode(core.options.numerics)
    sel, e, n_loops = response_depths(mb)
    h = mb.on_host()  # each loop's rows by their index, found on the host: no read of the card
    h_sel, h_e = h.mask > 0, h.exit_depths
    targets = mb.targets.reshape(-1)
    cols: dict[str, list[Tensor]] = {"loop_logp": [], "loop_entropy": [], "loop_gate": []}
    full = row_full_depths(mb)
    exits = None if exit_min_depth is None else ExitSum(sel, e, full, exit_min_depth, mode)
    args, kw, packed = looped_inputs(mb, head=True)
    # the response positions in the state (packed: found once, a loop takes its subset)
    resp = flat_index(h_sel)
    resp_state = resp if packed is None else packed.packed_of(resp)
    resp_e = h_e.reshape(-1).index_select(0, resp)

    def gate_of(s: Tensor) -> Tensor:  # [B, L] exit-gate logits (packed: back to the rows)
        g = core.gate_logit(s, mode)
        return g if packed is None else packed.unpack(g)

    def at_loop(k: int, state: Tensor, readout: Callable[[Tensor], Tensor]) -> Tensor | None:
        if k > n_loops:
            return None
        state, side = tap(state)
        sel_k = sel & (e >= k)
        ran = resp_e >= k  # the rows sel_k takes: in the rows' layout, and in the state's
        at = to_device(resp[ran], sel.device)
        at_state = at if packed is None else to_device(resp_state[ran], sel.device)

        def stats(s: Tensor) -> tuple[Tensor, Tensor]:
            r = readout(s)
            rows = r.reshape(-1, r.shape[-1]).index_select(0, at_state)
            st = row_stats(full_vocab_logits(core, core.head_logits(rows, mode)),
                           targets.index_select(0, at))  # fmt: skip
            return st["logp"], st["entropy"]

        add_loop_columns(cols, sel_k, side, stats, gate_of if gate else None, gate_grad)
        if exits is not None:
            exits.add(k, gate_of(side))
        return state

    out = model(*args, **kw, loop_fn=at_loop)
    with torch.no_grad():  # the exit readout: behaviour mismatch, the correction's base
        ex = row_stats(full_vocab_logits(core, out.logits.detach()),
                       targets.index_select(0, mb.mask_rows()))  # fmt: skip
    del out
    res = {"logp": spread(sel, ex["logp"]), "entropy": spread(sel, ex["entropy"])}
    res.update({k: torch.stack(v, dim=-1) for k, v in cols.items() if v})
    return res | ({} if exits is None else exits.result())


def exit_forward(model: Any, mb: TrainBatch, min_depth: int) -> dict[str, Tensor]:
    """A sampled exit's forward (TrainConfig.exit_min_depth; learner.objectives.exit_term):
    the policy forward of `learner.model_specs.looped_policy_spec` ({"mask_logits": [N, V]}) plus
    each response token's exit log-prob and exit entropy [B, L] from the gate logit after
    every core iteration it ran (LoopedGPT.forward's loop_fn), summed per token in iteration
    order with models.exits.exit_step_logprob / exit_step_entropy: the operations of
    models.engine.chunk.run_chunk, so exact numerics give the generator's claims bit for bit.
    A packed micro-batch (learner.max_tokens_per_micro) runs packed; each loop's gate logits
    go back to the rows' layout before they are summed (the same values: a logit is a
    position's own)."""
    from learner.model_specs import looped_inputs

    core = unwrap(model)
    mode = nx.check_mode(core.options.numerics)
    sel, e, n_loops = response_depths(mb)
    exits = ExitSum(sel, e, row_full_depths(mb), min_depth, mode)
    args, kw, packed = looped_inputs(mb, head=True)

    def at_loop(k: int, state: Tensor, readout: Callable[[Tensor], Tensor]) -> Tensor | None:
        if k > n_loops:
            return None
        state, side = tap(state)
        gate = core.gate_logit(side, mode)  # [B, L], or [1, N] packed: back to the rows
        exits.add(k, gate if packed is None else packed.unpack(gate))
        return state

    out = model(*args, **kw, loop_fn=at_loop)
    return {"mask_logits": full_vocab_logits(core, out.logits)} | exits.result()
