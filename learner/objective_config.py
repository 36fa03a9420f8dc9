"""The objective's config (`ObjectiveConfig`, the run config's `objective` section) and the
values its keys take; re-exported by learner.config with the other learner configs. Validated
on construction (models.settings): a bad value raises
``models.errors.ConfigError("objective.<field>=<value>: <what is expected>")``.
docs/OBJECTIVES.md gives the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from models.settings import checker

__all__ = ["ObjectiveConfig"]

KINDS = ("grpo", "ppo", "dppo", "flow_dppo", "divergence_ppo")
AGGREGATIONS = (
    "token_mean",
    "seq_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "dr_grpo",
)
LENGTH_NORMED = ("seq_mean_token_sum_norm", "dr_grpo")
"""Aggregations dividing by a constant length (objective.loss_scale_length) instead of n_b."""
RATIO_LEVELS = ("token", "sequence")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
"""The estimators whose advantage is a row's reward against its group's (depth_cost_in)."""
DEPTH_COST_IN = ("reward", "advantage")
SINGLETONS = ("zero", "reward")
WHITEN_STDS = ("population", "bessel")
KL_CAP_DEFAULT = 10.0
"""objective.kl_cap's default, also `learner.losses.kl_penalty`'s."""
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REWARD_LEVELS = ("sequence", "token")
KL_REWARD_LOGPS = ("behaviour", "proximal")
DIVERGENCES = ("tv", "kl")
ANCHORS = ("behaviour", "proximal")
LOOP_WEIGHTINGS = ("last", "uniform", "progressive", "exit_pdf", "learned")
IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class ObjectiveConfig:
    """The policy objective, its advantages and its critic (docs/OBJECTIVES.md)."""

    kind: str = "grpo"
    """grpo, ppo (with a critic), dppo (AReaL decoupled PPO), flow_dppo or divergence_ppo."""
    epochs: int = 1
    """Passes over each step's rollouts (proximal log-probs and advantages from the step's start)."""
    minibatches: int = 1
    """Optimizer updates per pass: the step's groups split into this many mini-batches."""
    critic: bool | None = None
    """Train a critic and use GAE advantages: null = on for ppo only; true for dppo / flow_dppo
    / divergence_ppo too (actor/critic); grpo has group advantages and no critic."""
    whiten: bool = False
    """Whiten the advantages over the step's response tokens (mean 0, std 1)."""
    dynamic_sampling: bool = False
    """Drop complete groups whose rewards are all equal (no group signal); new prompts refill;
    needs rollout.n >= 2 (the run config refuses n = 1)."""
    overlong_buffer: int = 0
    """Soft overlong penalty over the last this many tokens before rollout.max_tokens (0: off)."""
    overlong_penalty: float = 1.0
    """The penalty at rollout.max_tokens (linear from 0 at max_tokens - overlong_buffer)."""
    depth_cost: float = 0.0
    """Compute cost of depth: depth_cost x the completion's mean exit depth / the run's full
    depth (learner.shaping.depth_fraction), taken off as depth_cost_in says (0: off)."""
    depth_cost_in: str = "reward"
    """reward: off each reward before the advantages (learner.shaping), so GRPO's std
    normalisation rescales it with the task reward (in a group where every sample scores the
    same, the cost alone is then normalised to order 1 whatever depth_cost is); advantage:
    kept out of the rewards and added to the group estimators' advantages in reward units,
    -depth_cost x (f_i - mean of f over i's group), not normalised
    (learner.batching.step_advantages; grpo, rloo, reinforce_pp_baseline without a critic)."""
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - eps_low; in [0, 1)."""
    eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + eps_high (> eps_low = clip-higher); >= 0."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of A < 0 tokens at c|A|; null disables."""
    is_cap: float | None = None
    """Cap C > 0 on w = exp(prox_logp - behav_logp); ppo/grpo/flow_dppo apply w only if set."""
    is_mode: str = "truncate"
    """Use of is_cap: truncate (w = min(w, C)) or mask (tokens with w > C get weight 0)."""
    is_level: str = "token"
    """Level of w and of its bounds: token, sequence (exp of the row's summed log w, e^+-20 at
    most) or geometric (exp of the row's mean log w); verl rollout_is / rollout_rs levels."""
    is_cap_low: float | None = None
    """Lower bound on w, in (0, is_cap): truncate raises w to it, mask rejects below it (verl
    rollout_rs_threshold_lower); null: no lower bound."""
    is_veto: float | None = None
    """Reject a whole row when one of its tokens has exp(prox_logp - behav_logp) below this
    (verl rollout_token_veto_threshold, e.g. 1e-4); null: no veto; in (0, 1)."""
    is_rejected_in_denominator: bool = True
    """Tokens rejected by is_mode mask or is_veto still count in the loss denominator (weight 0:
    looprl, AReaL) or are removed from it (false: verl's modified response_mask)."""
    max_token_version_gap: int | None = None
    """Mask out of the loss every response token sampled with weights more than this many
    versions older than the learner's (partial rollouts whose weights changed mid-completion:
    rollout.token_versions; AReaL / PipelineRL); null: none (staleness.* bounds whole rollouts)."""
    kl_threshold: float = 0.05
    """flow_dppo trust region: updates with KL(old||new) > this that push further are dropped."""
    divergence_is_cap: float | None = 20.0
    """divergence_ppo: cap C on r = pi / mu (gradient -min(r, C) A: verl's / TRL's 20, the
    paper's section 5.4: a 4.9e8 ratio otherwise reaches the gradient); null uncapped; > 0."""
    divergence: str = "tv"
    """divergence_ppo: per-token binary divergence of the sampled token, tv or kl."""
    divergence_threshold: float = 0.2
    """divergence_ppo: trust region (tokens beyond it that push further out are dropped); > 0."""
    divergence_threshold_low: float | None = None
    """divergence_ppo: trust region of A < 0 updates (pi pushed down; verl clip_ratio_low);
    null = divergence_threshold, which then bounds the A > 0 ones (clip_ratio_high); > 0."""
    anchor: str = "behaviour"
    """divergence_ppo: the policy mu that r = pi / mu is measured against: behaviour or proximal."""
    kl_coef: float = 0.0
    """KL(policy || reference) coefficient >= 0 (> 0 loads a frozen reference policy:
    model.reference_path)."""
    kl_in_reward: bool = False
    """Apply the KL as a reward penalty (kl_coef x the estimator) before the advantages, instead
    of a loss term (kl_in_reward_level, kl_in_reward_logp)."""
    kl_in_reward_level: str = "sequence"
    """kl_in_reward: the row's summed penalty on its last token (sequence) or each token's on
    that token (token: verl, AReaL, TRL PPO); only GAE and reinforce_pp see the difference
    (the group estimators use the row's sum either way)."""
    kl_in_reward_logp: str = "behaviour"
    """kl_in_reward: the policy log-probs measured against the reference: behaviour (the
    generator's) or proximal (the learner's, recomputed with the pre-update weights: verl,
    AReaL, TRL)."""
    kl_estimator: str = "k3"
    """Per-token estimator of KL(pi || pi_ref): k1, k2 or k3."""
    kl_cap: float | None = KL_CAP_DEFAULT
    """The estimator clamped to [-kl_cap, kl_cap], gradient 0 beyond (verl low_var_kl, AReaL:
    10; k3 grows as e^d when pi << pi_ref); null uncapped; > 0 (the loss term and kl_in_reward)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient >= 0 (subtracted from the loss)."""
    aggregation: str = "token_mean"
    """Loss reduction over tokens: token_mean, seq_mean, seq_mean_token_sum, or dr_grpo /
    seq_mean_token_sum_norm (both sum / (sequences x loss_scale_length))."""
    loss_scale_length: int | None = None
    """The constant L of dr_grpo / seq_mean_token_sum_norm (e.g. rollout.max_tokens; TRL
    max_completion_length, verl loss_scale_factor); required by them, >= 1."""
    ratio_level: str = "token"
    """ppo / grpo / dppo ratio: per token, or sequence (GSPO: exp of the row's mean log-ratio)."""
    normalize_std: bool = True
    """Group advantages: divide by the group's std (GRPO) or not (Dr. GRPO)."""
    advantage_estimator: str = "grpo"
    """Without a critic: grpo (group mean / std), rloo, reinforce_pp, reinforce_pp_baseline
    (learner.batching.step_advantages)."""
    singleton_advantage: str = "zero"
    """A group of one sample: zero (no signal) or reward (verl: r, as if mean 0 and std 1; rloo: r)."""
    whiten_std: str = "population"
    """objective.whiten's std: population (AReaL) or bessel (verl masked_whiten)."""
    bootstrap_truncated: bool = False
    """GAE of a row cut at rollout.max_tokens: bootstrap gamma x V (AReaL) instead of 0."""
    gamma: float = 1.0
    """GAE discount in [0, 1] (objectives with a critic)."""
    lam: float = 1.0
    """GAE lambda in [0, 1] (objectives with a critic)."""
    value_clip: float | None = 0.2
    """Critic: max |v - old_v| the clipped term allows (> 0); null for plain 0.5 (v - R)^2."""
    value_coef: float = 0.5
    """Weight of the critic loss (> 0); with a separate critic network and Adam it only matters
    through Adam's epsilon."""
    loop_weighting: str = "last"
    """Per-loop credit (docs/OBJECTIVES.md "Per-loop credit"): last (the exit loop only), or the
    objective's per-token term at every loop 1..e_t summed with weights uniform, progressive
    (k^progressive_alpha), exit_pdf (Ouro's exit distribution over 1..e_t) or learned (a
    softmax over per-loop logits trained by RLTT's policy-gradient term, docs/OBJECTIVES.md)."""
    exit_pdf_gradient: bool = False
    """loop_weighting exit_pdf: the weights carry the exit gate's gradient (RLTT's exit_pdf: the
    gate's logits get the policy-gradient term that trains learned's, docs/OBJECTIVES.md); false:
    the weights are a fixed credit assignment, no gradient through them."""
    progressive_alpha: float = 1.0
    """loop_weighting progressive: w_k proportional to k^alpha (RLTT's option B), >= 0."""
    loop_weight_lr: float = 0.01
    """loop_weighting learned: the Adam learning rate of the per-loop weight logits (their own
    optimizer: constant, no weight decay, no clipping; they start at 0, i.e. uniform), > 0."""
    exit_coef: float = 0.0
    """A sampled exit (rollout.exit_policy kind sampled_gate): weight of the exit term, the
    clipped surrogate of the exit loop's ratio with the token's advantage
    (learner.objectives.exit_term; docs/OBJECTIVES.md "The exit as an action"); 0: off."""
    exit_entropy_coef: float = 0.0
    """A sampled exit: weight of the exit decisions' entropy bonus (against a collapsed gate);
    0: off."""

    def advantage_options(self) -> dict[str, Any]:
        """The keywords of `learner.batching.step_advantages` this objective sets."""
        return {"gamma": self.gamma, "lam": self.lam, "normalize_std": self.normalize_std,
                "estimator": self.advantage_estimator, "singleton": self.singleton_advantage,
                "whiten": self.whiten, "whiten_std": self.whiten_std,
                "bootstrap_truncated": self.bootstrap_truncated,
                "depth_cost": self.depth_cost if self.depth_cost_in == "advantage" else 0.0}  # fmt: skip

    @property
    def uses_critic(self) -> bool:
        """A critic is trained (ppo, or ``critic`` true)."""
        return self.kind == "ppo" if self.critic is None else bool(self.critic)

    def __post_init__(self) -> None:
        need = checker(self, "objective")

        need(self.kind in KINDS, "kind", f"must be one of {KINDS}")
        need(self.epochs >= 1, "epochs", "must be >= 1")
        need(self.minibatches >= 1, "minibatches", "must be >= 1")
        need(self.critic is not False or self.kind != "ppo", "critic",
             "ppo needs its critic (GAE values)")  # fmt: skip
        need(not (self.critic and self.kind == "grpo"), "critic",
             "grpo uses group advantages, not a critic")  # fmt: skip
        need(self.overlong_buffer >= 0, "overlong_buffer", "must be >= 0")
        need(self.overlong_penalty >= 0, "overlong_penalty", "must be >= 0")
        need(math.isfinite(self.depth_cost) and self.depth_cost >= 0, "depth_cost",
             "must be a finite number >= 0")  # fmt: skip
        need(self.depth_cost_in in DEPTH_COST_IN, "depth_cost_in",
             f"must be one of {DEPTH_COST_IN}")  # fmt: skip
        need(self.depth_cost_in == "reward" or self.depth_cost > 0, "depth_cost_in",
             "applies with objective.depth_cost > 0 only")  # fmt: skip
        need(self.depth_cost_in == "reward" or (
            not self.uses_critic and self.advantage_estimator in GROUP_ESTIMATORS),
             "depth_cost_in", f"advantage needs a group estimator {GROUP_ESTIMATORS} without a "
             "critic (GAE has no group to centre the cost in); use reward")  # fmt: skip
        need(0.0 <= self.eps_low < 1.0, "eps_low", "must be in [0, 1)")
        need(self.eps_high >= 0.0, "eps_high", "must be >= 0")
        need(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", "must be null or > 1")
        need(self.is_cap is None or self.is_cap > 0.0, "is_cap", "must be null or > 0")
        need(self.is_mode in IS_MODES, "is_mode", f"must be one of {IS_MODES}")
        need(self.is_level in IS_LEVELS, "is_level", f"must be one of {IS_LEVELS}")
        weighted = self.is_cap is not None or self.kind == "dppo"
        for name, default in (("is_level", "token"), ("is_veto", None),
                              ("is_rejected_in_denominator", True)):  # fmt: skip
            need(getattr(self, name) == default or weighted, name,
                 "applies to the behaviour weight: set objective.is_cap (or kind dppo)")  # fmt: skip
        need(self.is_cap_low is None or (self.is_cap is not None
                                         and 0.0 < self.is_cap_low < self.is_cap),
             "is_cap_low", "must be null or in (0, objective.is_cap), with is_cap set")  # fmt: skip
        need(self.is_veto is None or 0.0 < self.is_veto < 1.0, "is_veto", "must be null or in (0, 1)")  # fmt: skip
        need(self.is_rejected_in_denominator or self.kind != "flow_dppo",
             "is_rejected_in_denominator", "false is not available for flow_dppo (its proximal "
             "log-probs come with the training forward, after the denominator is fixed)")  # fmt: skip
        need(self.max_token_version_gap is None or self.max_token_version_gap >= 0,
             "max_token_version_gap", "must be null or >= 0")  # fmt: skip
        need(self.kl_threshold > 0.0, "kl_threshold", "must be > 0")
        need(self.divergence in DIVERGENCES, "divergence", f"must be one of {DIVERGENCES}")
        need(self.divergence_threshold > 0.0, "divergence_threshold", "must be > 0")
        need(self.anchor in ANCHORS, "anchor", f"must be one of {ANCHORS}")
        need(self.divergence_is_cap is None or self.divergence_is_cap > 0.0, "divergence_is_cap",
             "must be null or > 0")  # fmt: skip
        need(self.divergence_threshold_low is None or self.divergence_threshold_low > 0.0,
             "divergence_threshold_low", "must be null or > 0")  # fmt: skip
        need(self.kl_cap is None or self.kl_cap > 0.0, "kl_cap", "must be null or > 0")
        need(self.kl_in_reward_level in KL_REWARD_LEVELS, "kl_in_reward_level",
             f"must be one of {KL_REWARD_LEVELS}")  # fmt: skip
        need(self.kl_in_reward_logp in KL_REWARD_LOGPS, "kl_in_reward_logp",
             f"must be one of {KL_REWARD_LOGPS}")  # fmt: skip
        for name, default in (("kl_in_reward_level", "sequence"),
                              ("kl_in_reward_logp", "behaviour")):  # fmt: skip
            need(getattr(self, name) == default or self.kl_in_reward, name,
                 "applies with objective.kl_in_reward=true only")  # fmt: skip
        need(self.ratio_level in RATIO_LEVELS, "ratio_level", f"must be one of {RATIO_LEVELS}")
        need(self.ratio_level == "token" or self.kind in ("ppo", "grpo", "dppo"), "ratio_level",
             f"sequence applies to ppo, grpo and dppo, not {self.kind}")  # fmt: skip
        need(self.loss_scale_length is None or self.loss_scale_length >= 1, "loss_scale_length",
             "must be null or >= 1")  # fmt: skip
        need(self.aggregation not in LENGTH_NORMED or self.loss_scale_length is not None,
             "loss_scale_length", f"required by aggregation {self.aggregation} (e.g. "
             "rollout.max_tokens)")  # fmt: skip
        for name, allowed in (("advantage_estimator", ADVANTAGE_ESTIMATORS),
                              ("singleton_advantage", SINGLETONS), ("whiten_std", WHITEN_STDS)):  # fmt: skip
            need(getattr(self, name) in allowed, name, f"must be one of {allowed}")
        need(self.kl_coef >= 0.0, "kl_coef", "must be >= 0")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"must be one of {KL_ESTIMATORS}")
        need(self.entropy_coef >= 0.0, "entropy_coef", "must be >= 0")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"must be one of {AGGREGATIONS}")
        need(0.0 <= self.gamma <= 1.0, "gamma", "must be in [0, 1]")
        need(0.0 <= self.lam <= 1.0, "lam", "must be in [0, 1]")
        need(self.value_clip is None or self.value_clip > 0.0, "value_clip", "must be null or > 0")
        need(self.value_coef > 0, "value_coef", "must be > 0")
        need(self.loop_weighting in LOOP_WEIGHTINGS, "loop_weighting",
             f"must be one of {LOOP_WEIGHTINGS}")  # fmt: skip
        need(math.isfinite(self.loop_weight_lr) and self.loop_weight_lr > 0, "loop_weight_lr",
             "must be a finite number > 0")  # fmt: skip
        need(self.loop_weight_lr == 0.01 or self.loop_weighting == "learned", "loop_weight_lr",
             "applies with objective.loop_weighting=learned only")  # fmt: skip
        need(not self.exit_pdf_gradient or self.loop_weighting == "exit_pdf", "exit_pdf_gradient",
             "applies with objective.loop_weighting=exit_pdf only")  # fmt: skip
        need(self.progressive_alpha >= 0.0, "progressive_alpha", "must be >= 0")
        need(self.progressive_alpha == 1.0 or self.loop_weighting == "progressive",
             "progressive_alpha", "applies with objective.loop_weighting=progressive only")  # fmt: skip
        for name in ("exit_coef", "exit_entropy_coef"):
            v = getattr(self, name)
            need(math.isfinite(v) and v >= 0, name, "must be a finite number >= 0")
            need(v == 0 or self.kind in ("ppo", "grpo", "dppo"), name,
                 f"applies to kinds ppo, grpo and dppo (the clipped surrogate) so far, not "
                 f"{self.kind}: its surrogate is not defined for the exit yet")  # fmt: skip
        looped = self.loop_weighting != "last"
        need(not looped or self.kind != "flow_dppo", "loop_weighting",
             f"{self.loop_weighting} with kind flow_dppo is refused: its full-vocabulary "
             "KL(old || new) per loop would need every loop's proximal logits")  # fmt: skip
        need(not looped or self.ratio_level == "token", "loop_weighting",
             f"{self.loop_weighting} with ratio_level sequence (GSPO) is refused: a row's "
             "sequence ratio over per-loop log-ratios is not defined yet")  # fmt: skip
        need(not looped or self.kind != "divergence_ppo" or self.anchor == "proximal",
             "loop_weighting", f"{self.loop_weighting} with divergence_ppo needs anchor proximal "
             "(the behaviour log-prob exists at the exit loop only)")  # fmt: skip
