"""The learner's door: every rule a decoded rollout must pass before it is acked or recorded.

A rollout that decodes (proto/ checked types, shapes and per-record consistency) can still be
wrong: it may not answer what was dispatched, name ids outside the vocabulary, run deeper
than the model, carry a non-finite reward. ``check_rollout`` is the one place these rules
live; the coordinator's intake (live rollouts) and the resume path (rollouts read back from
a recorded stream) both call it. Order of calls::

    limits = ModelLimits.from_checkpoint(model_dir, policy)  # once per run
    r, fixed = sanitize_reward(r, rules)                     # NaN/inf reward -> failed (None)
    refusal = check_rollout(r, expect=Expected(...), limits=limits, rules=rules)
    if refusal: Nack(refusal.reason) + quarantine, else: ledger / record / Ack

Rules (``Refusal.reason`` in brackets, the names counted per generator and reported):

- [prompt_mismatch] prompt tokens and prompt id equal those dispatched for the work id;
- [seed_mismatch]   latent seed equal to the seed dispatched for (work id, sample index);
- [wrong_generator] the rollout's generator_id equals the peer that sent it, and that peer
  is the one the sample was dispatched to (the transport's peer id is authoritative);
- [token_out_of_vocab] every response token id in [0, vocab_size);
- [too_long]        response length <= the WorkItem's max_tokens;
- [exit_depth]      contract 2 (models.depths.full_depth): the full depth run by the
  prompt's positions (`full_depth`; 0 = a stream recorded before that field, whose
  exit_depths[0] is it) in 1..max_depth (the run's exit policy's max depth, which may exceed
  the model's trained depth; the model's when the run sets no policy) and every depth, token
  0's included, in 1..full depth;
- [logprob]         log-probs finite and <= 0;
- [exit_logprob]    a sampled exit's log-probs (``Rollout.exit_logprobs``, protocol 1.7) on
  every rollout of a run whose exit policy samples exits (``rules.sampled_exit``: kind
  sampled_gate) and on no other; finite and <= 0 (their claim is checked with the token's
  under logp_mismatch: the learner recomputes them from the recorded depths);
- [reward_bound]    a finite reward with |reward| <= rules.reward_bound;
- [weight_version]  weight_version (and every token version) in [the lowest
  min_weight_version the sample was issued to its sender with, the newest version the sender
  acknowledged serving (never above the learner's current version)].

Conversations (``Rollout.token_mask``, protocol 1.6; ``rules.environment`` = the run sets
task.environment):

- [token_mask]      a mask only on a run with an environment; one entry per token; values in
  {0, 1}; the first token a model token (the model answers the prompt first);
- [env_token]       an environment token (mask 0) has log-prob exactly 0.0 and runs the full
  depth (a prompt-like position, contract 2);
- [env_budget]      environment tokens <= rules.max_env_tokens (rollout.max_env_tokens);
- [too_many_turns]  model turns (runs of mask-1 tokens) <= rules.max_turns (rollout.max_turns);
- [too_long] of a conversation counts its model tokens (all turns) against max_tokens; its
  environment tokens have their own budget above.

After training (the trainer measures each rollout's log-probs in the step that trains it):

- [logp_mismatch]   max over tokens of |learner log-prob - claimed behaviour log-prob| <=
  ``logp_bound(base, staleness)``: ``base`` is 0 in ``exact`` numerics (generator and learner
  agree bit for bit, so any difference proves a lie), ``LOGP_BOUND_FAST`` in ``fast`` when
  both sides compute in float32, ``LOGP_BOUND_LOW_PRECISION`` when either may run bf16
  (``logp_base``); plus ``LOGP_DRIFT_PER_UPDATE`` per optimizer step between the weights
  that sampled the rollout and the learner's (``publish.every`` steps a version, plus the
  steps taken since the newest version: the coordinator counts them). The trainer measures
  at its own weights, so for a stale rollout (updates > 0) the measurement holds the updates'
  drift, which LOGP_DRIFT_PER_UPDATE does not bound for every learning rate (math example,
  optimizer.lr=3e-3: one update moved an honest token from -0.014 to -10.16 nats; the fp32
  difference at the weights that sampled it was 1.4e-5 at most over 3,070 tokens, max |logit|
  12.9). A stale rollout over its bound is therefore judged at the weights that sampled it
  (pipeline.backends.audit, pipeline.core.verification.LogpVerifier.judge): within ``base`` there,
  honest drift (voided, dispatched again, not counted); weights gone, unverifiable (the same);
  beyond ``base``, a lie. A fresh rollout is measured at those weights already.

A NaN or infinite reward is not a refusal: it is a failed reward (reward None, the error in
``reward_info``), which intake handles as every failed reward (the worst of its group).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.checkpoint import load_config
from models.depths import full_depth
from models.exits import is_sampled, resolve_max_depth
from proto.records import Rollout

REASONS = (
    "prompt_mismatch",
    "seed_mismatch",
    "wrong_generator",
    "token_out_of_vocab",
    "too_long",
    "exit_depth",
    "logprob",
    "reward_bound",
    "weight_version",
    "logp_mismatch",
    "token_mask",
    "env_token",
    "env_budget",
    "too_many_turns",
    "exit_logprob",
)
# The behaviour log-prob check (rule logp_mismatch), nats per token (max over the rollout).
# fast numerics, staleness 0: measured max 9.5e-7 (tiny Huginn, fp32 on CPU, vLLM vs megatron,
# tests/pipeline/test_resume_kill.py); the bound leaves three decades for other kernels.
# The fp32 error grows with the logits' magnitude: the reference forward's fast vs exact log-probs
# on the math example's v21 (lr 3e-3) with the logits scaled k-fold: max 1.7e-6 / 6.7e-6 /
# 2.3e-5 / 2.4e-4 at max |logit| 13 / 52 / 206 / 825 (~3e-7 a unit of |logit|); 1e-3 holds to
# |logit| ~1,500 with two such sides. The run's own logits stayed below 13.
LOGP_BOUND_FAST = 1e-3
# fast numerics with bf16 on either side (learner.precision bf16, or generators that may run
# the checkpoint's bf16 dtype on a GPU): not measured here; loose, so that honest low-precision
# sampling is never taken for a lie, while a claim of -40 per token still is.
LOGP_BOUND_LOW_PRECISION = 5.0
# per update (optimizer step) between sampling and the check: one update moved a sampled token's log-prob by up to 0.94 nats in
# the crash test and up to 2.05 in the 30-step quickstart (docs/OBJECTIVES.md); 10 leaves 5x.
# A claim of -40 per token is ~35 nats away; a claim of -0.01 is caught on fresh rollouts.
# Not a bound on honest drift: the math example at optimizer.lr=3e-3 moved a token 10.1 nats in
# one update (9.78 at step 6, 10.1 at step 22). A stale rollout over it is audited at the
# weights that sampled it (module docstring), so it only decides which rollouts are audited.
LOGP_DRIFT_PER_UPDATE = 10.0


def logp_base(numerics: str, *, float32: bool) -> float:
    """The bound at staleness 0: 0 in exact numerics; in fast, LOGP_BOUND_FAST when learner
    and generators both compute in float32 (``float32``), else LOGP_BOUND_LOW_PRECISION."""
    if numerics == "exact":
        return 0.0
    return LOGP_BOUND_FAST if float32 else LOGP_BOUND_LOW_PRECISION


def logp_bound(base: float, updates: int) -> float:
    """The largest honest |learner - behaviour| log-prob of one token (rule logp_mismatch),
    ``updates`` optimizer steps after the weights that sampled it."""
    return base + max(updates, 0) * LOGP_DRIFT_PER_UPDATE


def check_logp(mismatch: float, bound: float) -> Refusal | None:
    """Rule logp_mismatch for one trained rollout: ``mismatch`` (the trainer's max |learner -
    behaviour| over its tokens; negative or NaN: not measured, not judged) over ``bound``
    (``logp_bound``)."""
    if not mismatch >= 0.0 or mismatch <= bound:
        return None
    return Refusal("logp_mismatch", f"claimed log-probs {mismatch:.3g} nats from the learner's "
                   f"(bound {bound:.3g})")  # fmt: skip


@dataclass(frozen=True)
class ModelLimits:
    """What the learner replays: token ids below ``vocab_size``, exit depths up to
    ``max_depth`` core iterations (the run's exit policy's max depth)."""

    vocab_size: int
    max_depth: int
    weights_dtype: str = "float32"  # the checkpoint's torch_dtype (what vLLM's auto serves on GPU)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, policy: Any = None) -> ModelLimits:
        """Limits of the checkpoint at ``model_dir`` under the run's exit policy (a
        models.exits policy, e.g. ``RunConfig.rollout.parsed_policy``; None: full depth, the
        model's own)."""

        cfg = load_config(model_dir)
        depth = int(cfg.max_depth) if policy is None else resolve_max_depth(policy, cfg.max_depth)
        try:
            raw = json.loads((Path(model_dir) / "config.json").read_text())
            dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        except (OSError, ValueError):
            dtype = "float32"
        return cls(vocab_size=int(cfg.vocab_size), max_depth=depth, weights_dtype=dtype)


@dataclass(frozen=True)
class DoorRules:
    """The configurable part of the rules (run config section ``door``)."""

    reward_bound: float = 1e6
    max_tokens: int = 1 << 30
    environment: bool = False
    """The run sets task.environment: rollouts may carry a token_mask (a conversation)."""
    max_turns: int = 1
    """rollout.max_turns: most model turns in a conversation."""
    max_env_tokens: int = 0
    """rollout.max_env_tokens: most environment tokens in a conversation."""
    sampled_exit: bool = False
    """The run's exit policy samples exits (SampledGate): rollouts carry exit_logprobs."""


def door_rules(cfg: Any) -> DoorRules:
    """The door's rules of a run config (pipeline.config.run.RunConfig)."""
    return DoorRules(
        reward_bound=cfg.intake.reward_bound,
        environment=bool(cfg.task.environment),
        max_turns=cfg.rollout.max_turns,
        max_env_tokens=cfg.rollout.max_env_tokens,
        sampled_exit=is_sampled(cfg.rollout.parsed_policy),
    )


@dataclass(frozen=True)
class Expected:
    """What was dispatched for this sample; None fields are not checked (e.g. the sender of
    a rollout read back from a stream is unknown)."""

    prompt_id: str
    prompt_tokens: list[int]
    latent_seed: int
    max_tokens: int
    min_version: int
    max_version: int
    sender: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class Refusal:
    """Why a rollout was refused: ``reason`` (one of REASONS) and a human ``detail``."""

    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def sanitize_reward(r: Rollout) -> tuple[Rollout, bool]:
    """A NaN/inf reward becomes a failed reward (None, reason in reward_info); True if so."""
    if r.reward is None or math.isfinite(r.reward):
        return r, False
    info = dict(r.reward_info)
    info["error"] = f"non-finite reward {r.reward!r} from generator {r.generator_id!r}"
    return dataclasses.replace(r, reward=None, reward_info=info), True


def check_rollout(
    r: Rollout, *, expect: Expected, limits: ModelLimits, rules: DoorRules
) -> Refusal | None:
    """The first rule ``r`` breaks, or None (see the module docstring)."""
    if r.prompt_id != expect.prompt_id or not np.array_equal(
        r.prompt_tokens, np.asarray(expect.prompt_tokens, dtype=r.prompt_tokens.dtype)
    ):
        return Refusal(
            "prompt_mismatch",
            f"prompt {r.prompt_id!r} ({r.prompt_tokens.size} tokens) is not the prompt "
            f"{expect.prompt_id!r} ({len(expect.prompt_tokens)} tokens) dispatched as {r.work_id}",
        )
    if int(r.latent_seed) != int(expect.latent_seed):
        return Refusal(
            "seed_mismatch",
            f"latent seed {int(r.latent_seed)} is not the seed {int(expect.latent_seed)} "
            f"dispatched for {r.rollout_id}",
        )
    if expect.sender is not None and r.generator_id != expect.sender:
        return Refusal(
            "wrong_generator",
            f"rollout claims generator {r.generator_id!r} but came from {expect.sender!r}",
        )
    if expect.owner is not None and expect.sender is not None and expect.owner != expect.sender:
        return Refusal(
            "wrong_generator",
            f"{r.rollout_id} was dispatched to {expect.owner!r}, not to {expect.sender!r}",
        )
    t = r.tokens
    if t.size and (int(t.min()) < 0 or int(t.max()) >= limits.vocab_size):
        bad = int(t.max()) if int(t.max()) >= limits.vocab_size else int(t.min())
        return Refusal(
            "token_out_of_vocab", f"token id {bad} outside the vocabulary [0, {limits.vocab_size})"
        )
    mask = r.token_mask
    if mask is not None:
        bad_mask = check_token_mask(r, rules)
        if bad_mask is not None:
            return bad_mask
    model_tokens = r.num_tokens if mask is None else int(np.count_nonzero(mask))
    limit = min(expect.max_tokens, rules.max_tokens)
    if model_tokens > limit:
        what = "response" if mask is None else "model"
        return Refusal("too_long", f"{model_tokens} {what} tokens > max_tokens {limit}")
    if r.exit_depths.size:
        try:
            depth = full_depth(r.exit_depths, limits.max_depth, r.full_depth)
        except ValueError as e:
            return Refusal("exit_depth", str(e))
        if mask is not None:
            env = mask == 0
            if env.any() and not bool((r.logprobs[env] == 0.0).all()):
                at = int(np.flatnonzero(env & (r.logprobs != 0.0))[0])
                return Refusal("env_token", f"environment token {at} has log-prob "
                               f"{float(r.logprobs[at])!r}, expected exactly 0.0")  # fmt: skip
            if env.any() and not bool((r.exit_depths[env] == depth).all()):
                at = int(np.flatnonzero(env & (r.exit_depths != depth))[0])
                return Refusal("env_token", f"environment token {at} ran {int(r.exit_depths[at])} "
                               f"iterations, expected the full depth {depth}")  # fmt: skip
    lp = r.logprobs
    if lp.size and not (bool(np.isfinite(lp).all()) and float(lp.max()) <= 0.0):
        return Refusal("logprob", "log-probs must be finite and <= 0")
    elp = r.exit_logprobs
    if (elp is not None) != rules.sampled_exit:
        return Refusal("exit_logprob", "no exit log-probs on a run whose exit policy samples "
                       "exits (sampled_gate)" if rules.sampled_exit else "exit log-probs on a "
                       "run whose exit policy does not sample exits")  # fmt: skip
    if elp is not None and elp.size and not (bool(np.isfinite(elp).all())
                                             and float(elp.max()) <= 0.0):  # fmt: skip
        return Refusal("exit_logprob", "exit log-probs must be finite and <= 0")
    if r.reward is not None and not abs(r.reward) <= rules.reward_bound:
        return Refusal("reward_bound", f"reward {r.reward!r} outside +-{rules.reward_bound:g}")
    versions = [int(r.weight_version)]
    if r.token_versions is not None and r.token_versions.size:
        versions += [int(r.token_versions.min()), int(r.token_versions.max())]
    lo_v, hi_v = min(versions), max(versions)
    if lo_v < expect.min_version or hi_v > expect.max_version:
        return Refusal(
            "weight_version",
            f"weight versions {lo_v}..{hi_v} outside [{expect.min_version}, "
            f"{expect.max_version}] (the work item's min_weight_version .. the newest version "
            f"the sender acknowledged serving, at most the learner's)",
        )
    return None


def model_turns(mask: np.ndarray) -> int:
    """Model turns of a conversation: the runs of mask-1 tokens."""
    m = np.asarray(mask) == 1
    return int(m[0]) + int(np.count_nonzero(m[1:] & ~m[:-1])) if m.size else 0


def check_token_mask(r: Rollout, rules: DoorRules) -> Refusal | None:
    """The conversation rules of the module docstring that need no model (token_mask,
    env_budget, too_many_turns); None when ``r`` carries no mask or passes them."""
    mask = r.token_mask
    if mask is None:
        return None
    if not rules.environment:
        return Refusal("token_mask", "a token_mask (multi-turn conversation) on a run without "
                       "task.environment; expected none")  # fmt: skip
    if mask.shape != r.tokens.shape:
        return Refusal("token_mask", f"token_mask has {mask.size} entries for "
                       f"{r.num_tokens} tokens; expected one per token")  # fmt: skip
    if mask.size and int(mask.max()) > 1:
        return Refusal("token_mask", f"token_mask value {int(mask.max())}; expected 0 "
                       "(environment) or 1 (model)")  # fmt: skip
    if mask.size and int(mask[0]) != 1:
        return Refusal("token_mask", "the first token is an environment token; expected the "
                       "model's (it answers the prompt first)")  # fmt: skip
    env = int(mask.size - np.count_nonzero(mask))
    if env > rules.max_env_tokens:
        return Refusal("env_budget", f"{env} environment tokens > rollout.max_env_tokens "
                       f"{rules.max_env_tokens}")  # fmt: skip
    turns = model_turns(mask)
    if turns > rules.max_turns:
        return Refusal("too_many_turns", f"{turns} model turns > rollout.max_turns "
                       f"{rules.max_turns}")  # fmt: skip
    return None
