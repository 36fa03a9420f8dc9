"""RL objectives against numbers derived by hand (each derivation is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import broadcast_to_tokens, gae, group_advantages, normalize_advantages
from learner.config import TrainConfig
from learner.losses import aggregate
from learner.objective_config import ObjectiveConfig
from learner.objectives import policy_loss, value_loss
from models.sampling import Sampling

LN = math.log
INF = float("inf")


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: object, expected: object, tol: float = 1e-6) -> None:
    a = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(a, torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def logp_leaf(rows) -> torch.Tensor:
    return t(rows).requires_grad_()


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------- advantages


def test_gae_by_hand_with_right_and_left_padding() -> None:
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72; V after the last step = 0.
    # row 0: r = [0, 0, 0, 1], V = [0.5, 0.6, 0.7, 0.8]
    #   d3 = 1 - 0.8 = 0.2                A3 = 0.2
    #   d2 = 0.9 * 0.8 - 0.7 = 0.02       A2 = 0.02 + 0.72 * 0.2     = 0.164
    #   d1 = 0.9 * 0.7 - 0.6 = 0.03       A1 = 0.03 + 0.72 * 0.164   = 0.14808
    #   d0 = 0.9 * 0.6 - 0.5 = 0.04       A0 = 0.04 + 0.72 * 0.14808 = 0.1466176
    # row 1: 3 steps, then padding holding garbage: r = [0, 0, 2], V = [1.0, 0.5, 0.25]
    #   d2 = 2 - 0.25 = 1.75              A2 = 1.75
    #   d1 = 0.9 * 0.25 - 0.5 = -0.275    A1 = -0.275 + 0.72 * 1.75  = 0.985
    #   d0 = 0.9 * 0.5 - 1.0 = -0.55      A0 = -0.55 + 0.72 * 0.985  = 0.1592
    # row 2: row 1 left-padded.
    rewards = t([[0, 0, 0, 1], [0, 0, 2, 9], [5, 0, 0, 2]])
    values = t([[0.5, 0.6, 0.7, 0.8], [1.0, 0.5, 0.25, 7], [INF, 1.0, 0.5, 0.25]])
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(
        adv,
        [[0.1466176, 0.14808, 0.164, 0.2], [0.1592, 0.985, 1.75, 0], [0, 0.1592, 0.985, 1.75]],
    )
    close(
        ret,
        [[0.6466176, 0.74808, 0.864, 1.0], [1.1592, 1.485, 2.0, 0], [0, 1.1592, 1.485, 2.0]],
    )


def test_gae_rejects_out_of_range_gamma_and_lambda() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, x + 1, gamma=1.1, lam=0.9)
    with pytest.raises(ValueError, match="lam"):
        gae(x, x, x + 1, gamma=0.9, lam=-0.1)


def test_group_advantages_with_and_without_std_and_singletons() -> None:
    # group 7 (not adjacent): rewards 1, 0, 1, 0 -> mean 0.5, deviations +-0.5,
    #   sample var = 4 * 0.25 / 3 = 1/3, std = 0.5773503 -> +-0.5 / 0.5773503 = +-0.8660254
    # group 3: one sample -> 0.  group 9: rewards 2, 2 (constant) -> 0, never 0/0.
    rewards = t([1, 0, 5, 1, 2, 0, 2])
    ids = torch.tensor([7, 7, 3, 7, 9, 7, 9])
    close(group_advantages(rewards, ids, normalize_std=False), [0.5, -0.5, 0, 0.5, 0, -0.5, 0])
    s = 0.8660254
    close(group_advantages(rewards, ids, normalize_std=True, eps=0.0), [s, -s, 0, s, 0, -s, 0])
    # eps is added to the std: 0.5 / (0.5773503 + 0.5) = 0.4641016
    close(group_advantages(rewards, ids, True, eps=0.5)[:2], [0.4641016, -0.4641016])
    close(broadcast_to_tokens(t([2, -1]), t([[1, 1, 0], [1, 0, 0]])), [[2, 2, 0], [-1, 0, 0]])


def test_normalize_advantages_over_masked_tokens() -> None:
    # tokens 1, 2, 3 (mean 2, population std sqrt(2/3) = 0.8164966); the pad is ignored.
    out = normalize_advantages(t([[1, 2], [3, 100]]), t([[1, 1], [1, 0]]), eps=0.0)
    close(out, [[-1.2247449, 0], [1.2247449, 0]])


# ---------------------------------------------------------------- PPO / GRPO


def test_ppo_clips_both_sides_with_clip_higher() -> None:
    # eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28]; base log-prob 0 so r = e^logp.
    #   r    A    min(rA, clip(r)A)        loss    d loss / d logp
    #  1.5  +1    min(1.5, 1.28)   = 1.28  -1.28   0     (clipped high)
    #  0.5  -1    min(-0.5, -0.8)  = -0.8   0.8    0     (clipped low)
    #  1.1  +2    2.2                     -2.2    -rA = -2.2
    #  0.5  +1    min(0.5, 0.8)    = 0.5   -0.5   -0.5
    #  1.5  -1    min(-1.5, -1.28) = -1.5   1.5    1.5
    # token mean: (-1.28 + 0.8 - 2.2 - 0.5 + 1.5) / 5 = -0.336
    cfg = ObjectiveConfig(kind="ppo", eps_low=0.2, eps_high=0.28)
    logp = logp_leaf([[LN(1.5), LN(0.5), LN(1.1), LN(0.5), LN(1.5)]])
    batch = {"mask": t([[1] * 5]), "advantages": t([[1, -1, 2, 1, -1]]), "behav_logp": t([[0] * 5])}
    loss, m = policy_loss(cfg, batch | {"logp": logp})
    close(loss, -0.336)
    close(grad_of(loss, logp), [[0, 0, -2.2 / 5, -0.5 / 5, 1.5 / 5]])
    close([m["clip_frac"], m["clip_low_frac"], m["clip_high_frac"]], [0.4, 0.2, 0.2])
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5)


def test_ppo_dual_clip() -> None:
    # eps 0.2, c = 3. Loss per token = max(-rA, -clip(r)A), then min(., -cA) when A < 0.
    #   r=5, A=-1: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3, gradient 0
    #   r=2, A=-1: max(2, 1.2) = 2 (< 3, kept), gradient -rA = 2
    #   r=5, A=+1: max(-5, -1.2) = -1.2 clipped high, gradient 0
    #   r=0.5, A=-2: max(1.0, 1.6) = 1.6 clipped low (< 6), gradient 0
    # mean (3 + 2 - 1.2 + 1.6) / 4 = 1.35
    cfg = ObjectiveConfig(kind="ppo", dual_clip=3.0)
    logp = logp_leaf([[LN(5), LN(2), LN(5), LN(0.5)]])
    batch = {"mask": t([[1] * 4]), "advantages": t([[-1, -1, 1, -2]]), "prox_logp": t([[0] * 4])}
    loss, m = policy_loss(cfg, batch | {"logp": logp})
    close(loss, 1.35)
    close(grad_of(loss, logp), [[0, 2 / 4, 0, 0]])
    close([m["dual_clip_frac"], m["clip_frac"]], [0.25, 0.5])


def test_grpo_sequence_advantages_and_aggregation_modes() -> None:
    # r = 1 everywhere (logp = behav_logp), so the per-token loss is -A.
    # seq 0: 1 token, A = 2 -> [-2];  seq 1: 3 tokens, A = 1 -> [-1, -1, -1]
    #   token_mean = -5 / 4 = -1.25;  seq_mean = (-2 + -1) / 2 = -1.5
    #   seq_mean_token_sum = (-2 + -3) / 2 = -2.5;  token_mean with normalizer 10: -0.5
    behav = t([[-1.0, 0, 0], [-0.5, -0.2, -0.3]])
    batch = {"mask": t([[1, 0, 0], [1, 1, 1]]), "advantages": t([2, 1]), "behav_logp": behav}
    expected = {"token_mean": -1.25, "seq_mean": -1.5, "seq_mean_token_sum": -2.5}
    for mode, want in expected.items():
        logp = behav.clone().requires_grad_()
        loss, _ = policy_loss(
            ObjectiveConfig(kind="grpo", aggregation=mode), batch | {"logp": logp}
        )
        close(loss, want)
    logp = behav.clone().requires_grad_()
    loss, m = policy_loss(ObjectiveConfig(), batch | {"logp": logp, "normalizer": 10.0})
    close(loss, -0.5)
    close(grad_of(loss, logp), [[-0.2, 0, 0], [-0.1, -0.1, -0.1]])  # -A / 10
    assert m["num_tokens"] == 4.0


def test_aggregate_directly() -> None:
    loss = t([[4, 99], [1, 2]])
    mask = t([[1, 0], [1, 1]])
    close(aggregate(loss, mask, "token_mean"), 7 / 3)
    close(aggregate(loss, mask, "seq_mean"), (4 + 1.5) / 2)
    close(aggregate(loss, mask, "seq_mean_token_sum"), (4 + 3) / 2)
    close(aggregate(loss, torch.zeros(2, 2), "seq_mean"), 0.0)  # empty mask: 0, not NaN


def test_tis_truncates_behaviour_weight_in_ppo() -> None:
    # is_cap = 2: w = exp(prox - behav) = [3 -> 2 (truncated), 0.5]; r = 1, A = 1.
    # losses [-2, -0.5] -> mean -1.25; d/dlogp = -w r A / 2 = [-1, -0.25]
    cfg = ObjectiveConfig(kind="ppo", is_cap=2.0, is_mode="truncate")
    logp = logp_leaf([[-1.0, -2.0]])
    batch = {
        "mask": t([[1, 1]]),
        "advantages": t([[1, 1]]),
        "prox_logp": t([[-1.0, -2.0]]),
        "behav_logp": t([[-1.0 - LN(3), -2.0 - LN(0.5)]]),
    }
    loss, m = policy_loss(cfg, batch | {"logp": logp})
    close(loss, -1.25)
    close(grad_of(loss, logp), [[-1.0, -0.25]])
    close([m["is_truncated_frac"], m["is_weight_mean"]], [0.5, 1.25])


# ---------------------------------------------------------------- decoupled PPO


def dppo_batch():
    # eps 0.2, cap 2.   w = exp(prox - behav), r = exp(logp - prox)
    #   tok0: w 1.5, r 1.1, A +1: surrogate min(1.1, 1.1) = 1.1 -> -1.5 * 1.1 = -1.65
    #   tok1: w 3,   r 0.9, A -1: min(-0.9, -0.9) = -0.9 -> truncate: 2 * 0.9 = 1.8; mask: 0
    #   tok2: w 0.5, r 1.5, A +1: clipped at 1.2 -> -0.5 * 1.2 = -0.6 (gradient 0)
    prox = t([[-1.0, -2.0, -0.5]])
    batch = {
        "mask": t([[1, 1, 1]]),
        "advantages": t([[1, -1, 1]]),
        "prox_logp": prox,
        "behav_logp": prox - t([[LN(1.5), LN(3), LN(0.5)]]),
    }
    logp = (prox + t([[LN(1.1), LN(0.9), LN(1.5)]])).requires_grad_()
    return batch, logp


def test_dppo_truncate() -> None:
    batch, logp = dppo_batch()
    loss, m = policy_loss(ObjectiveConfig(kind="dppo", is_cap=2.0), batch | {"logp": logp})
    close(loss, (-1.65 + 1.8 - 0.6) / 3)  # -0.15
    # d/dlogp of -w r A = -w r A: [-1.65, 1.8, 0] / 3
    close(grad_of(loss, logp), [[-1.65 / 3, 1.8 / 3, 0]])
    close([m["is_weight_mean"], m["is_masked_frac"], m["clip_frac"]], [4 / 3, 0, 1 / 3])
    close(m["is_truncated_frac"], 1 / 3)


def test_dppo_mask() -> None:
    batch, logp = dppo_batch()
    cfg = ObjectiveConfig(kind="dppo", is_cap=2.0, is_mode="mask")
    loss, m = policy_loss(cfg, batch | {"logp": logp})
    close(loss, (-1.65 + 0 - 0.6) / 3)  # -0.75
    close(grad_of(loss, logp), [[-1.65 / 3, 0, 0]])
    close([m["is_weight_mean"], m["is_masked_frac"], m["clip_frac"]], [2 / 3, 1 / 3, 1 / 3])


def test_dppo_minus_inf_behaviour_logp_contributes_zero() -> None:
    batch, logp = dppo_batch()
    batch["behav_logp"] = batch["behav_logp"].clone()
    batch["behav_logp"][0, 1] = -INF  # w would be inf; the token is invalid
    for mode in ("truncate", "mask"):
        cfg = ObjectiveConfig(kind="dppo", is_cap=2.0, is_mode=mode)
        loss, m = policy_loss(cfg, batch | {"logp": logp})
        close(loss, (-1.65 - 0.6) / 3)
        g = grad_of(loss, logp)
        assert torch.isfinite(g).all() and g[0, 1] == 0.0
        close(m["invalid_frac"], 1 / 3)
        assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------- Flow-DPPO


def flow_logits():
    # V = 2. old q = [0.5, 0.5] on every token. new p = [0.8, 0.2] on tokens 0-3:
    #   KL(q || p) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = ln 1.25 = 0.2231 > threshold 0.1
    # token 4: p = [0.55, 0.45]: KL = 0.5 ln(1/1.1 * 1/0.9) = 0.0050 < 0.1
    p = [[0.8, 0.2]] * 4 + [[0.55, 0.45]]
    logits = (t([[[LN(a), LN(b)] for a, b in p]]) + 2.0).requires_grad_()
    old = torch.zeros(1, 5, 2) - 7.0
    return logits, old


def test_flow_dppo_sign_cases_by_hand() -> None:
    #   tok  target  r = p/q        A   KL > 0.1  pushes further?    kept?  loss
    #   0    0       0.8/0.5 = 1.6  +1  yes       A>0, r>1: yes      drop   0
    #   1    1       0.2/0.5 = 0.4  +1  yes       A>0, r<1: no       keep   -0.4
    #   2    1       0.4            -1  yes       A<0, r<1: yes      drop   0
    #   3    0       1.6            -1  yes       A<0, r>1: no       keep   1.6
    #   4    0       0.55/0.5 = 1.1 +1  no        (inside the region) keep  -1.1
    # token mean (0 - 0.4 + 0 + 1.6 - 1.1) / 5 = 0.02
    # gradient of -r A w.r.t. logits: -A r (onehot - p) / 5
    #   tok1: -0.4 (e1 - [0.8, 0.2])  = [0.32, -0.32]   -> / 5 = [0.064, -0.064]
    #   tok3: 1.6 (e0 - [0.8, 0.2])   = [0.32, -0.32]   -> [0.064, -0.064]
    #   tok4: -1.1 (e0 - [.55, .45])  = [-0.495, 0.495] -> [-0.099, 0.099]
    logits, old = flow_logits()
    batch = {
        "mask": t([[1] * 5]),
        "advantages": t([[1, 1, -1, -1, 1]]),
        "targets": torch.tensor([[0, 1, 1, 0, 0]]),
        "logits": logits,
        "old_logits": old,
    }
    cfg = ObjectiveConfig(kind="flow_dppo", kl_threshold=0.1)
    loss, m = policy_loss(cfg, batch, vocab_chunk=1)
    close(loss, 0.02)
    g = grad_of(loss, logits)
    close(g, [[[0, 0], [0.064, -0.064], [0, 0], [0.064, -0.064], [-0.099, 0.099]]])
    assert g[0, 0].eq(0).all() and g[0, 2].eq(0).all()  # exactly zero, not merely small
    close([m["drop_frac"], m["kl_over_threshold_frac"]], [0.4, 0.8])
    close(m["kl_old_new"], (4 * LN(1.25) + 0.5 * LN(1 / (1.1 * 0.9))) / 5)


def test_flow_dppo_precomputed_token_inputs_match_logits_path() -> None:
    # Same five tokens given as logp / prox_logp / kl instead of logits.
    logp = logp_leaf([[LN(0.8), LN(0.2), LN(0.2), LN(0.8), LN(0.55)]])
    kl = t([[LN(1.25)] * 4 + [0.005]])
    batch = {
        "mask": t([[1] * 5]),
        "advantages": t([[1, 1, -1, -1, 1]]),
        "logp": logp,
        "prox_logp": t([[LN(0.5)] * 5]),
        "kl": kl,
    }
    loss, _ = policy_loss(ObjectiveConfig(kind="flow_dppo", kl_threshold=0.1), batch)
    close(loss, 0.02)
    close(grad_of(loss, logp), [[0, -0.4 / 5, 0, 1.6 / 5, -1.1 / 5]])  # -r A / 5 where kept


def test_flow_dppo_minus_inf_old_support_is_exactly_zero() -> None:
    # V = 3, old q = [0.5, 0.5, 0] (entry 2 truncated, logit -inf), new p = [0.4, 0.4, 0.2]
    # KL = 2 * 0.5 ln(0.5 / 0.4) = ln 1.25 (entry 2 contributes 0).
    # tok0: target 0, r = 0.8 < 1 with A = +1 -> kept: loss -0.8
    # tok1: target 2, old log-prob -inf -> invalid: contributes exactly 0
    # token mean -0.8 / 2 = -0.4; grad row 0 = -0.8 (e0 - p) / 2 = [-0.24, 0.16, 0.08]
    logits = t([[[LN(0.4), LN(0.4), LN(0.2)]] * 2]).requires_grad_()
    old = t([[[0.0, 0.0, -INF]] * 2])
    batch = {
        "mask": t([[1, 1]]),
        "advantages": t([[1, 1]]),
        "targets": torch.tensor([[0, 2]]),
        "logits": logits,
        "old_logits": old,
        "behav_logp": t([[LN(0.5), -INF]]),
    }
    cfg = ObjectiveConfig(kind="flow_dppo", kl_threshold=0.1, is_cap=2.0, entropy_coef=0.0)
    loss, m = policy_loss(cfg, batch)
    close(loss, -0.4)
    g = grad_of(loss, logits)
    assert torch.isfinite(g).all()
    close(g, [[[-0.24, 0.16, 0.08], [0, 0, 0]]])
    close(m["invalid_frac"], 0.5)
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------- KL, entropy, critic


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        # d = ref - logp = ln 0.25 - ln 0.5 = -ln 2
        ("k1", LN(2), 1.0),  # -d; d/dlogp = 1
        ("k2", 0.5 * LN(2) ** 2, LN(2)),  # d^2/2 = 0.2402265; d/dlogp = -d
        ("k3", 0.5 - 1 + LN(2), 0.5),  # e^d - 1 - d = 0.1931472; d/dlogp = 1 - e^d
    ],
)
def test_kl_penalty_estimators(estimator: str, value: float, grad: float) -> None:
    # A = 0, so the loss is kl_coef * k exactly; kl_coef = 0.1.
    cfg = ObjectiveConfig(kind="grpo", kl_coef=0.1, kl_estimator=estimator)
    logp = logp_leaf([[LN(0.5)]])
    batch = {"mask": t([[1]]), "advantages": t([[0]]), "behav_logp": t([[LN(0.5)]])}
    loss, m = policy_loss(cfg, batch | {"logp": logp, "ref_logp": t([[LN(0.25)]])})
    close(loss, 0.1 * value)
    close(m["kl_ref"], value)
    close(grad_of(loss, logp), [[0.1 * grad]])


def test_entropy_bonus() -> None:
    # A = 0 and r = 1: loss = -0.1 * mean(H) = -0.1 * (1 + 2) / 2 = -0.15; d/dH = -0.05
    ent = logp_leaf([[1.0, 2.0]])
    batch = {
        "mask": t([[1, 1]]),
        "advantages": t([[0, 0]]),
        "logp": t([[-1, -1]]),
        "behav_logp": t([[-1, -1]]),
        "entropy": ent,
    }
    loss, m = policy_loss(ObjectiveConfig(kind="ppo", entropy_coef=0.1), batch)
    close(loss, -0.15)
    close(m["entropy"], 1.5)
    close(grad_of(loss, ent), [[-0.05, -0.05]])


def test_value_loss_clipping_by_hand() -> None:
    # value_clip 0.2: v_clip = old + clamp(v - old, -0.2, 0.2)
    #   v=1.0 old=0.9 R=1.5: v_clip = 1.0;  0.5 max(0.25, 0.25) = 0.125;  d/dv = v - R = -0.5
    #   v=2.0 old=1.0 R=0.0: v_clip = 1.2;  0.5 max(4, 1.44)   = 2.0;    d/dv = 2.0
    #   v=3.0 old=1.0 R=2.5: v_clip = 1.2;  0.5 max(0.25, 1.69) = 0.845; d/dv = 0 (clipped)
    # mean 2.97 / 3 = 0.99. Without a clip: 0.5 (0.25 + 4 + 0.25) / 3 = 0.75
    values = logp_leaf([[1.0, 2.0, 3.0, 5.0]])
    batch = {
        "mask": t([[1, 1, 1, 0]]),
        "old_values": t([[0.9, 1.0, 1.0, 0.0]]),
        "returns": t([[1.5, 0.0, 2.5, 0.0]]),
        "values": values,
    }
    loss, m = value_loss(ObjectiveConfig(value_clip=0.2), batch)
    close(loss, 0.99)
    close(grad_of(loss, values), [[-0.5 / 3, 2.0 / 3, 0, 0]])
    close(m["value_clip_frac"], 1 / 3)
    loss, _ = value_loss(ObjectiveConfig(value_clip=None), batch)
    close(loss, 0.75)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "a2c"),
        ("eps_low", 1.0),
        ("eps_low", -0.1),
        ("eps_high", -0.1),
        ("dual_clip", 1.0),
        ("is_cap", 0.0),
        ("is_mode", "clip"),
        ("kl_threshold", 0.0),
        ("kl_coef", -1.0),
        ("kl_estimator", "k4"),
        ("entropy_coef", -0.1),
        ("aggregation", "sum"),
        ("value_clip", 0.0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^objective.{field}={value!r}: must"):
        ObjectiveConfig(**{field: value})  # type: ignore[arg-type]


def test_sampling_and_token_stats_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="^rollout.temperature=0.0: must be > 0"):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError, match="^rollout.top_p=0.0: must be in"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="^train.vocab_chunk=0: must be >= 1"):
        TrainConfig(vocab_chunk=0)


def test_value_config_and_missing_batch_keys() -> None:
    base = {"mask": t([[1]]), "advantages": t([[1]]), "logp": t([[0]])}
    with pytest.raises(ValueError, match="behav_logp"):
        policy_loss(ObjectiveConfig(kind="ppo"), base)
    with pytest.raises(ValueError, match="prox_logp"):
        policy_loss(ObjectiveConfig(kind="dppo"), base | {"behav_logp": t([[0]])})
    with pytest.raises(ValueError, match="'kl'"):
        policy_loss(ObjectiveConfig(kind="flow_dppo"), base | {"prox_logp": t([[0]])})
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(
            ObjectiveConfig(kind="ppo"), base | {"advantages": t([1]), "behav_logp": t([[0]])}
        )


def test_unused_non_finite_inputs_do_not_invalidate_tokens() -> None:
    # ppo with prox_logp and no is_cap never uses behav_logp: its -inf changes nothing.
    # r = e^0 = 1, A = [1, 2] -> losses [-1, -2], mean -1.5
    batch = {
        "mask": t([[1, 1]]),
        "advantages": t([[1, 2]]),
        "logp": t([[-1.0, -2.0]]),
        "prox_logp": t([[-1.0, -2.0]]),
        "behav_logp": t([[-INF, -1.0]]),
        "kl": t([[INF, 0.0]]),  # a metric only, outside flow_dppo
    }
    loss, m = policy_loss(ObjectiveConfig(kind="ppo"), batch)
    close(loss, -1.5)
    assert m["invalid_frac"] == 0.0 and m["kl_old_new"] == 0.0


# ---------------------------------------------------------------- divergence PPO, binary KL


def binary_kl_fp64(anchor_logp: float, logp: float) -> float:
    """The binary KL in fp64 with exact 1 - p (expm1), log-probs clamped to [ln 1e-12, -1e-12]."""
    a = min(max(anchor_logp, LN(1e-12)), -1e-12)
    b = min(max(logp, LN(1e-12)), -1e-12)
    return math.exp(a) * (a - b) - math.expm1(a) * (LN(-math.expm1(a)) - LN(-math.expm1(b)))


def test_binary_kl_of_confident_tokens_is_finite_and_drops() -> None:
    # Once a bug: mu = exp(anchor) within 3e-8 of 1 made 1 - mu round to 0 in fp32, the
    # divergence (1 - mu) log 0 = NaN, and the token was kept. Each token here moves from a
    # confident anchor to pi = 0.5 with A < 0 (pushing pi further down): binary KL about
    # ln 2 = 0.693 > 0.05, so it must be dropped. The -inf anchor (mu = 0) moves to pi = 0.5
    # with A > 0: KL = -ln(1 - 0.5) = ln 2, pushing up, dropped too. The last token goes from
    # 1 - 1e-8 to pi = 1 with A > 0: a negligible move (KL 8e-8 after the clamp), kept.
    from learner.losses import divergence_surrogate

    anchor = [-1e-8, -2.9e-8, 0.0, -INF, -1e-8]
    logp = [LN(0.5)] * 4 + [0.0]
    adv = t([[-1, -1, -1, 1, 1]])
    a, lp = t([anchor]), t([logp])
    ratio = (lp - a).clamp(-20, 20).exp()
    loss, dropped, div = divergence_surrogate(ratio, lp, a, adv, "kl", 0.05)
    assert torch.isfinite(div).all(), div
    close(div, [[binary_kl_fp64(x, y) for x, y in zip(anchor, logp, strict=True)]], tol=2e-7)
    assert dropped.tolist() == [[True, True, True, True, False]]
    assert loss[0, :4].tolist() == [0.0] * 4 and loss[0, 4] == -1.0
    # through policy_loss (behaviour anchor): finite divergence_mean, 3 of 4 tokens dropped
    cfg = ObjectiveConfig(kind="divergence_ppo", divergence="kl", divergence_threshold=0.05)
    batch = {"mask": t([[1] * 4]), "advantages": t([[-1, -1, -1, 1]]),
             "behav_logp": t([[-1e-8, -2.9e-8, 0.0, -1e-8]]), "logp": t([[LN(0.5)] * 3 + [0.0]])}  # fmt: skip
    _, m = policy_loss(cfg, batch)
    assert math.isfinite(m["divergence_mean"]) and m["drop_frac"] == 0.75
    close(m["divergence_mean"], (3 * LN(2) + binary_kl_fp64(-1e-8, 0.0)) / 4, tol=1e-6)
