"""Rollout correction against this file's own re-statement of verl's
rollout-correction helpers (trainer/ppo/rollout_corr_helper.py, read, not imported): IS
weights at token / sequence level truncated at the upper threshold, rejection at token /
sequence / geometric level outside [lower, upper], the per-token veto of whole rows, the
rejected tokens removed from the loss denominator (verl's modified response_mask). Inputs:
padded and empty rows, log-ratios to +-25 (past the e^+-20 guard), -inf log-probs. Plus the
behaviour-vs-learner mismatch metrics against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss
from learner.objectives.correction import rollout_correction
from learner.step_metrics import StepMetrics, mismatch_stats
from models.errors import ConfigError

FP32 = dict(atol=2e-6, rtol=2e-6)
BOUND = 20.0  # verl SAFETY_BOUND, looprl MAX_LOG_RATIO


def adversarial(seed: int = 0, b: int = 7, t: int = 6) -> dict[str, torch.Tensor]:
    """row 1 left-padded, row 2 right-padded, row 3 empty, row 4 log-ratios +-25 and 12, row 5
    one token far below the others (a veto candidate)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t)
    mask[1, :2] = 0
    mask[2, 4:] = 0
    mask[3] = 0
    behav = -torch.rand(b, t, generator=g) * 3 - 0.01
    prox = behav + torch.randn(b, t, generator=g) * 0.4
    prox[4, :3] = behav[4, :3] + torch.tensor([25.0, -25.0, 12.0])
    prox[5, 3] = behav[5, 3] - 9.0
    prox = prox.clamp_max(0.0)
    logp = prox + torch.randn(b, t, generator=g) * 0.1
    adv = torch.randn(b, t, generator=g)
    return {"mask": mask, "behav": behav, "prox": prox, "logp": logp, "adv": adv}


# ---------------------------------------------------------------- verl, re-stated


def peer_level_log_ratio(old, rollout, mask, level):
    """log(pi_train / pi_rollout) per token, or the row's masked sum / mean broadcast."""
    lr = old - rollout
    if level == "token":
        return lr
    s = (lr * mask).sum(-1, keepdim=True)
    if level == "geometric":
        s = s / mask.sum(-1, keepdim=True).clamp_min(1e-8)
    return s.expand_as(lr)


def peer_is_weights(old, rollout, mask, level, upper):
    """compute_rollout_correction_weights: exp(clamp(level log-ratio, +-20)) * mask, then
    truncated at the upper threshold (TIS)."""
    w = peer_level_log_ratio(old, rollout, mask, level).clamp(-BOUND, BOUND).exp() * mask
    return w.clamp(max=upper)


def peer_keep(old, rollout, mask, level, upper, lower, veto=None):
    """compute_rollout_rejection_mask then the veto: the modified response mask."""
    w = peer_level_log_ratio(old, rollout, mask, level).clamp(-BOUND, BOUND).exp()
    keep = ((w >= lower) & (w <= upper)).float() * mask
    if veto is not None:
        bad = ((old - rollout) < math.log(veto)) & (mask > 0)
        keep = keep * (~bad.any(-1, keepdim=True)).float()
    return keep


# ---------------------------------------------------------------- weights and rejection


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_match_verl(level: str) -> None:
    d = adversarial(1)
    cfg = ObjectiveConfig(kind="grpo", is_cap=2.0, is_level=level)
    got = rollout_correction(cfg, d["mask"], d["prox"], d["behav"])
    want = peer_is_weights(d["prox"], d["behav"], d["mask"], level, 2.0)
    live = d["mask"] > 0
    torch.testing.assert_close(got.weight[live], want[live], **FP32)
    assert not got.rejected.any()
    # the +-25 row: the token level weight of the -25 token is e^-20, not 0
    assert level != "token" or got.weight[4, 1] == pytest.approx(math.exp(-20), rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_and_veto_match_verl(level: str) -> None:
    d = adversarial(2)
    upper, lower = (1.5, 0.6) if level != "sequence" else (3.0, 0.3)
    cfg = ObjectiveConfig(kind="grpo", is_cap=upper, is_cap_low=lower, is_mode="mask",
                          is_level=level, is_veto=1e-3)  # fmt: skip
    got = rollout_correction(cfg, d["mask"], d["prox"], d["behav"])
    keep = peer_keep(d["prox"], d["behav"], d["mask"], level, upper, lower, veto=1e-3)
    live = d["mask"] > 0
    assert torch.equal(~got.rejected[live], keep[live] > 0)
    assert got.vetoed[5].any() and got.vetoed[4].any()  # e^-9 and e^-25 tokens veto rows 5, 4
    assert 0 < int(keep.sum()) < int(live.sum())  # some kept, some rejected: the test bites
    # kept tokens carry the true (untruncated) ratio, as verl's IS weights with its RS mask
    w = peer_level_log_ratio(d["prox"], d["behav"], d["mask"], level).clamp(-20, 20).exp()
    torch.testing.assert_close(got.weight[keep > 0], w[keep > 0], **FP32)
    assert (got.weight[live & (keep == 0)] == 0).all()


def peer_clip_loss(logp, old, adv, eps):
    r = (logp - old).clamp(-BOUND, BOUND).exp()
    return torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps))


@pytest.mark.parametrize("in_denominator", [True, False])
def test_policy_loss_with_rejection_matches_verl_modified_mask(in_denominator: bool) -> None:
    """ppo, sequence-level IS weights and rejection, veto: the loss and gradient of verl's
    token-mean over its modified response mask (in_denominator False), or over the original
    mask with rejected tokens at weight 0 (looprl's default)."""
    d = adversarial(3)
    cfg = ObjectiveConfig(kind="ppo", is_cap=4.0, is_cap_low=0.25, is_mode="mask",
                          is_level="sequence", is_veto=1e-3,
                          is_rejected_in_denominator=in_denominator)  # fmt: skip
    ours, peer_lp = d["logp"].clone().requires_grad_(), d["logp"].clone().requires_grad_()
    loss, m = policy_loss(cfg, {"mask": d["mask"], "advantages": d["adv"], "logp": ours,
                                "prox_logp": d["prox"], "behav_logp": d["behav"]})  # fmt: skip
    keep = peer_keep(d["prox"], d["behav"], d["mask"], "sequence", 4.0, 0.25, veto=1e-3)
    w = peer_is_weights(d["prox"], d["behav"], d["mask"], "sequence", float("inf"))
    pg = peer_clip_loss(peer_lp, d["prox"], d["adv"], 0.2) * w
    denom = d["mask"] if in_denominator else keep
    peer = (pg * keep).sum() / denom.sum()
    torch.testing.assert_close(loss, peer, **FP32)
    (g_ours,) = torch.autograd.grad(loss, ours)
    (g_peer,) = torch.autograd.grad(peer, peer_lp)
    torch.testing.assert_close(g_ours, g_peer, **FP32)
    live = d["mask"] > 0
    assert m["is_masked_frac"] + m["is_vetoed_frac"] >= float(1 - keep[live].mean()) - 1e-6
    assert m["is_vetoed_frac"] > 0


def test_minus_inf_tokens_leave_the_row_sums_and_get_no_gradient() -> None:
    """A -inf behaviour (or proximal) log-prob makes its token invalid (0 loss, 0 gradient);
    the row's sequence weight is the ratio over its other tokens (verl's masked sum would be
    -inf there, e^-20 after its guard, and the whole row rejected: looprl drops one token)."""
    d = adversarial(4)
    behav, prox = d["behav"].clone(), d["prox"].clone()
    behav[0, 2], prox[6, 1] = -math.inf, -math.inf
    cfg = ObjectiveConfig(kind="ppo", is_cap=1e6, is_level="sequence", is_veto=1e-3)
    got = rollout_correction(cfg, d["mask"], prox, behav)
    assert torch.isfinite(got.weight).all() and not got.vetoed[0].any()
    ok = torch.ones_like(d["mask"], dtype=torch.bool)
    ok[0, 2] = False
    want = ((prox[0] - behav[0])[ok[0]].sum()).clamp(-20, 20).exp()
    torch.testing.assert_close(got.weight[0, 0], want, **FP32)
    logp = d["logp"].clone().requires_grad_()
    loss, m = policy_loss(cfg, {"mask": d["mask"], "advantages": d["adv"], "logp": logp,
                                "prox_logp": prox, "behav_logp": behav})  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert g[0, 2] == 0 and g[6, 1] == 0 and m["invalid_frac"] > 0


def test_default_token_truncation_is_the_old_behaviour_weight() -> None:
    """is_level token, no lower bound, no veto: w = min(exp(prox - behav), C), as before."""
    d = adversarial(5)
    got = rollout_correction(ObjectiveConfig(is_cap=2.0), d["mask"], d["prox"], d["behav"])
    want = (d["prox"] - d["behav"]).clamp(-20, 20).exp().clamp_max(2.0)
    live = d["mask"] > 0
    assert torch.equal(got.weight[live], want[live])


@pytest.mark.parametrize(("over", "match"), [
    ({"is_level": "sequence"}, "objective.is_level='sequence': applies to the behaviour weight"),
    ({"is_veto": 1e-4}, "objective.is_veto=0.0001: applies"),
    ({"is_rejected_in_denominator": False}, "objective.is_rejected_in_denominator=False"),
    ({"is_cap": 2.0, "is_cap_low": 2.0}, "objective.is_cap_low=2.0: must be null or in"),
    ({"is_cap_low": 0.5}, "objective.is_cap_low=0.5: .*with is_cap set"),
    ({"is_cap": 2.0, "is_veto": 1.0}, "objective.is_veto=1.0: must be null or in"),
    ({"is_cap": 2.0, "is_level": "geo"}, "objective.is_level='?geo'?: must be one of"),
    ({"kind": "flow_dppo", "is_cap": 2.0, "is_rejected_in_denominator": False},
     "not available for flow_dppo"),
])  # fmt: skip
def test_correction_keys_refused_in_one_line(over: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ObjectiveConfig(**over)
    assert ObjectiveConfig(kind="dppo", is_level="geometric").is_level == "geometric"


# ---------------------------------------------------------------- mismatch metrics


def test_mismatch_family_matches_its_definitions() -> None:
    """KL(mu || pi) by k1 and k3 per token and per sequence, on padded / empty rows, a -inf
    log-prob and a log-ratio of 25 (its row's k3 through the e^20 guard)."""
    d = adversarial(6)
    behav, learner = d["behav"].clone(), d["prox"].clone()
    behav[0, 0] = -math.inf
    mask = d["mask"]
    rejected = torch.zeros_like(mask, dtype=torch.bool)
    rejected[2, :2] = True
    sm = StepMetrics()
    mismatch_stats(sm, mask, behav, learner, rejected)
    out = sm.reduce(None)
    live = (mask > 0) & torch.isfinite(behav)
    dd = (learner - behav).double()
    tok = dd[live]
    assert out["mismatch_kl_token"] == pytest.approx(float((-tok).mean()), rel=1e-6)
    assert out["kl"] == pytest.approx(float((tok.exp() - 1 - tok).mean()), rel=1e-6)
    rows = [b for b in range(mask.shape[0]) if live[b].any()]
    seq = torch.stack([dd[b][live[b]].sum() for b in rows])
    assert len(rows) == 6  # the empty row is not a sequence
    assert out["mismatch_kl_seq"] == pytest.approx(float((-seq).mean()), rel=1e-6)
    c = seq.clamp(-20, 20)
    assert out["mismatch_k3_seq"] == pytest.approx(float((c.exp() - 1 - c).mean()), rel=1e-6)
    assert out["mismatch_masked_frac"] == pytest.approx(2 / float((mask > 0).sum()))
    assert math.isfinite(out["mismatch_k3_seq"]) and out["logp_mismatch_max"] == pytest.approx(
        float(tok.abs().max()), rel=1e-6
    )
