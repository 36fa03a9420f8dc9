"""The objective's advantage, ratio, correction and divergence options against the peers'
formulas on adversarial inputs.

Each `peer_*` function is this file's own re-statement of the formula a public
implementation computes, written from reading its code (verl trainer/ppo/core_algos.py and
utils/torch_functional.py, AReaL trainer/ppo/actor.py and utils/data.py, TRL
trainer/grpo_trainer.py); nothing is imported from them. Inputs: padded rows, empty rows,
groups of one, all-equal rewards, -inf log-probs, log-ratios up to 25. Where looprl differs
on purpose the test says so and checks the difference.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    rloo_advantages,
    whiten_tokens,
)
from learner.batching import TrainBatch, group_token_advantages, step_advantages
from learner.losses import aggregate, kl_penalty
from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss

INF = float("inf")
FP32 = dict(atol=2e-6, rtol=2e-6)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().float().requires_grad_()


def grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def adversarial(seed: int = 0, b: int = 6, t: int = 7) -> dict[str, torch.Tensor]:
    """Random [B, T] tokens: row 1 left-padded, row 2 right-padded, row 3 empty, log-ratios
    reaching +-25 in row 4, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t)
    mask[1, :3] = 0
    mask[2, 4:] = 0
    mask[3] = 0
    base = -torch.rand(b, t, generator=g) * 3 - 0.01
    logp = base + torch.randn(b, t, generator=g) * 0.3
    logp[4, :3] = base[4, :3] + torch.tensor([25.0, -25.0, 12.0])
    logp = logp.clamp_max(0.0)
    adv = torch.randn(b, t, generator=g)
    return {"mask": mask, "base": base, "logp": logp, "adv": adv}


def token_mean(loss_bt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss_bt * mask).sum() / mask.sum()


# ---------------------------------------------------------------- policy-loss options


def peer_dual_clip(ratio, adv, eps_low, eps_high, c):
    """verl compute_policy_loss_vanilla: max(-rA, -clip(r)A), then min(that, -cA) for A < 0."""
    l1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    return torch.where(adv < 0, torch.minimum(-adv * c, l1), l1)


def test_dual_clip_matches_verl_clip_ratio_c() -> None:
    d = adversarial(1)
    cfg = ObjectiveConfig(kind="ppo", eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    ours_lp, peer_lp = leaf(d["logp"]), leaf(d["logp"])
    loss, _ = policy_loss(cfg, {"mask": d["mask"], "advantages": d["adv"],
                                "behav_logp": d["base"], "logp": ours_lp})  # fmt: skip
    ratio = (peer_lp - d["base"]).clamp(-20, 20).exp()
    peer = token_mean(peer_dual_clip(ratio, d["adv"], 0.2, 0.28, 3.0), d["mask"])
    torch.testing.assert_close(loss, peer, **FP32)
    torch.testing.assert_close(grad(loss, ours_lp), grad(peer, peer_lp), **FP32)


def test_minus_inf_behaviour_logp_same_gradient_as_verl() -> None:
    # looprl zeroes a token whose ratio base is -inf; verl clamps its log-ratio at 20 and the
    # surrogate clips it: with its dual clip (c = 3) the token's gradient is 0 either way.
    # Only the loss value differs (verl adds -(1 + eps_high) A or c |A| for it).
    d = adversarial(2)
    base = d["base"].clone()
    base[0, 1], base[0, 2] = -INF, -INF
    adv = d["adv"].clone()
    adv[0, 1], adv[0, 2] = 1.5, -1.5
    cfg = ObjectiveConfig(kind="ppo", dual_clip=3.0)
    ours_lp, peer_lp = leaf(d["logp"]), leaf(d["logp"])
    loss, m = policy_loss(cfg, {"mask": d["mask"], "advantages": adv, "behav_logp": base,
                                "logp": ours_lp})  # fmt: skip
    ratio = (peer_lp - base).clamp(-20, 20).exp()
    peer = token_mean(peer_dual_clip(ratio, adv, 0.2, 0.2, 3.0), d["mask"])
    torch.testing.assert_close(grad(loss, ours_lp), grad(peer, peer_lp), **FP32)
    assert m["invalid_frac"] == pytest.approx(2 / d["mask"].sum().item())
    gap = (peer - loss).item() * d["mask"].sum().item()  # the two tokens' verl loss values
    assert gap == pytest.approx(-1.2 * 1.5 + 3.0 * 1.5, abs=1e-4)


def peer_dppo(logp, old, adv, div, thr_low, thr_high, c):
    """verl dppo_tv / dppo_kl: -A sg(min(r, c)) log pi, zeroed where the divergence bound
    fails in the advantage's direction (TV: pi - mu > high for A > 0, < -low otherwise;
    binary KL with its 1e-8 guards)."""
    ratio = (logp - old).clamp(-20, 20).exp()
    trunc = ratio.clamp(max=c).detach()
    prob, old_prob = logp.exp(), old.exp()
    if div == "tv":
        valid = torch.where(adv > 0, prob - old_prob <= thr_high, prob - old_prob >= -thr_low)
    else:
        bkl = old_prob * (old - logp) + (1 - old_prob) * torch.log(
            (1 - old_prob + 1e-8) / (1 - prob + 1e-8)
        )
        valid = torch.where(adv > 0, (bkl <= thr_high) | (prob <= old_prob),
                            (bkl <= thr_low) | (prob >= old_prob))  # fmt: skip
    return -adv * trunc * logp * valid.float(), valid


@pytest.mark.parametrize("div", ["tv", "kl"])
def test_divergence_is_cap_and_split_thresholds_match_verl_dppo(div: str) -> None:
    d = adversarial(3)
    base = d["base"].clone()
    base[5, :2] = torch.tensor([0.0, -1e-8])  # confident anchors (1 - mu rounds to 0 in fp32)
    lo, hi = (0.05, 0.15) if div == "tv" else (0.02, 0.08)
    cfg = ObjectiveConfig(kind="divergence_ppo", divergence=div, divergence_threshold=hi,
                          divergence_threshold_low=lo, divergence_is_cap=20.0)  # fmt: skip
    assert cfg.divergence_is_cap == ObjectiveConfig().divergence_is_cap  # the default
    ours_lp, peer_lp = leaf(d["logp"]), leaf(d["logp"])
    loss, m = policy_loss(cfg, {"mask": d["mask"], "advantages": d["adv"],
                                "behav_logp": base, "logp": ours_lp})  # fmt: skip
    peer_bt, valid = peer_dppo(peer_lp, base, d["adv"], div, lo, hi, 20.0)
    peer = token_mean(peer_bt, d["mask"])
    # same gradient (the loss values differ by construction: verl's carries log pi)
    torch.testing.assert_close(grad(loss, ours_lp), grad(peer, peer_lp), **FP32)
    live = d["mask"] > 0
    assert m["drop_frac"] == pytest.approx((~valid & live).sum().item() / live.sum().item())
    assert 0 < m["drop_frac"] < 1


def test_divergence_is_cap_bounds_the_gradient() -> None:
    # one token at r = e^10, A = -1: pi > mu with A < 0 moves back, so it is kept whatever
    # the divergence. Loss -r A: capped at 20 its value and its gradient are 20 (verl/TRL's
    # min(r, 20)); uncapped e^10 (at e^25 the log-ratio clamp at 20 already zeroes it).
    mask, adv = torch.ones(1, 1), -torch.ones(1, 1)
    base, lp = torch.full((1, 1), -11.0), leaf(torch.full((1, 1), -1.0))
    for cap, want in ((20.0, 20.0), (None, math.exp(10.0))):
        cfg = ObjectiveConfig(kind="divergence_ppo", divergence_is_cap=cap)
        loss, m = policy_loss(cfg, {"mask": mask, "advantages": adv, "behav_logp": base,
                                    "logp": lp})  # fmt: skip
        assert m["drop_frac"] == 0.0
        assert grad(loss, lp).item() == pytest.approx(want, rel=1e-6)
        assert loss.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_cap_matches_verl_and_areal(estimator: str) -> None:
    # d = ref - logp from -25 to 25: k3 = e^d - 1 - d passes 10 at d ~ 2.53; k2 at |d| ~ 4.47
    d = torch.linspace(-25, 25, 41).reshape(1, -1)
    logp = -torch.rand(1, 41, generator=torch.Generator().manual_seed(4)) * 2
    ref = logp + d
    ours_lp, peer_lp = leaf(logp), leaf(logp)
    ours = kl_penalty(ours_lp, ref, estimator, 10.0)
    x = ref - peer_lp  # verl kl_penalty_forward / AReaL KLEstimator(apply_clamp=True)
    if estimator == "k1":
        peer = (-x).clamp(-10, 10)
    elif estimator == "k2":
        peer = (0.5 * x * x).clamp(-10, 10)
    else:
        xc = x.clamp(-20, 20)
        peer = (xc.exp() - xc - 1).clamp(-10, 10)
    torch.testing.assert_close(ours, peer, **FP32)
    torch.testing.assert_close(grad(ours.sum(), ours_lp), grad(peer.sum(), peer_lp), **FP32)
    assert ObjectiveConfig().kl_cap == 10.0


def peer_gspo(logp, old, adv, mask, eps_low, eps_high):
    """verl compute_policy_loss_gspo: s_b = exp(mean_t log r) (lengths clamped at 1), token
    ratio sg(s_b) pi / sg(pi) with the log clamped at 10, PPO clip, seq-mean-token-mean."""
    nlk = logp - old
    seq = (nlk * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    s = (logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0).exp()
    l_bt = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high))
    n = mask.sum(-1)
    per = (l_bt * mask).sum(-1) / (n + 1e-8)
    return per[n > 0].sum() / (n > 0).sum()


def test_gspo_sequence_ratio_matches_verl() -> None:
    d = adversarial(5)
    old = d["logp"] - (d["logp"] - d["base"]).clamp(-8, 8)  # sequence log-ratios inside 10
    cfg = ObjectiveConfig(kind="grpo", ratio_level="sequence", aggregation="seq_mean",
                          eps_low=0.2, eps_high=0.28)  # fmt: skip
    adv = d["adv"][:, :1].expand_as(d["adv"]).contiguous()
    ours_lp, peer_lp = leaf(d["logp"]), leaf(d["logp"])
    loss, m = policy_loss(cfg, {"mask": d["mask"], "advantages": adv, "behav_logp": old,
                                "logp": ours_lp})  # fmt: skip
    peer = peer_gspo(peer_lp, old, adv, d["mask"], 0.2, 0.28)
    torch.testing.assert_close(loss, peer, **FP32)
    torch.testing.assert_close(grad(loss, ours_lp), grad(peer, peer_lp), **FP32)
    assert m["clip_frac"] > 0


def test_dr_grpo_and_seq_mean_token_sum_norm_match_trl_and_verl() -> None:
    d = adversarial(6)
    loss_bt, mask, length = d["adv"], d["mask"], 16
    nonempty = (mask.sum(-1) > 0).sum()
    # TRL loss_type dr_grpo: sum(l m) / (B x max_completion_length), B its rows; looprl's S
    # counts the rows with tokens (an empty row adds 0 to the sum either way; TRL's B would
    # count it: here 5 of 6 rows)
    trl = (loss_bt * mask).sum() / (nonempty * length)
    # verl seq-mean-token-sum-norm with loss_scale_factor L: per micro-batch sum(l m) / L,
    # times 1 / gradient_accumulation; with one row per micro-batch the mean over rows of
    # sum_t(l m) / L (its value scales with its micro-batch size: looprl's does not)
    verl = sum((loss_bt[i] * mask[i]).sum() / length for i in range(6) if mask[i].sum() > 0)
    verl = verl / nonempty
    for mode in ("dr_grpo", "seq_mean_token_sum_norm"):
        torch.testing.assert_close(aggregate(loss_bt, mask, mode, length=length), trl, **FP32)
        torch.testing.assert_close(aggregate(loss_bt, mask, mode, length=length), verl, **FP32)
        # a global normalizer (micro-batches): two halves add up to the whole
        halves = sum(aggregate(loss_bt[a:b], mask[a:b], mode, float(nonempty), length)
                     for a, b in ((0, 3), (3, 6)))  # fmt: skip
        torch.testing.assert_close(halves, trl, **FP32)
    with pytest.raises(ValueError, match="loss_scale_length"):
        ObjectiveConfig(aggregation="dr_grpo")


# ---------------------------------------------------------------- advantages


def peer_verl_group(scores, index, eps=1e-6, std=True, rloo=False):
    """verl compute_grpo_outcome_advantage / compute_rloo_outcome_advantage: a group of one
    has mean 0 and std 1; torch.std is Bessel-corrected; RLOO scales by n / (n - 1)."""
    out = scores.clone().double()
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(index.tolist()):
        groups.setdefault(k, []).append(i)
    for members in groups.values():
        s = scores.double()[members]
        n = len(members)
        for i in members:
            if rloo:
                out[i] = scores[i] * n / (n - 1) - s.mean() * n / (n - 1) if n > 1 else scores[i]
            else:
                mean, sd = (s.mean(), s.std()) if n > 1 else (0.0, 1.0)
                out[i] = (scores[i] - mean) / (sd + eps) if std else scores[i] - mean
    return out.float()


REWARDS = torch.tensor([1.0, 0.0, 5.0, 1.0, 2.0, 0.0, 2.0, -3.0, 0.5, 0.25])
GROUPS = torch.tensor([7, 7, 3, 7, 9, 7, 9, 4, 4, 4])  # 3: one sample; 9: all equal


@pytest.mark.parametrize("normalize_std", [True, False])
def test_singleton_reward_matches_verl_grpo(normalize_std: bool) -> None:
    ours = group_advantages(REWARDS, GROUPS, normalize_std, singleton="reward")
    peer = peer_verl_group(REWARDS, GROUPS, std=normalize_std)
    torch.testing.assert_close(ours, peer, **FP32)
    zero = group_advantages(REWARDS, GROUPS, normalize_std)  # the default: the singleton 0
    assert zero[2] == 0.0 and torch.equal(zero[torch.arange(10) != 2], ours[torch.arange(10) != 2])


def test_rloo_matches_verl() -> None:
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS, "reward"),
                               peer_verl_group(REWARDS, GROUPS, rloo=True), **FP32)  # fmt: skip
    assert rloo_advantages(REWARDS, GROUPS)[2] == 0.0


def peer_masked_whiten(x, mask):
    """verl masked_whiten: (x - mean) * rsqrt(var + 1e-8), var Bessel-corrected."""
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def batch_of(mask: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor) -> TrainBatch:
    b, t = mask.shape
    last = (mask > 0).float().cumsum(1).argmax(1)
    tr = torch.zeros(b, t)
    tr[torch.arange(b), last] = torch.where(mask.sum(1) > 0, rewards, 0.0)
    z = torch.zeros(b, t, dtype=torch.int64)
    rows = torch.zeros(b, dtype=torch.int64)
    return TrainBatch([f"r{i}" for i in range(b)], z, z, z, mask, mask * 0, z + 1, tr, rows,
                      groups, rewards, rows, rows + t, rows + 1, rows < 0)  # fmt: skip


def test_bessel_whitening_and_reinforce_pp_match_verl() -> None:
    d = adversarial(7, b=10)
    mask = d["mask"]
    batch = batch_of(mask, REWARDS, GROUPS)
    live = mask > 0
    # whitening (verl's eps is inside the sqrt, looprl's 1e-6 outside: ~1e-6 relative apart)
    ours = whiten_tokens(d["adv"], mask, std="bessel")
    torch.testing.assert_close(ours[live], peer_masked_whiten(d["adv"], mask)[live],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    # REINFORCE++: discounted returns (reset at each row's end), whitened over the batch
    ret = discounted_returns(batch.token_rewards, mask, 0.9)
    peer_ret = torch.zeros_like(ret)
    run = torch.zeros(10)
    for t in reversed(range(mask.shape[1])):  # verl: running = r + gamma running, x mask
        run = batch.token_rewards[:, t] + 0.9 * run
        peer_ret[:, t] = run
        run = run * mask[:, t]
    torch.testing.assert_close(ret[live], peer_ret[live], **FP32)
    adv, _ = step_advantages(batch, gamma=0.9, estimator="reinforce_pp", whiten_std="bessel")
    torch.testing.assert_close(adv[live], peer_masked_whiten(peer_ret, mask)[live],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    # REINFORCE++-baseline: r - group mean (a group of one: mean 0), whitened
    adv, _ = step_advantages(batch, estimator="reinforce_pp_baseline", singleton="reward",
                             whiten_std="bessel")  # fmt: skip
    scores = peer_verl_group(REWARDS, GROUPS, std=False)[:, None] * mask
    torch.testing.assert_close(adv[live], peer_masked_whiten(scores, mask)[live],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert (adv[~live] == 0).all()


def peer_areal_gae(rewards, values_next, mask, no_eos, gamma, lam):
    """AReaL _compute_advantages' loop on its layout: values_next [B, T + 1] (position T the
    state after the last token), nextvalues starting at V[T] on rows without EOS, else 0;
    masked-out positions carry the running values through."""
    b, t = mask.shape
    nextvalues = values_next[:, t] * no_eos.float()
    last = torch.zeros(b)
    out = []
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * nextvalues - values_next[:, i]
        new = delta + gamma * lam * last
        nextvalues = nextvalues * (1 - mask[:, i]) + values_next[:, i] * mask[:, i]
        last = last * (1 - mask[:, i]) + new * mask[:, i]
        out.append(last)
    return torch.stack(out[::-1], dim=1)


def test_gae_bootstrap_matches_areal() -> None:
    d = adversarial(8)
    mask = d["mask"].clone()
    mask[1, :3] = 1  # AReaL's layout: right padding only
    rewards = torch.randn(6, 7, generator=torch.Generator().manual_seed(9)) * mask
    values = torch.randn(6, 8, generator=torch.Generator().manual_seed(10))
    trunc = torch.tensor([True, False, True, False, True, True])
    lens = mask.sum(1).long()
    for r in range(6):  # AReaL reads V after the last token at position T; put it there
        v_after = values[r, lens[r]].clone()
        values[r, lens[r] :] = 0.0
        values[r, 7] = v_after
    peer = peer_areal_gae(rewards, values, mask, trunc, 0.95, 0.9)
    boot = torch.where(trunc, values[:, 7], 0.0)
    ours, _ = gae(rewards, values[:, :7], mask, 0.95, 0.9, last_values=boot)
    live = mask > 0
    torch.testing.assert_close(ours[live], peer[live], **FP32)
    plain, _ = gae(rewards, values[:, :7], mask, 0.95, 0.9)  # default: nothing bootstrapped
    peer0 = peer_areal_gae(rewards, values, mask, torch.zeros(6, dtype=torch.bool), 0.95, 0.9)
    torch.testing.assert_close(plain[live], peer0[live], **FP32)


def test_step_advantages_defaults_are_the_trainers_bits() -> None:
    d = adversarial(11, b=10)
    batch = batch_of(d["mask"], REWARDS, GROUPS)
    adv, ret = step_advantages(batch)
    assert ret is None and torch.equal(adv, group_token_advantages(batch, True))
    adv, _ = step_advantages(batch, whiten=True, normalize_std=False)
    assert torch.equal(adv, whiten_tokens(group_token_advantages(batch, False), batch.mask))
    values = torch.randn(10, 7, generator=torch.Generator().manual_seed(12))
    adv, ret = step_advantages(batch, values, gamma=0.9, lam=0.8)
    want = gae(batch.token_rewards, values, batch.mask, 0.9, 0.8)
    assert torch.equal(adv, want[0]) and ret is not None and torch.equal(ret, want[1])
    local = torch.tensor([True] * 5 + [False] * 5)
    adv, _ = step_advantages(batch, whiten=True, local=local)
    masked = torch.where(local[:, None], group_token_advantages(batch, True), 0.0)
    assert torch.equal(adv, whiten_tokens(masked, torch.where(local[:, None], batch.mask, 0.0)))
    # bootstrap_truncated uses each truncated row's last step value
    trunc = torch.tensor([True] * 10)
    adv_b, _ = step_advantages(batch, values, gamma=0.9, lam=0.8, bootstrap_truncated=True,
                               truncated=trunc)  # fmt: skip
    idx = (batch.mask > 0).float().cumsum(1).argmax(1)
    boot = torch.where(batch.mask.sum(1) > 0, values[torch.arange(10), idx], 0.0)
    assert torch.equal(adv_b, gae(batch.token_rewards, values, batch.mask, 0.9, 0.8, boot)[0])


def peer_kl_in_reward(scores, old_logp, ref_logp, mask, beta):
    """verl apply_kl_penalty with low_var_kl (AReaL and TRL's PPO likewise, per token):
    token scores - beta * clamp(e^kl - kl - 1, -10, 10) * mask, kl = clamp(ref - old, +-20)."""
    kl = (ref_logp - old_logp).clamp(-20, 20)
    return scores - beta * (kl.exp() - kl - 1).clamp(-10, 10) * mask


def test_token_kl_in_reward_matches_verl_apply_kl_penalty() -> None:
    """objective.kl_in_reward_level token with the proximal log-probs: each token's reward
    carries its own penalty (GAE then differs from the sequence level's), the row's reward the
    sum (what the group estimators see: the sequence level's rewards up to rounding)."""
    from learner.shaping import penalise_kl

    d = adversarial(12, b=10)
    mask, prox = d["mask"], d["base"]
    ref = d["logp"]  # log-ratios to +-25 in row 4: the cap acts
    batch = batch_of(mask, REWARDS, GROUPS)
    seq = batch_of(mask, REWARDS, GROUPS)
    peer = peer_kl_in_reward(batch.token_rewards, prox, ref, mask, 0.1)
    pen = torch.where(mask > 0, kl_penalty(prox, ref, "k3", 10.0), 0.0).double()
    mean = penalise_kl(batch, pen, 0.1, "token")
    live = mask > 0
    torch.testing.assert_close(batch.token_rewards[live], peer[live].float(), **FP32)
    assert (batch.token_rewards[~live] == 0).all()
    k = pen.sum(1)
    torch.testing.assert_close(batch.rewards, (REWARDS - 0.1 * k).float(), **FP32)
    assert mean == pytest.approx(float((k / live.sum(1).clamp_min(1)).mean()), rel=1e-6)
    penalise_kl(seq, k, 0.1)
    torch.testing.assert_close(seq.rewards, batch.rewards, **FP32)  # group estimators: same
    values = torch.randn(10, 7, generator=torch.Generator().manual_seed(13))
    ours, _ = gae(batch.token_rewards, values, mask, 0.9, 0.8)
    want, _ = gae(peer.float(), values, mask, 0.9, 0.8)
    torch.testing.assert_close(ours[live], want[live], **FP32)
    at_end, _ = gae(seq.token_rewards, values, mask, 0.9, 0.8)
    assert not torch.allclose(ours[live], at_end[live])  # where the penalty sits matters


def test_kl_in_reward_options_need_kl_in_reward() -> None:
    from models.errors import ConfigError

    for key, value in (("kl_in_reward_level", "token"), ("kl_in_reward_logp", "proximal")):
        with pytest.raises(ConfigError, match=f"objective.{key}=.*kl_in_reward=true only"):
            ObjectiveConfig(**{key: value})
        assert getattr(ObjectiveConfig(kl_in_reward=True, **{key: value}), key) == value
    with pytest.raises(ConfigError, match="objective.kl_in_reward_level=.*one of"):
        ObjectiveConfig(kl_in_reward=True, kl_in_reward_level="row")
    assert ObjectiveConfig(kl_in_reward=True, kl_cap=5.0).kl_cap == 5.0  # the penalty applies it
