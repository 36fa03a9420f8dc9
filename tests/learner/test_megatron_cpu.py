"""megatron-core on CPU over gloo (learner.megatron.cpu + learner.parallel).

All megatron work happens in two spawned runs (megatron's import alone is seconds per process),
shared by the tests through module fixtures: `single` (1 rank, single-process init: no-op-with-
CUDA check, RNG, TP=1 references and the full weights file, optimizer update rules, recompute,
masks, microbatch schedule) and `pair` (2 ranks: TP=2 on the same weights, then DP=2 with
Megatron DDP + DistributedOptimizer and a dist_checkpointing round trip). The parent process
never imports megatron. Model: GPT, local spec, hidden 64, 2 layers, 2 heads, vocab 128, seq 16.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.parallel import free_port, init_distributed
from tests.learner.dist_utils import (
    TINY_SEQ,
    causal_mask,
    forward_backward,
    full_params,
    lm_loss,
    load_full_params,
    params_equal,
    run_distributed,
    tiny_gpt,
    token_batch,
    train_step,
    wrap_ddp,
)

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megatron_cpu")


@pytest.fixture(scope="module")
def single(workdir: Path) -> dict[str, Any]:
    # No torchrun variables: init_distributed takes its single-process path.
    results = run_distributed(single_rank_checks, 1, str(workdir), torchrun_env=False)
    return results[0]


@pytest.fixture(scope="module")
def pair(single: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    return run_distributed(two_rank_checks, 2, str(workdir), timeout_s=180)


def _draws(seed: int, n: int = 2) -> list[np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(RNG_DRAW, generator=gen).numpy() for _ in range(n)]


# ------------------------------------------------------------------------------- parallel.py


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"tp": 0}, {}, "tp must be >= 1"),
        ({"tp": 1, "backend": "mpi"}, {}, "backend must be"),
        ({"tp": 1, "backend": "nccl"}, {}, "needs CUDA"),
        ({"tp": 1}, {"RANK": "0"}, "partial torchrun environment"),
    ],
)
def test_init_distributed_rejects_bad_arguments(
    kwargs: dict[str, Any], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All of these fail before megatron is imported or any process group exists."""
    if torch.cuda.is_available() and kwargs.get("backend") == "nccl":
        pytest.skip("nccl is valid on this host")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        init_distributed(**kwargs)


def test_single_process_default_path(single: dict[str, Any]) -> None:
    info = single["info"]
    assert info["world_size"] == info["tp_size"] == info["dp_size"] == 1
    assert (info["backend"], info["device"]) == ("gloo", "cpu")


# ------------------------------------------------------------------------------- patch layer


def test_noop_when_cuda_reports_available(single: dict[str, Any]) -> None:
    noop = single["gpu_noop"]
    assert noop["returned"] is False
    assert noop["patches"] == 0 and noop["active"] is False
    assert noop["changed"] == [], "apply_cpu_compat() touched megatron with CUDA 'available'"
    assert noop["modules_checked"] > 50
    assert "CUDA is available" in noop["describe"]


def test_registry_idempotent_and_torch_untouched(single: dict[str, Any]) -> None:
    assert single["apply_again"] is True
    assert single["n_patches_after_second_apply"] == single["n_patches"] > 0
    text = single["describe"]
    for needle in ("torch-view", "rewrite", "replace", "CudaRNGStatesTracker", "clip_grads"):
        assert needle in text
    assert single["torch_cuda_untouched"], "the global torch.cuda must stay as torch ships it"
    assert "torch_cuda_current_device" not in single, "torch.cuda.current_device() must still fail"


# ------------------------------------------------------------------------------- RNG tracker


def test_rng_tracker_matches_cuda_semantics(single: dict[str, Any]) -> None:
    first, second = single["rng"]
    default = _draws(SEED)
    model_parallel = _draws(SEED + 2718)  # megatron: seed + 2718 + tp_rank
    for draws in (first, second):  # reseeding reproduces everything
        np.testing.assert_array_equal(draws["a"], default[0])
        np.testing.assert_array_equal(draws["c"], default[1])  # fork left the stream untouched
        np.testing.assert_array_equal(draws["b"], model_parallel[0])
        np.testing.assert_array_equal(draws["d"], model_parallel[1])  # fork resumes its stream
        np.testing.assert_array_equal(draws["e"], _draws(SEED)[0])  # data-parallel-rng


def test_rng_tracker_tp_consistency(pair: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(pair):
        draws = result["rng"][0]
        np.testing.assert_array_equal(draws["a"], _draws(SEED)[0])
        np.testing.assert_array_equal(draws["b"], _draws(SEED + 2718 + rank)[0])
    assert not np.array_equal(pair[0]["rng"][0]["b"], pair[1]["rng"][0]["b"])


def test_init_is_reproducible(single: dict[str, Any]) -> None:
    assert single["init_max_diff"] == 0.0


def test_tp2_dropout_keeps_replicated_grads_identical(pair: list[dict[str, Any]]) -> None:
    a, b = pair[0]["dropout_replicated_grads"], pair[1]["dropout_replicated_grads"]
    assert set(a) == set(b) and len(a) > 4
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # Control: rank-dependent default streams make the same grads differ, so the check bites.
    a, b = pair[0]["desync_replicated_grads"], pair[1]["desync_replicated_grads"]
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) > 1e-6


# ------------------------------------------------------------------------------- numerics


def test_tp1_and_tp2_losses_agree(single: dict[str, Any], pair: list[dict[str, Any]]) -> None:
    tp1, tp2 = single["tp1_losses"], pair[0]["tp2_losses"]
    assert len(tp1) == len(tp2) == TRAIN_STEPS
    assert tp2 == pair[1]["tp2_losses"]
    assert abs(tp1[0] - tp2[0]) <= 1e-5
    np.testing.assert_allclose(tp2, tp1, rtol=0, atol=1e-5)
    assert tp1[-1] < tp1[0], "three Adam steps on repeated data should lower the loss"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dp2_distributed_optimizer_matches_single_rank(
    single: dict[str, Any], pair: list[dict[str, Any]], optimizer: str
) -> None:
    ref = single["dp_reference"][optimizer]
    rank0, rank1 = pair[0]["dp2"][optimizer], pair[1]["dp2"][optimizer]
    assert set(rank0) == set(rank1) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=name)
        np.testing.assert_allclose(rank0[name], ref[name], rtol=0, atol=1e-6, err_msg=name)
    moved = max(float(np.abs(ref[n] - single["initial_params"][n]).max()) for n in ref)
    assert moved > 1e-4, "the step must actually change the parameters"


def test_optimizer_update_rules(single: dict[str, Any]) -> None:
    rules = single["update_rules"]
    assert rules["sgd_max_err"] <= 1e-7  # p1 = p0 - lr * g
    assert rules["adam_max_err"] <= 1e-7  # step 1: p1 = p0 - lr * g / (|g| + eps)
    assert rules["sgd_ok"] and rules["adam_ok"]


def test_recompute_gives_identical_gradients(single: dict, pair: list[dict]) -> None:
    for result in (single, *pair):
        rec = result["recompute"]
        assert rec["loss_plain"] == rec["loss_recompute"]
        assert rec["max_grad_diff"] == 0.0
        assert rec["n_grads"] > 10
        assert rec["dropout_changes_loss"], "dropout must be active for the RNG replay to matter"


def test_dist_checkpointing_roundtrip(pair: list[dict[str, Any]]) -> None:
    keys = ("same_after_load", "same_loss_next_step", "same_after_next_step")
    for result in pair:
        assert result["checkpoint"] == dict.fromkeys(keys, True)


def test_default_causal_mask_equals_explicit_mask(single: dict[str, Any]) -> None:
    assert single["mask_none_loss"] == single["mask_explicit_loss"]


def test_forward_backward_no_pipelining_matches_full_batch(single: dict[str, Any]) -> None:
    assert single["microbatch_grad_max_diff"] <= 1e-6


# =============================================================================================
# Spawned-rank side: everything below runs inside the children started by run_distributed.
# =============================================================================================

SEED = 1234
RNG_DRAW = 4
TRAIN_STEPS = 3
LR = {"sgd": 0.5, "adam": 1e-3}
DISTRIBUTED_OPTIMIZER = {"adam": True, "sgd": False}
"""megatron's DistributedOptimizer supports Adam only; SGD runs on the plain (FP32) optimizer."""
ADAM_EPS = 1e-6
"""Not 1e-8: step 1 of Adam is lr * g / (|g| + eps), so with eps=1e-8 a gradient near zero turns
an fp32 summation-order difference of 1e-11 (DP=2 vs one rank) into a 1e-6 parameter change."""
DP_BATCH_SEED = 21
DROPOUT = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _wrap(model: Any, kind: str, *, distributed: bool, clip: float) -> tuple[Any, Any]:
    lr, eps = LR[kind], ADAM_EPS
    return wrap_ddp(model, kind, lr=lr, adam_eps=eps, distributed=distributed, clip=clip)


def _rng_draws() -> list[dict[str, torch.Tensor]]:
    """Draws around tracker forks, twice from the same seed."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name

    out = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(SEED)
        tracker = get_cuda_rng_tracker()
        a = torch.rand(RNG_DRAW)
        with tracker.fork():
            b = torch.rand(RNG_DRAW)
            with tracker.fork(get_data_parallel_rng_tracker_name()):
                e = torch.rand(RNG_DRAW)
        c = torch.rand(RNG_DRAW)
        with tracker.fork():
            d = torch.rand(RNG_DRAW)
        out.append({"a": a, "b": b, "c": c, "d": d, "e": e})
    return out


def _noop_with_cuda_available() -> dict[str, Any]:
    """apply_cpu_compat() with torch.cuda.is_available patched to True must change nothing."""
    import importlib
    import sys

    import learner.megatron.cpu as compat

    importlib.import_module(
        "megatron.core.tensor_parallel.random"
    )  # what learner.megatron.rng patches
    for name in {m for m, _ in compat.TORCH_VIEW_MODULES} | {r.module for r in compat.REWRITES}:
        importlib.import_module(name)

    def snapshot() -> dict[str, int]:
        mods = [m for n, m in sys.modules.items() if n.startswith("megatron") and m is not None]
        mods += [torch, torch.cuda]
        return {f"{m.__name__}.{k}": id(v) for m in mods for k, v in list(vars(m).items())}

    before, real = snapshot(), torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    try:
        result = {"returned": compat.apply_cpu_compat(), "describe": compat.describe_patches()}
        result |= {"patches": len(compat.applied_patches()), "active": compat.cpu_compat_active()}
    finally:
        torch.cuda.is_available = real  # type: ignore[assignment]
    after = snapshot()
    result["changed"] = sorted(k for k in before | after if before.get(k) != after.get(k))
    result["modules_checked"] = len({k.rsplit(".", 1)[0] for k in before})
    return result


def _replicated_grads(full: dict[str, torch.Tensor], desync: bool) -> dict[str, torch.Tensor]:
    """Grads of the TP-replicated params after a dropout forward/backward at TP=2."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model = load_full_params(tiny_gpt(2, **DROPOUT), full)
    model_parallel_cuda_manual_seed(SEED + 2)
    if desync:  # control: a different default stream on each TP rank
        torch.manual_seed(SEED + 100 + ps.get_tensor_model_parallel_rank())
    lm_loss(model, *token_batch(2, seed=14)).backward()
    params = model.named_parameters()
    return {n: p.grad for n, p in params if not getattr(p, "tensor_model_parallel", False)}


def _recompute_check(full: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    """Full/uniform activation recompute vs none, both with dropout and the same seed."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tokens, labels = token_batch(2, seed=13)
    losses, grads = {}, {}
    for recompute in (False, True):
        model = load_full_params(tiny_gpt(tp, **DROPOUT, **(RECOMPUTE if recompute else {})), full)
        model_parallel_cuda_manual_seed(SEED + 1)
        loss = lm_loss(model, tokens, labels)
        loss.backward()
        losses[recompute] = float(loss.detach())
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        plain = float(lm_loss(load_full_params(tiny_gpt(tp), full), tokens, labels))
    diffs = [float((grads[True][n] - g).abs().max()) for n, g in grads[False].items()]
    out = {"loss_plain": losses[False], "loss_recompute": losses[True], "n_grads": len(diffs)}
    return out | {"max_grad_diff": max(diffs), "dropout_changes_loss": plain != losses[False]}


def _update_rules(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One optimizer step (no clipping) against the textbook SGD / Adam update."""
    out: dict[str, Any] = {}
    tokens, labels = token_batch(4, seed=12)
    for kind in ("sgd", "adam"):
        model = load_full_params(tiny_gpt(1), full)
        ddp, opt = _wrap(model, kind, distributed=DISTRIBUTED_OPTIMIZER[kind], clip=0.0)
        before = full_params(model)
        forward_backward(ddp, opt, tokens, labels)
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        ok, _, _ = opt.step()
        err = 0.0
        for name, param in model.named_parameters():
            g = grads[name]
            update = g if kind == "sgd" else g / (g.abs() + ADAM_EPS)
            err = max(err, float((param.detach() - (before[name] - LR[kind] * update)).abs().max()))
        out[f"{kind}_max_err"], out[f"{kind}_ok"] = err, bool(ok)
    return out


def _microbatch_grad_diff(full: dict[str, torch.Tensor]) -> float:
    """forward_backward_no_pipelining over 2 microbatches vs one batch: same main_grad."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, labels = token_batch(4, seed=15)

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        t, lab = next(data_iterator)
        b, s = t.shape
        out = model(t, torch.arange(s).expand(b, s), causal_mask(b, s), labels=lab)
        return out, lambda output: (output.mean(), {"loss": output.mean().detach()})

    grads = []
    for num_micro in (1, 2):
        ddp, _ = _wrap(load_full_params(tiny_gpt(1), full), "sgd", distributed=False, clip=0.0)
        ddp.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(zip(tokens.chunk(num_micro), labels.chunk(num_micro), strict=True)),
            model=[ddp],
            num_microbatches=num_micro,
            seq_length=TINY_SEQ,
            micro_batch_size=4 // num_micro,
        )
        finalize_model_grads([ddp])
        grads.append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
    return max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])


def _tp_losses(full: dict[str, torch.Tensor], tp: int) -> list[float]:
    """TRAIN_STEPS Adam steps (non-distributed optimizer, clip 1.0) on one repeated batch."""
    ddp, opt = _wrap(load_full_params(tiny_gpt(tp), full), "adam", distributed=False, clip=1.0)
    tokens, labels = token_batch(4, seed=11)
    return [train_step(ddp, opt, tokens, labels) for _ in range(TRAIN_STEPS)]


def _dp_params(
    full: dict[str, torch.Tensor], kind: str, tokens: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One DDP step (clip 1.0; Adam: DistributedOptimizer) on this rank's share of the batch."""
    model = load_full_params(tiny_gpt(1), full)
    ddp, opt = _wrap(model, kind, distributed=DISTRIBUTED_OPTIMIZER[kind], clip=1.0)
    train_step(ddp, opt, tokens, labels)
    return full_params(model)


def _checkpoint_roundtrip(path: Path, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """dist_checkpointing save of model + DistributedOptimizer (dp_reshardable) after one step,
    load into a differently initialised copy, take one more step on both."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    runs = []
    for seed in (SEED + 3, SEED + 4):
        model_parallel_cuda_manual_seed(seed)
        model = tiny_gpt(1)
        runs.append((model, *_wrap(model, "adam", distributed=True, clip=1.0)))
    (model_a, ddp_a, opt_a), (model_b, ddp_b, opt_b) = runs
    train_step(ddp_a, opt_a, tokens, labels)
    path.mkdir(exist_ok=True)
    model_sd = model_a.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt_a.sharded_state_dict(model_sd, metadata=meta)}
    dist_checkpointing.save(state, str(path))

    # megatron 0.16.1 without Apex/TE: DistributedOptimizer.state_dict() asserts one shared
    # 'step' over torch AdamW's per-param states, which a fresh optimizer has none of. One
    # throw-away step creates them; the load below overwrites params and all optimizer state.
    train_step(ddp_b, opt_b, *token_batch(2, seed=17))
    model_sd = model_b.sharded_state_dict()
    opt_sd = opt_b.sharded_state_dict(model_sd, is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, str(path))
    model_b.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 params: the optimizer's main params are views of them
        opt_b.load_state_dict(loaded["optimizer"])
    # megatron 0.16.1 without Apex/TE gives every param state the *same* 'step' tensor on load,
    # and torch AdamW then increments it once per param per step: un-share it.
    for state in opt_b.chained_optimizers[0].optimizer.state.values():
        state["step"] = state["step"].clone()
    same_after_load = params_equal(model_a, model_b)
    losses = (train_step(ddp_a, opt_a, tokens, labels), train_step(ddp_b, opt_b, tokens, labels))
    return {
        "same_after_load": same_after_load,
        "same_loss_next_step": losses[0] == losses[1],
        "same_after_next_step": params_equal(model_a, model_b),
    }


def single_rank_checks(workdir: str) -> dict[str, Any]:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from learner.megatron.cpu import applied_patches, apply_cpu_compat, describe_patches
    from learner.parallel import destroy_distributed, init_distributed

    out: dict[str, Any] = {"gpu_noop": _noop_with_cuda_available()}
    real_current_device = torch.cuda.current_device
    info = init_distributed(tp=1, seed=SEED)
    out["info"] = {**vars(info), "device": str(info.device)}
    out["n_patches"] = len(applied_patches())
    out["apply_again"] = apply_cpu_compat()
    out["n_patches_after_second_apply"] = len(applied_patches())
    out["describe"] = describe_patches()
    with contextlib.suppress(AssertionError, RuntimeError):  # CPU torch: "not compiled with CUDA"
        out["torch_cuda_current_device"] = torch.cuda.current_device()
    out["torch_cuda_untouched"] = torch.cuda.current_device is real_current_device
    out["rng"] = _rng_draws()

    models = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(SEED)
        models.append(full_params(tiny_gpt(1)))
    out["init_max_diff"] = max(float((models[0][n] - models[1][n]).abs().max()) for n in models[0])
    full = models[0]
    torch.save(full, Path(workdir) / "full.pt")
    out["initial_params"] = full

    out["tp1_losses"] = _tp_losses(full, tp=1)
    tokens, labels = token_batch(4, seed=DP_BATCH_SEED)
    out["dp_reference"] = {k: _dp_params(full, k, tokens, labels) for k in ("sgd", "adam")}
    out["update_rules"] = _update_rules(full)
    out["recompute"] = _recompute_check(full, tp=1)
    with torch.no_grad():
        model = load_full_params(tiny_gpt(1), full)
        out["mask_none_loss"] = float(lm_loss(model, tokens, labels, explicit_mask=False))
        out["mask_explicit_loss"] = float(lm_loss(model, tokens, labels))
    out["microbatch_grad_max_diff"] = _microbatch_grad_diff(full)
    destroy_distributed()
    return out


def two_rank_checks(workdir: str) -> dict[str, Any]:
    from learner.parallel import destroy_distributed, init_distributed

    info = init_distributed(tp=2, seed=SEED)
    assert (info.tp_size, info.dp_size) == (2, 1)
    full = torch.load(Path(workdir) / "full.pt")
    out: dict[str, Any] = {"rng": _rng_draws()}
    out["tp2_losses"] = _tp_losses(full, tp=2)
    out["recompute"] = _recompute_check(full, tp=2)
    out["dropout_replicated_grads"] = _replicated_grads(full, desync=False)
    out["desync_replicated_grads"] = _replicated_grads(full, desync=True)

    destroy_distributed(keep_process_group=True)
    info = init_distributed(tp=1, seed=SEED)
    assert (info.tp_size, info.dp_size) == (1, 2)
    tokens, labels = token_batch(4, seed=DP_BATCH_SEED)
    mine = slice(2 * info.dp_rank, 2 * info.dp_rank + 2)
    out["dp2"] = {k: _dp_params(full, k, tokens[mine], labels[mine]) for k in ("sgd", "adam")}
    out["checkpoint"] = _checkpoint_roundtrip(Path(workdir) / "ckpt", tokens[mine], labels[mine])
    destroy_distributed()
    return out
