"""The megatron looped models: HF conversion, gradients across TP, recompute, critic, DDP and
dist_checkpointing. Two spawned runs: two ranks at TP=2 (which also save a dist checkpoint),
then one rank at TP=1 (which loads it); the parent compares what they return."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.config import LlamaConfig, ModelConfig, tiny_config
from models.reference import ReplayItem, build_model
from tests.learner.dist_utils import run_distributed

pytestmark = pytest.mark.megatron

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
GRAD_FAMILIES = ("huginn", "ouro")


def tp2_config(family: str) -> ModelConfig:
    cfg = tiny_config(family)
    if family == "huginn":
        return cfg
    assert isinstance(cfg, LlamaConfig)
    return dataclasses.replace(cfg, num_attention_heads=4, num_key_value_heads=2)


def make_items(config: ModelConfig, seed: int) -> list[ReplayItem]:
    """Random completions with random exit depths (depths[0] = the model's max depth)."""
    gen = torch.Generator().manual_seed(seed)
    top = config.max_depth
    items = []
    for plen, n in ((4, 6), (7, 3), (2, 8)):
        prompt = torch.randint(3, 512, (plen,), generator=gen).tolist()
        comp = torch.randint(3, 512, (n,), generator=gen).tolist()
        depths = [top] + torch.randint(1, top + 1, (n - 1,), generator=gen).tolist()
        items.append(ReplayItem(prompt, comp, 2**63 + 11 * plen, depths))
    return items


def _loss(model: Any, batch: Any) -> torch.Tensor:
    from learner.replay import replay_forward

    out = replay_forward(model, batch, temperature=0.8)
    m = batch.loss_mask
    return -(out.logprobs[m]).mean() - 0.1 * out.entropy[m].mean() + out.hidden.pow(2).mean()


def _grads(family: str, recompute: str = "none") -> dict[str, torch.Tensor]:
    from learner.hf_convert import gather_hf_state
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.replay import make_replay_batch

    cfg = tp2_config(family)
    model = build_policy(cfg, MegatronOptions(recompute=recompute, init_seed=3))
    _loss(model, make_replay_batch(make_items(cfg, 1))).backward()
    return gather_hf_state(model, grads=True)


def _round_trips() -> dict[str, bool]:
    from learner.hf_convert import gather_hf_state
    from learner.megatron.model import build_policy

    ok = {}
    for i, family in enumerate(FAMILIES):
        cfg = tp2_config(family)
        state = build_model(cfg, seed=10 + i).state_dict()
        got = gather_hf_state(build_policy(cfg, hf_state=state))
        ok[family] = got.keys() == state.keys() and all(
            torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items()
        )
        if family == "huginn":
            ok["huginn_tied"] = got["lm_head.weight"] is got["transformer.wte.weight"]
            ok["huginn_freqs_fp32"] = got["freqs_cis"].dtype == torch.float32
    return ok


def tp2_worker(ckpt_dir: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from learner.megatron.model import build_policy
    from learner.parallel import destroy_distributed, init_distributed

    init_distributed(2)
    out: dict[str, Any] = {"round_trip": _round_trips()}
    out["grads"] = {f: _grads(f) for f in GRAD_FAMILIES}
    for i, family in enumerate(GRAD_FAMILIES):
        cfg = tp2_config(family)
        model = build_policy(cfg, hf_state=build_model(cfg, seed=20 + i).state_dict())
        path = Path(ckpt_dir) / family
        if torch.distributed.get_rank() == 0:
            path.mkdir()
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(path))
    destroy_distributed()
    return out


def _checks_tp1() -> dict[str, Any]:
    """Critic, input validation, batch layout, DDP + Adam step, bf16 forward (TP=1)."""
    from learner.megatron.model import build_critic, build_policy
    from learner.megatron.options import MegatronOptions
    from learner.replay import make_replay_batch, replay_forward
    from tests.learner.dist_utils import wrap_ddp

    cfg = tp2_config("huginn")
    items = make_items(cfg, 2)
    batch = make_replay_batch(items)
    out: dict[str, Any] = {}
    out["batch"] = dict(
        tokens=batch.tokens[0].tolist(),
        targets=batch.targets[0].tolist(),
        depths=batch.depths[0].tolist(),
        loss_mask=batch.loss_mask[0].tolist(),
        valid=batch.valid.sum(1).tolist(),
    )
    policy = build_policy(cfg)
    pol = policy(batch.tokens, batch.depths, batch.valid, batch.latent_seeds)
    # head_rows: the head at the loss positions only == those rows of the full logits (+ grads)
    sel, w = batch.loss_mask, policy.core[0].linear_qkv.weight
    rows = policy(batch.tokens, batch.depths, batch.valid, batch.latent_seeds, head_rows=sel)
    full = pol.logits[sel]
    out["head_rows_shape"] = tuple(rows.logits.shape) == (int(sel.sum()), pol.logits.shape[-1])
    out["head_rows_err"] = float((rows.logits - full).detach().abs().max())
    g_rows = torch.autograd.grad(rows.logits.logsumexp(-1).sum(), w)[0]
    g_full = torch.autograd.grad(full.logsumexp(-1).sum(), w)[0]
    out["head_rows_grad_err"] = float((g_rows - g_full).abs().max() / g_full.abs().max())
    critic = build_critic(cfg, policy=policy)
    crit = critic(batch.tokens, batch.depths, batch.valid, batch.latent_seeds)
    out["critic_shape"] = tuple(crit.values.shape)
    out["critic_zero"] = bool((crit.values == 0).all())
    out["critic_trunk_equal"] = bool(torch.equal(crit.hidden, pol.hidden))
    critic2 = build_critic(cfg, policy=policy, value_init_std=0.1)
    crit2 = critic2(batch.tokens, batch.depths, batch.valid, batch.latent_seeds)
    expect = crit2.hidden @ critic2.value_head.weight[0] + critic2.value_head.bias[0]
    out["critic_value_err"] = float((crit2.values - expect).detach().abs().max())
    crit2.values[batch.valid].sum().backward()
    qkv: Any = critic2.core[0].linear_qkv
    out["critic_trunk_grad"] = float(qkv.weight.grad.abs().sum())
    errors = {}
    bad_valid = batch.valid.clone()
    bad_valid[0, 0] = False
    for name, args in {
        "valid_not_prefix": (batch.tokens, batch.depths, bad_valid, batch.latent_seeds),
        # deeper than the model's max_depth is allowed, beyond the wire's 255 not
        "depth_too_big": (batch.tokens, batch.depths * 0 + 256, batch.valid, batch.latent_seeds),
        "seed_count": (batch.tokens, batch.depths, batch.valid, [1]),
    }.items():
        try:
            policy(*args)
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = "ValueError" if str(e) else "empty"
    out["errors"] = errors
    ddp, opt = wrap_ddp(policy, "adam", lr=1e-3, adam_eps=1e-8, distributed=False, clip=1.0)
    losses = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = _loss(ddp, batch)
        loss.backward()
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([ddp])
        ok, _, _ = opt.step()
        losses.append(float(loss))
        out["opt_ok"] = bool(ok)
    out["ddp_losses"] = losses
    bf16 = build_policy(tp2_config("ouro"), MegatronOptions(params_dtype=torch.bfloat16))
    lp = replay_forward(bf16, make_replay_batch(make_items(tp2_config("ouro"), 3))).logprobs
    out["bf16_finite"] = bool(torch.isfinite(lp).all()) and lp.dtype == torch.float32
    return out


def tp1_worker(ckpt_dir: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from learner.hf_convert import gather_hf_state
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed

    init_distributed(1)
    out: dict[str, Any] = {"round_trip": _round_trips()}
    out["grads"] = {f: _grads(f) for f in GRAD_FAMILIES}
    recompute = _grads("huginn", "block")
    out["recompute_equal"] = all(
        torch.equal(recompute[k], out["grads"]["huginn"][k]) for k in recompute
    )
    loaded = {}
    for i, family in enumerate(GRAD_FAMILIES):
        cfg = tp2_config(family)
        model = build_policy(cfg, MegatronOptions(init_seed=99))
        state = dist_checkpointing.load(model.sharded_state_dict(), str(Path(ckpt_dir) / family))
        model.load_state_dict(state)
        want = build_model(cfg, seed=20 + i).state_dict()
        got = gather_hf_state(model)
        loaded[family] = all(torch.equal(got[k], v) for k, v in want.items())
    out["dist_ckpt_tp2_to_tp1"] = loaded
    out.update(_checks_tp1())
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("dist_ckpt"))
    tp2 = run_distributed(tp2_worker, 2, ckpt, timeout_s=240)
    tp1 = run_distributed(tp1_worker, 1, ckpt, timeout_s=240)[0]
    return tp1, tp2[0]


def test_hf_round_trip_bit_exact(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    for run in runs:
        assert all(run["round_trip"].values()), run["round_trip"]


def test_gradients_agree_across_tp(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    tp1, tp2 = runs
    for family in GRAD_FAMILIES:
        g1, g2 = tp1["grads"][family], tp2["grads"][family]
        assert g1.keys() == g2.keys()
        assert any(np.abs(g).max() > 0 for g in g1.values())
        worst = max(float(np.abs(g1[k] - g2[k]).max()) for k in g1)
        assert worst <= 1e-5, (family, worst)


def test_recompute_gives_identical_gradients(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert runs[0]["recompute_equal"]


def test_dist_checkpoint_reshards_tp2_to_tp1(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert all(runs[0]["dist_ckpt_tp2_to_tp1"].values()), runs[0]["dist_ckpt_tp2_to_tp1"]


def test_critic(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    tp1 = runs[0]
    assert tp1["critic_shape"] == (3, 9)
    assert tp1["critic_zero"] and tp1["critic_trunk_equal"]
    assert tp1["critic_value_err"] <= 1e-6
    assert tp1["critic_trunk_grad"] > 0


def test_replay_batch_layout(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    b = runs[0]["batch"]
    items = make_items(tp2_config("huginn"), 2)
    it = items[0]
    seq = list(it.prompt_tokens) + list(it.completion_tokens)[:-1]
    assert b["tokens"][: len(seq)] == seq and set(b["tokens"][len(seq) :]) <= {0}
    plen, n = len(it.prompt_tokens), len(it.completion_tokens)
    assert b["targets"][plen - 1 : plen - 1 + n] == list(it.completion_tokens)
    assert b["depths"][: plen - 1] == [6] * (plen - 1)
    assert b["depths"][plen - 1 : plen - 1 + n] == list(it.exit_depths)
    assert b["loss_mask"] == [plen - 1 <= p < plen - 1 + n for p in range(len(b["loss_mask"]))]
    assert b["valid"] == [len(x.prompt_tokens) + len(x.completion_tokens) - 1 for x in items]


def test_head_rows_are_the_full_logits_rows(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    tp1 = runs[0]
    assert tp1["head_rows_shape"]
    assert tp1["head_rows_err"] <= 1e-6 and tp1["head_rows_grad_err"] <= 1e-6, tp1


def test_bad_inputs_raise(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert set(runs[0]["errors"].values()) == {"ValueError"}, runs[0]["errors"]


def test_ddp_adam_steps(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    tp1 = runs[0]
    assert tp1["opt_ok"] and tp1["ddp_losses"][1] < tp1["ddp_losses"][0]
    assert tp1["bf16_finite"]
