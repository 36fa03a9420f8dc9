"""Depth batching in the megatron replay forward (`MegatronOptions.compact`): at core iteration
d only the positions still running go through the core's projections and MLPs.

Against the same model run without it (every position at every iteration, masked), on rows of
different lengths (padding) with per-position exit depths 1..D, Huginn and Ouro, both exit KV
semantics (docs/CONTRACTS.md 3), with truncated depth backprop and with block recompute: the
log-probs, entropies, hidden states and every parameter's gradient are the same bits in exact
numerics and within 1e-6 in fast. And it saves what it should: the rows into the core's MLP
are, per iteration, exactly the positions still running (summed: each valid position's run
depth), where the masked forward pushes all B x S positions through every iteration.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.learner.dist_utils import run_distributed
from tests.learner.test_megatron_model import make_items

pytestmark = pytest.mark.megatron

CASES = [  # family, numerics, kv, backprop depth, recompute
    ("huginn", "exact", "last_exited", 0, "none"),
    ("huginn", "exact", "full", 0, "none"),
    ("ouro", "exact", "last_exited", 0, "block"),
    ("ouro", "exact", "full", 0, "none"),
    ("huginn", "exact", "last_exited", 2, "none"),
    ("huginn", "fast", "last_exited", 0, "none"),
    ("ouro", "fast", "full", 2, "block"),
]


def _case_id(c: tuple) -> str:
    return "-".join(str(x) for x in c)


def body() -> dict[str, Any]:
    from learner.hf_convert import gather_hf_state
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import make_replay_batch, replay_forward
    from models.config import tiny_config
    from models.reference import ReplayItem

    init_distributed(tp=1, seed=0)
    out: dict[str, Any] = {}
    for case in CASES:
        family, numerics, kv, k_bp, rc = case
        cfg = tiny_config(family)
        top = cfg.max_depth  # a fourth, shorter row (padding), its last token exiting at 1
        short = ReplayItem([5, 6, 7], [8, 9], 2**63 + 5, [top, 1])
        batch = make_replay_batch([*make_items(cfg, 5), short])
        res: dict[str, Any] = {}
        for compact in (True, False):
            opts = MegatronOptions(init_seed=3, numerics=numerics, kv=kv, backprop_depth=k_bp,
                                   recompute=rc, compact=compact)  # fmt: skip
            model = build_policy(cfg, opts)
            rows: list[int] = []
            handles = [blk.pre_mlp_norm.register_forward_hook(
                lambda _m, args, _o, rows=rows: rows.append(args[0].shape[0] * args[0].shape[1]))
                for blk in model.core]  # fmt: skip
            o = replay_forward(model, batch, temperature=0.8)
            m = batch.loss_mask
            loss = -(o.logprobs[m]).mean() - 0.1 * o.entropy[m].mean() + o.hidden.pow(2).mean()
            loss.backward()
            for hd in handles:
                hd.remove()
            res[str(compact)] = {
                "logp": o.logprobs.detach(), "entropy": o.entropy.detach(),
                "hidden": o.hidden.detach(), "grads": gather_hf_state(model, grads=True),
                "rows": rows, "n_core": len(model.core),
            }  # fmt: skip
        valid, depths = batch.valid, batch.depths
        run_to = torch.where(valid, depths, 0)
        if kv == "full":  # each position runs its row's full depth (its deepest position's)
            run_to = torch.where(valid, run_to.amax(dim=1, keepdim=True), 0)
        res["expected_rows"] = [int((run_to > i).sum()) for i in range(int(run_to.max()))]
        res["positions"] = valid.numel()
        out[_case_id(case)] = res
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_distributed(body, 1, torchrun_env=False, timeout_s=600)[0]


@pytest.mark.parametrize("case", [_case_id(c) for c in CASES])
def test_depth_batching_gives_the_masked_forwards_values_and_gradients(runs: dict,
                                                                       case: str) -> None:  # fmt: skip
    r = runs[case]
    a, b = r["True"], r["False"]
    exact = "-exact-" in case
    for key in ("logp", "entropy", "hidden"):
        x, y = torch.as_tensor(a[key]), torch.as_tensor(b[key])
        if exact:
            assert torch.equal(x, y), (key, float((x - y).abs().max()))
        else:
            assert bool(((x - y).abs() <= 1e-6 * y.abs().clamp(min=1)).all()), key
    assert set(a["grads"]) == set(b["grads"])
    moved = 0.0
    for name in a["grads"]:
        g, h = torch.as_tensor(a["grads"][name]), torch.as_tensor(b["grads"][name])
        moved = max(moved, float(h.abs().max()))
        if exact:
            assert torch.equal(g, h), (name, float((g - h).abs().max()))
        else:
            scale = float(h.abs().max()) or 1.0
            assert float((g - h).abs().max()) <= 1e-6 * scale, name
    assert moved > 0  # real gradients, not zeros


@pytest.mark.parametrize("case", [_case_id(c) for c in CASES])
def test_depth_batching_runs_only_the_running_positions(runs: dict, case: str) -> None:
    """The core's MLP sees, at each iteration and layer, exactly the positions still running;
    the masked forward every position of the batch. (Forward calls only: recompute's
    second forward of each block is not hooked before the backward reruns it.)"""
    r = runs[case]
    n_core, expected = r["True"]["n_core"], r["expected_rows"]
    calls = r["True"]["rows"]
    per_iter = [calls[i * n_core : (i + 1) * n_core] for i in range(len(expected))]
    assert [set(c) for c in per_iter] == [{n} for n in expected], (per_iter, expected)
    masked = r["False"]["rows"]
    assert masked[: len(expected) * n_core] == [r["positions"]] * (len(expected) * n_core)
    saved = 1 - sum(expected) / (len(expected) * r["positions"])
    # padding (5 of 36 positions) and exits: last_exited 0.338 (Huginn), 0.271 (Ouro); full
    # 0.139 (the padding alone: each row runs its full depth)
    assert saved >= 0.13, saved


def compiled_body() -> dict[str, Any]:
    """Compiled blocks (dynamo's graphs; the eager backend: the graphs, not inductor's code,
    are what is counted) over eight batches whose active positions differ at every iteration."""
    from torch._dynamo.utils import counters

    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import make_replay_batch, replay_forward
    from models.config import tiny_config

    compile_module = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, *a, **k: compile_module(self, *a, backend="eager", **k)  # type: ignore[method-assign]
    init_distributed(tp=1, seed=0)
    cfg = tiny_config("ouro")
    opts = MegatronOptions(init_seed=3, numerics="fast", kv="last_exited", compile=True)
    model = build_policy(cfg, opts)
    graphs, actives = [], []
    for seed in range(5, 13):
        batch = make_replay_batch(make_items(cfg, seed))
        o = replay_forward(model, batch, temperature=0.8)
        (-(o.logprobs[batch.loss_mask]).mean()).backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))
        run_to = torch.where(batch.valid, batch.depths, 0)
        actives.append([int((run_to > i).sum()) for i in range(int(run_to.max()))])
    destroy_distributed()
    torch.nn.Module.compile = compile_module  # type: ignore[method-assign]
    return {"graphs": graphs, "actives": actives}


def test_compiled_depth_batching_compiles_once_for_every_count_of_active_positions() -> None:
    """M, the running positions an iteration, changes with every batch and iteration: the
    compiled core blocks take it as a dynamic size from the first call
    (learner.megatron.model._rows_dynamic), so the graphs are one per argument pattern (masked
    or rows; no K/V yet, zeros or the last iteration's; frozen or not): 6 here. Left to
    dynamo, each pattern's first Ms compiled static graphs (10 here, the same 8 batches)."""
    r = run_distributed(compiled_body, 1, torchrun_env=False, timeout_s=600)[0]
    ms = {m for a in r["actives"] for m in a[1:]}
    assert len(ms) >= 10, r["actives"]  # many counts of running positions
    graphs = r["graphs"]
    assert 0 < graphs[-1] <= 7, graphs
    assert graphs[-4:] == [graphs[-1]] * 4, graphs  # none new over the last four batches
