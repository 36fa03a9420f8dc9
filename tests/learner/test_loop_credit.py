"""Per-loop credit (objective.loop_weighting): the loop weights by hand, the
per-loop loss against the exit-loop loss, the two policies' bits, memory bounded by one loop.

Cost: the weight / loss tests are tensor-only (< 1 s); the cross-policy tests train one step
(2 epochs x 2 mini-batches) of a tiny model per backend (a few seconds each)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.config import TrainConfig
from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss
from learner.objectives.loops import LearnedLoopWeights, loop_weights
from models.errors import ConfigError
from proto.records import Rollout


def _w(kind: str, e: list[list[int]], gate: torch.Tensor | None = None, k: int = 4,
       full: int = 4, alpha: float = 1.0) -> torch.Tensor:  # fmt: skip
    cfg = ObjectiveConfig(loop_weighting=kind, **({"progressive_alpha": alpha}
                                                  if kind == "progressive" else {}))  # fmt: skip
    depths = torch.tensor(e)
    return loop_weights(cfg, depths, torch.full((depths.shape[0],), full), gate, k)


def test_loop_weights_by_hand() -> None:
    # e = 3: uniform 1/3 each; progressive alpha 2: 1, 4, 9 over 14; e = 0: off the response
    w = _w("uniform", [[3, 0, 1]])
    torch.testing.assert_close(w[0, 0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert w[0, 1].sum() == 0 and w[0, 2].tolist() == [1.0, 0.0, 0.0, 0.0]
    w = _w("progressive", [[3, 4]], alpha=2.0)
    torch.testing.assert_close(w[0, 0], torch.tensor([1 / 14, 4 / 14, 9 / 14, 0.0]))
    torch.testing.assert_close(w[0, 1], torch.tensor([1 / 30, 4 / 30, 9 / 30, 16 / 30]))
    # exit_pdf, lambda = (0.5, 0.25, 0.5, 0.9), D = 4:
    # p1 = 0.5, p2 = 0.25 * 0.5 = 0.125, p3 = 0.5 * 0.5 * 0.75 = 0.1875, p4 (last: the rest)
    # = 0.5 * 0.75 * 0.5 = 0.1875 (not 0.9 * ...). e = 2: (0.5, 0.125) / 0.625 = (0.8, 0.2);
    # e = 4: the four sum to 1
    lam = torch.tensor([0.5, 0.25, 0.5, 0.9])
    gate = torch.log(lam / (1 - lam)).expand(1, 2, 4)
    w = _w("exit_pdf", [[2, 4]], gate=gate)
    torch.testing.assert_close(w[0, 0], torch.tensor([0.8, 0.2, 0.0, 0.0]))
    torch.testing.assert_close(w[0, 1], torch.tensor([0.5, 0.125, 0.1875, 0.1875]))
    # D = 8 (the row runs deeper than K = 4): loop 4 is not the last, p4 = 0.9 * 0.1875
    w = _w("exit_pdf", [[4]], gate=gate[:, :1], full=8)
    p = torch.tensor([0.5, 0.125, 0.1875, 0.9 * 0.1875])
    torch.testing.assert_close(w[0, 0], p / p.sum())


def test_learned_weights_by_hand() -> None:
    """learned: w_tk = softmax over theta_1..theta_e_t; theta = 0 is uniform, the same bits;
    the loss's gradient reaches theta and one Adam step moves each used logit by lr (Adam's
    first step: lr x sign(g)); loops beyond every e_t keep theta = 0."""
    lw = LearnedLoopWeights(lr=0.1)
    e = torch.tensor([[3, 0, 1, 2]])
    assert torch.equal(lw.weights(e, 3), _w("uniform", e.tolist(), k=3))
    with torch.no_grad():
        lw.logits[:3] = torch.tensor([0.0, math.log(2.0), math.log(3.0)])
    w = lw.weights(e, 3)  # e = 3: (1, 2, 3) / 6; e = 2: (1, 2) / 3; e = 1: (1); e = 0: none
    torch.testing.assert_close(w[0], torch.tensor([[1 / 6, 2 / 6, 3 / 6], [0.0, 0.0, 0.0],
                                                   [1.0, 0.0, 0.0], [1 / 3, 2 / 3, 0.0]]))  # fmt: skip
    cfg = ObjectiveConfig(kind="grpo", loop_weighting="learned")
    batch, depths = _loss_batch("learned")
    lw = LearnedLoopWeights(lr=0.1)
    loss, _ = policy_loss(cfg, dict(batch, loop_weight=lw.weights(depths, 4), normalizer=7.0))
    loss.backward()
    g = lw.logits.grad
    assert g is not None and bool((g[:4] != 0).all()) and not bool(g[4:].any())
    # theta's gradient: RLTT's term sum_t sum_k w_tk(theta) (-A_t logp_tk) / N (token_mean over
    # the normalizer N = 7), by autograd on that formula alone
    probe = LearnedLoopWeights(lr=0.1)
    rltt = -batch["advantages"][..., None] * batch["loop_logp"]
    term = (probe.weights(depths, 4) * rltt).sum(-1)
    (term * batch["mask"]).sum().div(7.0).backward()
    assert probe.logits.grad is not None
    torch.testing.assert_close(g, probe.logits.grad, rtol=1e-5, atol=1e-7)
    # the value and the logp gradient are uniform's, bit for bit (theta = 0)
    leaf = batch["loop_logp"].clone().requires_grad_()
    args = dict(batch, loop_logp=leaf, normalizer=7.0)
    lw2 = LearnedLoopWeights(lr=0.1)
    got = policy_loss(cfg, dict(args, loop_weight=lw2.weights(depths, 4)))[0]
    (g_learned,) = torch.autograd.grad(got, leaf)
    want = policy_loss(ObjectiveConfig(kind="grpo", loop_weighting="uniform"),
                       dict(args, loop_weight=_w("uniform", depths.tolist())))[0]  # fmt: skip
    (g_uniform,) = torch.autograd.grad(want, leaf)
    assert torch.equal(got.detach(), want.detach()) and torch.equal(g_learned, g_uniform)
    before = lw.logits.detach().clone()
    lw.step(type("DP", (), {"active": False})(), apply=True)
    torch.testing.assert_close(lw.logits.detach()[:4] - before[:4], -0.1 * torch.sign(g[:4]))
    assert not bool(lw.logits[4:].any()) and lw.logits.grad is None


def _exit_pdf_reference(gate: torch.Tensor, e: torch.Tensor, full: list[int]) -> torch.Tensor:
    """exit_pdf's weights written out token by token from the formula of docs/OBJECTIVES.md
    (lambda_k = sigmoid(g_k), p_k = lambda_k prod_{j<k} (1 - lambda_j), p_D = prod_{j<D}
    (1 - lambda_j), w_tk = p_k / sum_{j <= e_t} p_j), differentiable in ``gate``."""
    b, t, k = gate.shape
    rows = []
    for i in range(b):
        toks = []
        for j in range(t):
            lam = [1.0 / (1.0 + torch.exp(-gate[i, j, m])) for m in range(k)]
            p, left = [], torch.ones(())
            for m in range(k):
                p.append(left if m + 1 == full[i] else lam[m] * left)
                left = left * (1.0 - lam[m])
            et = int(e[i, j])
            z = sum(p[:et], torch.zeros(()))
            toks.append(torch.stack([p[m] / z if m < et else torch.zeros(()) for m in range(k)]))
        rows.append(torch.stack(toks))
    return torch.stack(rows)


def test_exit_pdf_gradient_by_hand() -> None:
    """objective.exit_pdf_gradient: off, the weights carry no gradient (today's); on, the same
    weights, loss value and log-prob gradient bit for bit, and the gate's logits get RLTT's
    term: d/dg of sum_t sum_k w_tk(g) (-A_t logp_tk) mask_t / N, by autograd on the written-out
    formula (`_exit_pdf_reference`), non-zero; rows of full depth 4 and 8 (loop 4 last or not)."""
    batch, e = _loss_batch("pdf")
    full = [4, 8, 4]
    g0 = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(3)) * 1.5
    on_cfg = ObjectiveConfig(kind="grpo", loop_weighting="exit_pdf", exit_pdf_gradient=True)
    off_cfg = ObjectiveConfig(kind="grpo", loop_weighting="exit_pdf")
    res = {}
    for name, cfg in (("off", off_cfg), ("on", on_cfg)):
        gate = g0.clone().requires_grad_()
        w = loop_weights(cfg, e, torch.tensor(full), gate, 4)
        assert w.requires_grad == (name == "on")
        leaf = batch["loop_logp"].clone().requires_grad_()
        loss, m = policy_loss(cfg, dict(batch, loop_logp=leaf, loop_weight=w, normalizer=7.0))
        inputs = [leaf, gate] if name == "on" else [leaf]
        grads = torch.autograd.grad(loss, inputs)
        res[name] = (w.detach(), loss.detach(), m, grads)
    w_off, loss_off, m_off, (g_logp_off,) = res["off"]
    w_on, loss_on, m_on, (g_logp_on, g_gate) = res["on"]
    assert torch.equal(w_on, w_off) and torch.equal(loss_on, loss_off) and m_on == m_off
    assert torch.equal(g_logp_on, g_logp_off)
    probe = g0.clone().requires_grad_()
    want_w = _exit_pdf_reference(probe, e, full)
    torch.testing.assert_close(want_w.detach(), w_off, rtol=1e-6, atol=1e-7)
    term = (want_w * (-batch["advantages"][..., None] * batch["loop_logp"])).sum(-1)
    (want,) = torch.autograd.grad((term * batch["mask"]).sum() / 7.0, probe)
    torch.testing.assert_close(g_gate, want, rtol=1e-5, atol=1e-7)
    # loops a token reached (k < e_t, and k = e_t below the full depth) get a gradient; a
    # token's loops beyond e_t none, masked tokens none
    assert float(g_gate.abs().sum()) > 1e-3
    assert not bool(g_gate[2, 3:].any())
    beyond = torch.arange(1, 5)[None, None] > e[..., None]
    assert not bool(g_gate[beyond].any())


def _loss_batch(kind: str, seed: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, k = 3, 5, 4
    mask = torch.ones(b, t)
    mask[2, 3:] = 0
    e = torch.randint(1, k + 1, (b, t), generator=g)
    loop_logp = -torch.rand(b, t, k, generator=g) * 3
    prox = loop_logp + 0.2 * torch.randn(b, t, k, generator=g)
    ref = loop_logp + 0.3 * torch.randn(b, t, k, generator=g)
    ent = torch.rand(b, t, k, generator=g) * 4
    at = (e - 1)[..., None]
    batch = dict(mask=mask, advantages=torch.randn(b, t, generator=g),
                 behav_logp=prox.gather(-1, at)[..., 0] - 0.1, loop_logp=loop_logp,
                 loop_entropy=ent, loop_prox=prox, loop_ref=ref)  # fmt: skip
    return batch, e


_CFGS = {
    "grpo": dict(kind="grpo", kl_coef=0.05, entropy_coef=0.01),
    "ppo+dual": dict(kind="ppo", dual_clip=3.0, kl_coef=0.1, eps_low=0.05, eps_high=0.05),
    "dppo+mask": dict(
        kind="dppo",
        is_cap=1.05,
        is_mode="mask",
        entropy_coef=0.01,
        is_rejected_in_denominator=False,
    ),  # fmt: skip
    "grpo+seq": dict(kind="grpo", aggregation="seq_mean"),
    "divergence_ppo": dict(
        kind="divergence_ppo", anchor="proximal", divergence="kl", divergence_threshold=0.01
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(_CFGS))
def test_one_hot_at_the_exit_loop_is_the_exit_loss(name: str) -> None:
    """The per-loop loss with all weight on loop e_t is the ordinary loss on loop e_t's
    log-probs, bit for bit, value and gradient (the decomposition adds 1 x l and 0 x the rest),
    for every kind the per-loop path takes."""
    cfg = ObjectiveConfig(**_CFGS[name], loop_weighting="uniform")
    batch, e = _loss_batch(name)
    k = batch["loop_logp"].shape[-1]
    at = (e - 1)[..., None]
    one_hot = torch.nn.functional.one_hot(e - 1, k).float()
    leaf = batch["loop_logp"].clone().requires_grad_()
    ent_leaf = batch["loop_entropy"].clone().requires_grad_()
    mine = dict(batch, loop_logp=leaf, loop_entropy=ent_leaf, loop_weight=one_hot,
                prox_logp=batch["loop_prox"].gather(-1, at)[..., 0], normalizer=11.0)  # fmt: skip
    loss, m = policy_loss(cfg, mine)
    gl, ge = torch.autograd.grad(loss, [leaf, ent_leaf], allow_unused=True)
    logp = batch["loop_logp"].gather(-1, at)[..., 0].requires_grad_()
    ent = batch["loop_entropy"].gather(-1, at)[..., 0].requires_grad_()
    plain = dict(mask=batch["mask"], advantages=batch["advantages"], behav_logp=batch["behav_logp"],
                 logp=logp, entropy=ent, prox_logp=batch["loop_prox"].gather(-1, at)[..., 0],
                 ref_logp=batch["loop_ref"].gather(-1, at)[..., 0], normalizer=11.0)  # fmt: skip
    ref_loss, ref_m = policy_loss(ObjectiveConfig(**_CFGS[name]), plain)
    rl, re = torch.autograd.grad(ref_loss, [logp, ent], allow_unused=True)
    assert torch.equal(loss, ref_loss), (float(loss), float(ref_loss))
    assert torch.equal(gl.gather(-1, at)[..., 0], rl)
    assert torch.count_nonzero(gl * (1 - one_hot)) == 0  # nothing off the exit loop
    if re is not None:
        assert torch.equal(ge.gather(-1, at)[..., 0], re)
    assert m["pg_loss"] == ref_m["pg_loss"] and m["num_tokens"] == ref_m["num_tokens"]
    for key in set(ref_m) - {"loss", "pg_loss", "num_tokens"}:
        assert math.isclose(m[key], ref_m[key], rel_tol=1e-6, abs_tol=1e-7), key


def test_uniform_sums_the_loops() -> None:
    """grpo without clipping, no KL: l_t = -(1/e_t) sum_k A_t exp(logp_tk - prox_tk), so the
    gradient on loop k's log-prob is -A_t r_tk / e_t / N (N: the normalizer)."""
    cfg = ObjectiveConfig(kind="grpo", eps_low=0.99, eps_high=1e6, loop_weighting="uniform")
    batch, e = _loss_batch("u")
    leaf = batch["loop_logp"].clone().requires_grad_()
    w = _w("uniform", e.tolist())
    loss, m = policy_loss(cfg, dict(batch, loop_logp=leaf, loop_weight=w, normalizer=7.0,
                                    loop_entropy=None))  # fmt: skip
    live_t = batch["mask"] > 0  # credited loop: sum_k k / e_t = (e_t + 1) / 2
    assert math.isclose(m["loop_depth_mean"], float(((e + 1) / 2)[live_t].mean()), rel_tol=1e-6)
    (g,) = torch.autograd.grad(loss, leaf)
    r = (batch["loop_logp"] - batch["loop_prox"]).exp()
    live = (batch["mask"] > 0)[..., None] & (w > 0)
    want = torch.where(live, -batch["advantages"][..., None] * r / e[..., None] / 7.0, 0.0)
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, (torch.where(live, want, 0.0)).sum() * 1.0)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (dict(kind="flow_dppo", loop_weighting="uniform"), "flow_dppo is refused"),
        (dict(kind="divergence_ppo", loop_weighting="uniform"), "anchor proximal"),
        (dict(loop_weight_lr=0.1), "learned only"),
        (dict(loop_weighting="learned", loop_weight_lr=0.0), "loop_weight_lr.*> 0"),
        (dict(loop_weighting="uniform", ratio_level="sequence"), "GSPO"),
        (dict(loop_weighting="every"), "must be one of"),
        (dict(progressive_alpha=2.0), "progressive only"),
        (dict(loop_weighting="uniform", exit_pdf_gradient=True), "exit_pdf only"),
        (dict(loop_weighting="progressive", progressive_alpha=-1.0), "must be >= 0"),
    ],
)
def test_refusals(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=f"objective.*{match}"):
        ObjectiveConfig(**over)


def test_loop_credit_needs_the_proximal_pass() -> None:
    obj = ObjectiveConfig(loop_weighting="uniform")
    assert TrainConfig(objective=obj).use_prox  # per-loop ratio bases come from it
    with pytest.raises(ConfigError, match="recompute_prox"):
        TrainConfig(objective=obj, recompute_prox=False)


# ------------------------------------------------------------ both policies, real steps
def _fresh(model: Path, numerics: str) -> list[Rollout]:
    """2 groups x 4 rollouts of the starting weights, 6 tokens, Ouro's gate at q = 0.5 for
    Ouro (varied exit depths), full depth for Huginn."""
    from models.checkpoint import load_model
    from models.exits import OuroGate
    from models.reference import SamplingParams, generate

    cfg, m = load_model(model)
    policy = OuroGate(0.5) if "ouro" in model.name else None
    out = []
    for g in range(2):
        seeds = [11 + 10 * g + i for i in range(4)]
        for i, x in enumerate(generate(m, [[1, 18 + g, 19 + g]] * 4, seeds,
                                       SamplingParams(max_new_tokens=6), policy, numerics)):  # fmt: skip
            out.append(Rollout(
                rollout_id=f"w{g}/{i}", work_id=f"w{g}", prompt_id=f"p{g}", sample_index=i,
                generator_id="g0", latent_seed=seeds[i],
                prompt_tokens=np.array(x.prompt_tokens, np.int32),
                tokens=np.array(x.tokens, np.int32), logprobs=x.logprobs.numpy(),
                exit_depths=np.array(x.exit_depths, np.uint8), weight_version=0,
                full_depth=x.full_depth, reward=float((7 * i + 3 * g) % 5),
            ))  # fmt: skip
    return out


def _trainer(backend: str, model: Path, *over: str) -> Any:
    from pipeline.config.run import load_config

    cfg = load_config(None, [f"backend={backend}", "rollout.n=4", "rollout.prompts_per_step=2",
                             "learner.backprop_depth=0", *over])  # fmt: skip
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer

        return ReferenceTrainer(cfg, model)
    from pipeline.backends.megatron_adapter import MegatronTrainer

    return MegatronTrainer(cfg, model)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from models.random_init import init_checkpoint

    root = tmp_path_factory.mktemp("loops")
    out = {}
    for fam in ("huginn", "ouro"):
        init_checkpoint(fam, "tiny", root / fam, seed=0)
        out[fam] = root / fam
    return out


_CASES = [  # (family, loop_weighting, kind, numerics)
    ("huginn", "uniform", "dppo", "fast"),
    # Ouro's separate q/k/v and gate/up projections (fused in megatron): exact needs their
    # input gradients rounded once (models.numerics.linears); mixed exit depths, the gate's pdf
    ("ouro", "exit_pdf", "grpo", "exact"),
    # the learned weights' logits: trained by the loss in shared code, the same bits after 4
    # updates (each update's weights depend on the updates before it)
    ("ouro", "learned", "dppo", "exact"),
    # objective.exit_pdf_gradient: the weights carry the gate's gradient; no weight decay and
    # no exit term, so the gate moves through the weights alone
    ("ouro", "exit_pdf+gradient", "grpo", "exact"),
]


@pytest.mark.megatron
@pytest.mark.parametrize(("fam", "weighting", "kind", "numerics"), _CASES)
def test_policies_agree_per_loop(models_dir: dict[str, Path], tmp_path: Path, fam: str,
                                 weighting: str, kind: str, numerics: str) -> None:  # fmt: skip
    """MegatronPolicy (learner.loop_forward: one pass, readouts hooked after each iteration)
    and TorchPolicy (its own replay with the same hook): one step, 2 epochs x 2 mini-batches,
    the entropy bonus and the per-loop reference KL on; every metric and published weight the
    same bits in exact numerics, within 1e-6 in fast. Ouro's rollouts exit by its gate at 0.5
    (exit depths 1..4 mixed), so loops enter for some tokens only. About 2 minutes a case on
    the 2-core host (two trainers, 4 updates of K-loop forwards): the only check that the
    two per-loop implementations agree, so three cases only."""
    from models.checkpoint import load_checkpoint

    weighting, _, option = weighting.partition("+")
    rolls = _fresh(models_dir[fam], numerics)
    depths = {int(d) for r in rolls for d in r.exit_depths}
    assert len(depths) > 1 or fam == "huginn", depths
    over = [f"objective.kind={kind}", f"objective.loop_weighting={weighting}",
            "objective.epochs=2", "objective.minibatches=2", "optimizer.lr=1e-5",
            "objective.entropy_coef=0.01", "objective.kl_coef=0.05", f"numerics={numerics}",
            "optimizer.critic_lr=1e-3"]  # fmt: skip
    over += ["objective.progressive_alpha=2.0"] if weighting == "progressive" else []
    over += ["objective.anchor=proximal"] if kind == "divergence_ppo" else []
    over += ["objective.is_cap=2.0"] if kind == "dppo" else []
    over += ["objective.loop_weight_lr=0.05"] if weighting == "learned" else []
    over += ["objective.exit_pdf_gradient=true", "optimizer.weight_decay=0.0"] if option else []
    res, weights, logits = {}, {}, {}
    for backend in ("reference", "megatron"):
        t = _trainer(backend, models_dir[fam], *over)
        try:
            res[backend] = t.step(rolls, [False] * len(rolls)).metrics
            out = tmp_path / backend
            t.publish(out, 1)
            weights[backend] = load_checkpoint(out)[1]
            learned = (t.runner if backend == "reference" else t.trainer).loop_weights
            logits[backend] = None if learned is None else learned.logits.detach().clone()
            if learned is not None:  # never published: the model's tensors only
                assert set(weights[backend]) == set(load_checkpoint(models_dir[fam])[1])
        finally:
            t.close() if backend == "megatron" else None
    ref, meg = res["reference"], res["megatron"]
    assert set(ref) == set(meg)
    assert ref["updates"] == 4.0 and ref["kl_ref"] > 0 and ref["ratio_mean"] != 1.0
    tol = 0.0 if numerics == "exact" else 1e-6
    bad = {k: (ref[k], meg[k]) for k in ref
           if not abs(ref[k] - meg[k]) <= tol * max(1.0, abs(ref[k]))}  # fmt: skip
    assert not bad, bad
    a, b = weights["reference"], weights["megatron"]
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= tol, worst
    if numerics == "exact":
        assert all(torch.equal(a[k], b[k]) for k in a)
    if option:  # the gate's only gradient is through the weights: it moved (4 Adam steps)
        start = load_checkpoint(models_dir[fam])[1]
        gates = [k for k in a if "early_exit_gate" in k]
        assert gates and all(not torch.equal(a[k], start[k]) for k in gates), gates
    if weighting == "learned":  # 4 Adam steps of lr 0.05 from 0: every loop's logit moved
        la, lb = logits["reference"], logits["megatron"]
        assert la is not None and lb is not None and torch.equal(la, lb), (la[:4], lb[:4])
        assert bool((la[: max(depths)] != 0).all()) and not bool(la[max(depths) :].any())


def test_exit_pdf_refused_without_a_gate(models_dir: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="loop_weighting=exit_pdf: the .* family has no exit gate"):
        _trainer("reference", models_dir["huginn"], "objective.loop_weighting=exit_pdf")


# ------------------------------------------------------------ memory: one loop's logits
def _saved_bytes(fn: Any) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of fn() (storages
    counted once; what activation checkpointing keeps out of the graph is not counted)."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    del out
    return sum(seen.values())


@pytest.mark.megatron
def test_memory_grows_with_one_loops_logits_not_all(tmp_path: Path) -> None:
    """A looped model with a large vocabulary (8192) next to a small hidden size (64), every
    response token at depth K: the bytes autograd keeps for the backward of the megatron
    per-loop forward grow by far less than one loop's [tokens, vocab] fp32 logits per extra
    loop (they are recomputed in backward, one loop at a time); a forward that kept them
    (learner.loop_forward without its checkpoint) grows by more than that per loop and fails."""
    from learner.batching import build_batch
    from learner.loop_forward import loop_forward
    from learner.megatron.model import build_policy
    from learner.parallel import destroy_distributed, init_distributed
    from learner.vocab_ops import token_stats

    init_distributed(1)
    try:
        _check_memory_grows(build_policy, loop_forward, token_stats, build_batch)
    finally:  # the process group and megatron's state go with the test: a vLLM engine later in
        destroy_distributed()  # this process would adopt the group and destroy it under megatron


def _check_memory_grows(build_policy: Any, loop_forward: Any, token_stats: Any,
                        build_batch: Any) -> None:  # fmt: skip
    from learner.megatron.options import MegatronOptions
    from models.config import tiny_config

    cfg = dataclasses.replace(tiny_config("ouro"), vocab_size=8192, total_ut_steps=8)
    model = build_policy(cfg, MegatronOptions(numerics="fast", backprop_depth=0))

    def row_stats(rows: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        st = token_stats(rows, None, targets, 1.0)
        return {"logp": st.logp, "entropy": st.entropy}

    def batch(k: int) -> Any:
        n = 40
        r = Rollout(rollout_id="a", work_id="w", prompt_id="p", sample_index=0,
                    generator_id="g", latent_seed=1, prompt_tokens=np.array([1, 2], np.int32),
                    tokens=np.arange(3, 3 + n, dtype=np.int32),
                    logprobs=np.full(n, -1.0, np.float32),
                    exit_depths=np.full(n, k, np.uint8), weight_version=0, reward=1.0)  # fmt: skip
        return build_batch([r, dataclasses.replace(r, rollout_id="b", latent_seed=2)])

    saved = {k: _saved_bytes(lambda k=k: loop_forward(model, batch(k).rows(0, 2), row_stats,
                                                      gate=False)["loop_logp"])  # fmt: skip
             for k in (2, 6)}  # fmt: skip
    one_loop = 2 * 40 * 8192 * 4  # [tokens, vocab] fp32
    per_loop = (saved[6] - saved[2]) / 4
    # measured: 0.93 MB a loop (the core iteration's own activations) against 2.6 MB of
    # logits; without the checkpoint (logits kept for the backward) 3.57 MB a loop
    assert per_loop < one_loop / 2, (per_loop, one_loop, saved)


def test_learned_starts_as_uniform_and_resumes(models_dir: dict[str, Path],
                                               tmp_path: Path) -> None:  # fmt: skip
    """learned's first update is uniform's, bit for bit (theta = 0: the same weights); its
    logits move after it and are checkpointed with the learner: a trainer restored from the
    checkpoint holds the same logits and Adam state, and its next step is the original's."""
    rolls = _fresh(models_dir["ouro"], "exact")
    one = ["numerics=exact", "objective.kind=grpo", "optimizer.lr=1e-4"]
    res, models = {}, {}
    for w in ("uniform", "learned"):
        t = _trainer("reference", models_dir["ouro"], *one, f"objective.loop_weighting={w}")
        res[w] = t.step(rolls, [False] * len(rolls)).metrics
        models[w] = t
    assert res["uniform"]["updates"] == 1.0 and res["uniform"] == res["learned"]
    a, b = models["uniform"].model.state_dict(), models["learned"].model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    t = models["learned"]
    moved = t.runner.loop_weights.logits.detach().clone()
    deepest = max(int(d) for r in rolls for d in r.exit_depths)  # loops beyond: no token
    assert bool(moved[:deepest].abs().gt(0).all()) and not bool(moved[deepest:].any()), moved
    ckpt = t.save(tmp_path, {"step": 1}, keep=1)
    back = _trainer("reference", models_dir["ouro"], *one, "objective.loop_weighting=learned")
    back.load(ckpt)
    assert torch.equal(back.runner.loop_weights.logits.detach(), moved)
    nxt = [
        t.step(rolls, [False] * len(rolls)).metrics,
        back.step(rolls, [False] * len(rolls)).metrics,
    ]
    assert nxt[0] == nxt[1]
    assert torch.equal(t.runner.loop_weights.logits, back.runner.loop_weights.logits)
