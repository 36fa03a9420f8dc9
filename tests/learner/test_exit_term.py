"""The exit as an action, learner side: the exit term of the objective
(learner.objectives.exit_term) by hand, its refusals, and the reference policy's forward
recomputing each token's sampled-exit log-prob bit for bit as the generator recorded it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from learner.batching import build_batch
from learner.config import OptimConfig, ScheduleConfig, TrainConfig
from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss
from learner.torch_policy import TorchPolicy
from models.config import tiny_config
from models.exits import SampledGate
from models.reference import SamplingParams, build_model, generate
from proto.records import Rollout

B, T = 2, 3
ADV = torch.tensor([1.0, -2.0])


def _loss(cfg: ObjectiveConfig, elp: torch.Tensor, behav: torch.Tensor, **kw: torch.Tensor):
    lp = torch.full((B, T), -1.0)
    return policy_loss(cfg, dict(mask=torch.ones(B, T), advantages=ADV, logp=lp.requires_grad_(),
                                 behav_logp=lp.detach(), exit_logp=elp, exit_behav=behav, **kw))  # fmt: skip


def test_exit_term_gradient_by_hand() -> None:
    """grpo, exit_coef c: on-policy the exit's gradient is -c A / N per token; a ratio past
    the clip on the side the advantage pushes gets none; the entropy bonus adds -c_H / N."""
    c, ch = 0.5, 0.1
    cfg = ObjectiveConfig(kind="grpo", exit_coef=c, exit_entropy_coef=ch)
    behav = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.9, -2.0]])
    elp = behav.clone().requires_grad_()
    ent = torch.full((B, T), 0.4, requires_grad=True)
    loss, m = _loss(cfg, elp, behav, exit_entropy=ent)
    loss.backward()
    assert elp.grad is not None and ent.grad is not None
    want = -c * ADV[:, None].expand(B, T) / (B * T)
    assert torch.allclose(elp.grad, want, atol=1e-7), elp.grad
    assert torch.allclose(ent.grad, torch.full((B, T), -ch / (B * T)), atol=1e-7)
    assert m["exit_ratio_mean"] == 1.0 and m["exit_clip_frac"] == 0.0
    assert math.isclose(m["exit_entropy"], 0.4, rel_tol=1e-6)
    assert math.isclose(m["exit_logp"], float(behav.mean()), rel_tol=1e-6)
    # ratio 1.5 > 1 + eps_high on A > 0 tokens (row 0): clipped, no gradient there
    elp = (behav + torch.tensor([[math.log(1.5)] * T, [0.0] * T])).requires_grad_()
    loss, m = _loss(ObjectiveConfig(kind="grpo", exit_coef=c), elp, behav)
    loss.backward()
    assert elp.grad is not None
    assert bool((elp.grad[0] == 0).all()) and torch.allclose(elp.grad[1], want[1], atol=1e-7)
    assert math.isclose(m["exit_clip_frac"], 0.5)
    # exit_coef 0: the same loss as without exit inputs
    plain = ObjectiveConfig(kind="grpo")
    a, _ = _loss(plain, behav.clone().requires_grad_(), behav)
    lp = torch.full((B, T), -1.0, requires_grad=True)
    b, _ = policy_loss(plain, dict(mask=torch.ones(B, T), advantages=ADV, logp=lp,
                                   behav_logp=lp.detach()))  # fmt: skip
    assert torch.equal(a, b)
    # a non-finite claim: that token's exit term is 0, the others unchanged
    bad = behav.clone()
    bad[1, 2] = -math.inf
    elp = behav.clone().requires_grad_()
    loss, _ = _loss(ObjectiveConfig(kind="grpo", exit_coef=c), elp, bad)
    loss.backward()
    assert elp.grad is not None and float(elp.grad[1, 2]) == 0.0
    assert torch.allclose(elp.grad[0], want[0], atol=1e-7)


@pytest.mark.parametrize("kind", ["dppo", "grpo"])
def test_exit_term_behaviour_weight_by_hand(kind: str) -> None:
    """dppo (and grpo with is_cap): the exit's own decoupled weight w_e = exp(exit_prox -
    exit_behav), truncated at is_cap, multiplies its surrogate (ratio against exit_prox):
    on-policy w.r.t. the proximal weights the gradient is -c w_e A / N per token."""
    c, cap = 0.5, 2.0
    cfg = ObjectiveConfig(kind=kind, exit_coef=c, is_cap=cap)
    behav = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.9, -2.0]])
    prox = behav + torch.tensor([[0.1, -0.3, 1.5], [0.0, 0.2, -0.4]])  # w_e: 1.5 over the cap
    elp = prox.clone().requires_grad_()
    lp = torch.full((B, T), -1.0)
    adv = ADV[:, None].expand(B, T)
    loss, m = policy_loss(cfg, dict(mask=torch.ones(B, T), advantages=adv,
                                    logp=lp.clone().requires_grad_(), behav_logp=lp,
                                    prox_logp=lp, exit_logp=elp, exit_behav=behav,
                                    exit_prox=prox))  # fmt: skip
    loss.backward()
    w = (prox - behav).exp().clamp(max=cap)
    want = -c * w * ADV[:, None] / (B * T)
    assert elp.grad is not None and torch.allclose(elp.grad, want, atol=1e-7), (elp.grad, want)
    assert math.isclose(m["exit_is_weight_mean"], float(w.mean()), rel_tol=1e-6)
    with pytest.raises(ValueError, match=r"batch\['exit_prox'\]: required"):
        policy_loss(cfg, dict(mask=torch.ones(B, T), advantages=adv, logp=lp, behav_logp=lp,
                              prox_logp=lp, exit_logp=elp, exit_behav=behav))  # fmt: skip


def test_exit_term_refusals() -> None:
    for kw, why in (
        ({"exit_coef": -1.0}, "exit_coef=-1.0: must be a finite number >= 0"),
        ({"exit_coef": math.nan}, "exit_coef=nan: must be a finite number >= 0"),
        ({"exit_coef": 1.0, "kind": "flow_dppo"}, "applies to kinds ppo, grpo and dppo"),
        ({"exit_coef": 1.0, "kind": "divergence_ppo"}, "applies to kinds ppo, grpo and dppo"),
    ):
        with pytest.raises(ValueError, match=why):
            ObjectiveConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train a sampled exit"):
        TrainConfig(objective=ObjectiveConfig(exit_coef=1.0))
    with pytest.raises(ValueError, match=r"batch\['exit_logp'\]: required"):
        _loss(ObjectiveConfig(kind="grpo", exit_coef=1.0), None, torch.zeros(B, T))  # type: ignore[arg-type]


def _ouro_rollouts(m: torch.nn.Module, policy: SampledGate, mode: str) -> list[Rollout]:
    prompts, seeds = [[3, 1, 4], [1, 5], [9, 2, 6, 5], [3, 5]], [21, 22, 23, 24]
    gens = generate(m, prompts, seeds, SamplingParams(max_new_tokens=7), policy, mode)
    out = []
    for i, g in enumerate(gens):
        assert g.exit_logprobs is not None
        out.append(Rollout(
            rollout_id=f"w{i // 2}/{i % 2}", work_id=f"w{i // 2}", prompt_id=f"p{i // 2}",
            sample_index=i % 2, generator_id="g", latent_seed=g.latent_seed,
            prompt_tokens=np.asarray(g.prompt_tokens, np.int32),
            tokens=np.asarray(g.tokens, np.int32), logprobs=g.logprobs.numpy(),
            exit_depths=np.asarray(g.exit_depths, np.uint8), weight_version=0,
            reward=float(i % 2), full_depth=g.full_depth,
            exit_logprobs=g.exit_logprobs.numpy(),
        ))  # fmt: skip
    return out


@pytest.mark.parametrize("kv", ["full", "last_exited"])
def test_reference_policy_recomputes_the_claimed_exit_logprobs(kv: str) -> None:
    """Rollouts from models.reference.generate under SampledGate (tiny Ouro, exact): the
    reference backend's policy forward gives every response token's exit log-prob equal to
    the generator's claim bit for bit, and the exit term's gradient reaches the gate."""
    torch.manual_seed(0)
    m = build_model(tiny_config("ouro"), seed=3)
    with torch.no_grad():
        m.model.early_exit_gate.bias.fill_(-0.5)
    policy = SampledGate(kv=kv)
    rolls = _ouro_rollouts(m, policy, "exact")
    assert len({int(d) for r in rolls for d in r.exit_depths}) >= 3
    batch = build_batch(rolls)
    obj = ObjectiveConfig(kind="grpo", exit_coef=1.0, exit_entropy_coef=0.01)
    cfg = TrainConfig(global_batch_size=4, micro_batch_size=4, numerics="exact",
                      objective=obj, exit_min_depth=1)  # fmt: skip
    pol = TorchPolicy(cfg, m, OptimConfig(name="sgd", lr=0.1, distributed=False),
                      ScheduleConfig(), kv=kv)  # fmt: skip
    assert "exit_behav" in batch.extra
    st = pol.policy_stats(batch.rows(0, batch.size), None)
    sel = batch.mask > 0
    assert torch.equal(st["exit_logp"][sel], batch.extra["exit_behav"][sel])
    assert bool((st["exit_logp"][sel] < 0).all()) and bool((st["exit_entropy"][sel] > 0).all())
    assert torch.equal(st["logp"][sel], batch.behav_logp[sel])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, _ = policy_loss(obj, dict(mask=batch.mask, advantages=adv, logp=st["logp"],
                                    behav_logp=batch.behav_logp, exit_logp=st["exit_logp"],
                                    exit_behav=batch.extra["exit_behav"],
                                    exit_entropy=st["exit_entropy"]))  # fmt: skip
    loss.backward()
    g = m.model.early_exit_gate.weight.grad
    assert g is not None and float(g.abs().sum()) > 0


def test_a_lie_about_the_exit_is_refused_before_the_update(tmp_path: object) -> None:
    """The reference backend's step with logp_bounds (exact numerics: bound 0): rollouts
    whose token log-probs are honest but whose exit log-probs are not are refused before any
    update (weights unchanged, the liars named); the honest batch trains, and its measured
    mismatch (token and exit) is 0."""
    from pathlib import Path

    from models.checkpoint import save_checkpoint, state_dict_for_save
    from models.ties import tied_from_module
    from pipeline.backends.reference_trainer import ReferenceTrainer
    from pipeline.config.run import load_config

    torch.manual_seed(0)
    m = build_model(tiny_config("ouro"), seed=3)
    with torch.no_grad():
        m.model.early_exit_gate.bias.fill_(-0.5)
    root = Path(str(tmp_path)) / "ouro"
    save_checkpoint(state_dict_for_save(m), m.config.to_hf_dict(), root, tied=tied_from_module(m))
    policy = SampledGate()
    rolls = _ouro_rollouts(m, policy, "exact")
    cfg = load_config(None, ["backend=reference", "numerics=exact", "rollout.n=2",
                             "rollout.prompts_per_step=2", "rollout.temperature=1.0",
                             "rollout.exit_policy={kind: sampled_gate}", "objective.exit_coef=1.0",
                             "optimizer.name=sgd", "optimizer.distributed=false",
                             "optimizer.lr=0.1"])  # fmt: skip
    tr = ReferenceTrainer(cfg, root)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    lie = [dataclasses.replace(r) for r in rolls]
    assert lie[1].exit_logprobs is not None
    lie[1].exit_logprobs = lie[1].exit_logprobs + np.float32(-0.25)  # claims less likely exits
    res = tr.step(lie, [False] * 4, logp_bounds=[0.0] * 4)
    assert res.metrics == {"refused_rollouts": 1.0} and res.refused == [1]
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert res.mismatch[1] >= 0.25 - 1e-6 and max(res.mismatch[i] for i in (0, 2, 3)) == 0
    res = tr.step(rolls, [False] * 4, logp_bounds=[0.0] * 4)
    out = res.metrics
    assert "refused_rollouts" not in out and res.mismatch == [0.0] * 4
    assert out["exit_entropy"] > 0 and out["exit_ratio_mean"] == 1.0  # on-policy, exact
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())


def test_the_door_checks_exit_claims_against_the_run_policy() -> None:
    """Rule exit_logprob: a sampled-exit run admits only rollouts that carry finite exit
    log-probs <= 0; a run whose exits are decided admits none that carry them."""
    from pipeline.config.run import load_config
    from pipeline.core.validation import DoorRules, Expected, ModelLimits, check_rollout, door_rules

    sampled = door_rules(load_config(None, ["backend=reference",
                                            "rollout.exit_policy={kind: sampled_gate}"]))  # fmt: skip
    assert sampled.sampled_exit and not door_rules(load_config()).sampled_exit
    r = Rollout(rollout_id="w/0", work_id="w", prompt_id="p", sample_index=0, generator_id="g",
                latent_seed=5, prompt_tokens=np.array([1, 2], np.int32),
                tokens=np.array([3, 4, 5], np.int32), logprobs=np.full(3, -0.5, np.float32),
                exit_depths=np.array([1, 3, 4], np.uint8), weight_version=0, reward=0.0,
                full_depth=4, exit_logprobs=np.array([-0.4, -1.2, -2.0], np.float32))  # fmt: skip
    exp = Expected(prompt_id="p", prompt_tokens=[1, 2], latent_seed=5, max_tokens=8,
                   min_version=0, max_version=0, sender="g")  # fmt: skip
    lim = ModelLimits(vocab_size=64, max_depth=4)
    assert check_rollout(r, expect=exp, limits=lim, rules=sampled) is None
    for bad, rules, why in (
        (dataclasses.replace(r, exit_logprobs=None), sampled, "no exit log-probs on a run"),
        (r, DoorRules(), "exit log-probs on a run whose exit policy does not sample"),
        (dataclasses.replace(r, exit_logprobs=np.array([-0.4, -np.inf, -2.0], np.float32)),
         sampled, "exit log-probs must be finite and <= 0"),
    ):  # fmt: skip
        got = check_rollout(bad, expect=exp, limits=lim, rules=rules)
        assert got is not None and got.reason == "exit_logprob" and why in got.detail, got


def _two_backends(root_s: str) -> dict[str, Any]:
    """test_both_policies_...'s body, in a process of its own (run_distributed): a megatron
    trainer in exact numerics leaves state in the process that moves a later fast-numerics
    megatron run's gradients at the 1e-6 level (test_loop_credit's huginn case failed after
    it in one pytest process; noticed, not yet found)."""
    from pathlib import Path

    from models.checkpoint import load_checkpoint, load_model, save_checkpoint, state_dict_for_save
    from models.ties import tied_from_module
    from pipeline.config.run import load_config

    root = Path(root_s) / "ouro"
    m = build_model(tiny_config("ouro"), seed=3)
    with torch.no_grad():
        m.model.early_exit_gate.bias.fill_(-0.5)
    save_checkpoint(state_dict_for_save(m), m.config.to_hf_dict(), root, tied=tied_from_module(m))
    rolls = _ouro_rollouts(load_model(root)[1], SampledGate(), "exact")
    over = ["numerics=exact", "rollout.n=2", "rollout.prompts_per_step=2",
            "rollout.temperature=1.0", "rollout.exit_policy={kind: sampled_gate}",
            "objective.exit_coef=0.5", "objective.exit_entropy_coef=0.02",
            "optimizer.lr=1e-3", "learner.backprop_depth=0"]  # fmt: skip
    out: dict[str, Any] = {"res": {}, "mism": {}, "worst": 0.0, "moved": False}
    weights = {}
    for backend in ("reference", "megatron"):
        cfg = load_config(None, [f"backend={backend}", *over])
        if backend == "reference":
            from pipeline.backends.reference_trainer import ReferenceTrainer

            t: Any = ReferenceTrainer(cfg, root)
        else:
            from pipeline.backends.megatron_adapter import MegatronTrainer

            t = MegatronTrainer(cfg, root)
        try:
            res = t.step(rolls, [False] * 4)
            out["res"][backend] = dict(res.metrics)
            out["mism"][backend] = list(res.mismatch)
            t.publish(Path(root_s) / backend, 1)
            weights[backend] = load_checkpoint(Path(root_s) / backend)[1]
        finally:
            t.close() if backend == "megatron" else None
    a, b = weights["reference"], weights["megatron"]
    out["same_names"] = sorted(a) == sorted(b)
    out["worst"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    start = load_checkpoint(root)[1]
    out["moved"] = any(not torch.equal(a[k], w) for k, w in start.items() if k in a)
    return out


@pytest.mark.megatron
def test_both_policies_train_the_exit_to_the_same_bits(tmp_path: object) -> None:
    """The megatron policy (learner.loop_forward.exit_forward: the gate after each core
    iteration through LoopedGPT's loop hook) and the reference policy (models.engine.chunk.run_chunk)
    on the same sampled-exit rollouts (tiny Ouro, exact numerics, grpo with the exit term and
    its entropy bonus): every metric of the update the same bits (the forwards agree exactly:
    exit log-probs, entropies, token log-probs) and each rollout's exit claim measured at 0;
    the updated weights the same bits (6.3e-7 apart until the gate's gradient was summed
    at one point in both graphs: learner.objectives.loops.tap)."""
    from tests.learner.dist_utils import run_distributed

    (out,) = run_distributed(_two_backends, 1, str(tmp_path), torchrun_env=False, timeout_s=300)
    ref, meg = out["res"]["reference"], out["res"]["megatron"]
    assert ref["exit_entropy"] > 0 and ref["updates"] == 1.0
    assert set(ref) == set(meg)
    bad = {k: (ref[k], meg[k]) for k in ref if ref[k] != meg[k] and not (ref[k] != ref[k])}
    assert not bad, bad
    assert out["mism"]["reference"] == out["mism"]["megatron"] == [0.0] * 4
    assert out["same_names"] and out["worst"] == 0.0, out["worst"]
    assert out["moved"]
