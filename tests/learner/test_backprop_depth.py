"""Truncated backprop through depth (`MegatronOptions.backprop_depth`).

With k > 0, token t's core iterations i < depths[t] - k are constants for the gradient (per
token: adaptive exits give each token its own last k). The learner implements it with
`torch.no_grad` for iterations where every token is frozen and `detach` of the frozen tokens'
K/V, outputs and states in mixed ones. The independent implementation here runs the untruncated
model (k = 0) and zeroes, with tensor hooks, the gradient reaching every frozen token's K/V,
block outputs and state: the weight gradients must agree, the log-probs must be bit-identical,
and truncation must change the gradient (it is not a no-op). Tiny Huginn and Ouro models,
random per-token depths (mixed iterations) and uniform full depth (no-grad iterations).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.learner.dist_utils import run_distributed
from tests.learner.test_megatron_model import make_items

pytestmark = pytest.mark.megatron

K = 2


def _loss(model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from learner.replay import replay_forward

    out = replay_forward(model, batch, temperature=0.8)
    m = batch.loss_mask
    loss = -(out.logprobs[m]).mean() - 0.1 * out.entropy[m].mean() + out.hidden.pow(2).mean()
    return loss, out.logprobs.detach()


def _hooked(model: Any, depths: torch.Tensor, valid: torch.Tensor, k: int) -> None:
    """Zero the gradient at frozen positions of every core block's K/V and output and of each
    iteration's new state (the model itself runs with backprop_depth 0)."""
    calls = {"block": 0, "state": 0}
    n_core = len(model.core)

    def frozen(i: int) -> torch.Tensor:
        return valid & (depths - k > i)

    def zero_at(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            shape = f.shape + (1,) * (t.dim() - 2)
            t.register_hook(lambda g: torch.where(f.view(shape), torch.zeros_like(g), g))
        return t

    for blk in model.core:
        qkv, fwd = blk.qkv, blk.forward

        def qkv_hooked(x: Any, rope: Any, mode: str, _qkv: Any = qkv) -> Any:
            q, kk, v = _qkv(x, rope, mode)
            f = frozen(calls["block"] // n_core)
            return q, zero_at(kk, f), zero_at(v, f)

        def fwd_hooked(*args: Any, _fwd: Any = fwd) -> Any:
            out, kk, v = _fwd(*args)
            f = frozen(calls["block"] // n_core)
            calls["block"] += 1
            return zero_at(out, f), kk, v

        blk.qkv, blk.forward = qkv_hooked, fwd_hooked
    core_out = model._core_out

    def core_out_hooked(x: torch.Tensor, mode: str) -> torch.Tensor:
        f = frozen(calls["state"])
        calls["state"] += 1
        return zero_at(core_out(x, mode), f)

    model._core_out = core_out_hooked


def _grad_mode_per_iteration(model: Any) -> list[bool]:
    seen: list[bool] = []
    blk = model.core[0]
    fwd = blk.forward

    def spy(*args: Any) -> Any:
        seen.append(torch.is_grad_enabled())
        return fwd(*args)

    blk.forward = spy
    return seen


def body() -> dict[str, Any]:
    from learner.hf_convert import gather_hf_state
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import make_replay_batch
    from models.config import tiny_config

    init_distributed(tp=1, seed=0)
    out: dict[str, Any] = {}
    for family in ("huginn", "ouro"):
        cfg = tiny_config(family)
        items = make_items(cfg, 5)
        uniform = [dataclasses.replace(it, exit_depths=[cfg.max_depth] * len(it.exit_depths))
                   for it in items]  # fmt: skip
        for shape, its in (("adaptive", items), ("uniform", uniform)):
            dev = "cuda" if torch.cuda.is_available() else "cpu"  # the model's device
            batch = make_replay_batch(its).to(dev)
            res: dict[str, Any] = {}
            for name, k in (("truncated", K), ("hooks", 0), ("full", 0), ("recompute", K)):
                rc = "block" if name == "recompute" else "none"
                # the hooks see the [B, S] layout: that model runs without depth batching
                opts = MegatronOptions(init_seed=3, backprop_depth=k, recompute=rc,
                                       compact=name != "hooks")  # fmt: skip
                model = build_policy(cfg, opts)
                seen = _grad_mode_per_iteration(model) if name == "truncated" else []
                if name == "hooks":
                    _hooked(model, batch.depths, batch.valid, K)
                loss, logp = _loss(model, batch)
                loss.backward()
                res[name] = {"grads": gather_hf_state(model, grads=True), "logp": logp}
                res[name]["grad_modes"] = seen
                res[name]["backprop_depth"] = model.backprop_depth
                res[name]["max_depth"] = model.max_depth
            out[f"{family}_{shape}"] = res
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_distributed(body, 1, torchrun_env=False, timeout_s=300)[0]


@pytest.mark.parametrize("case", ["huginn_adaptive", "huginn_uniform", "ouro_adaptive",
                                  "ouro_uniform"])  # fmt: skip
def test_truncated_gradients_equal_the_hooked_implementation(runs: dict, case: str) -> None:
    r = runs[case]
    assert r["truncated"]["backprop_depth"] == K and r["hooks"]["backprop_depth"] == 0
    for name in ("hooks", "full", "recompute"):  # log-probs bit-identical whatever is truncated
        assert torch.equal(
            torch.as_tensor(r[name]["logp"]), torch.as_tensor(r["truncated"]["logp"])
        )
    worst = moved = recomputed = 0.0
    for key in r["truncated"]["grads"]:
        g, h, f, rc = (
            torch.as_tensor(r[n]["grads"][key]) for n in ("truncated", "hooks", "full", "recompute")
        )
        scale = float(f.abs().max()) or 1.0
        worst = max(worst, float((g - h).abs().max()) / scale)
        moved = max(moved, float((g - f).abs().max()) / scale)
        recomputed = max(recomputed, float((g - rc).abs().max()) / scale)
    assert worst <= 1e-6, (case, worst)
    assert recomputed <= 1e-6, (case, recomputed)  # block recompute keeps the truncation
    assert moved > 1e-3, (case, moved)  # truncation really changes the gradient
    modes, depth = r["truncated"]["grad_modes"], r["truncated"]["max_depth"]
    assert depth > K
    if case.endswith("uniform"):  # every token at full depth D: iterations < D - K no_grad
        assert modes == [False] * (depth - K) + [True] * K
    else:  # prompt tokens at depth D, completions at 1..D: mixed iterations keep grad on
        assert len(modes) == depth and all(modes)
