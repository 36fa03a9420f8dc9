"""Verified rollouts (issue 24 item 4): each trained rollout's claimed behaviour log-probs are
compared with the learner's (the trainer's per-rollout ``last_mismatch``) under the bound of
the run's numerics and the rollout's staleness (pipeline.core.validation.check_logp); a lie is
quarantined and counted, a generator over its budget is banned, and the ban voids its accepted
but untrained rollouts, whose samples are generated again by the others and trained.

Fake trainer and generators on the in-memory transport: the trainer's "learner log-prob" of
every token is -1.0, so a rollout's mismatch is max |claim + 1| (computed from the claim)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.validation import (
    LOGP_BOUND_FAST,
    LOGP_BOUND_LOW_PRECISION,
    LOGP_DRIFT_PER_VERSION,
    logp_bound,
)
from proto import Rollout, WorkItem
from tests.pipeline.fakes import FakeGenerator, FakeTrainer, drive, make_coordinator


class ScoringTrainer(FakeTrainer):
    """last_mismatch = max |claimed log-prob - (-1.0)| per rollout; records who was trained."""

    def __init__(self) -> None:
        super().__init__()
        self.last_mismatch: list[float] = []
        self.trained: list[list[tuple[str, str]]] = []  # per step: (rollout id, generator)

    def step(self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool]
             ) -> Mapping[str, float]:  # fmt: skip
        out = super().step(rollouts, needs_correction)
        self.last_mismatch = [float(np.abs(r.logprobs.astype(np.float64) + 1.0).max())
                              for r in rollouts]  # fmt: skip
        self.trained.append([(r.rollout_id, r.generator_id) for r in rollouts])
        return out


class Claiming(FakeGenerator):
    """A generator that claims ``logp`` for every token (the truth is -1.0)."""

    def __init__(self, *args: object, logp: float, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.logp = logp

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        return dataclasses.replace(r, logprobs=np.full(len(r.tokens), self.logp, np.float32))


def _quarantined(run_dir: Path) -> list[dict]:
    p = run_dir / "quarantine.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def test_a_generator_claiming_false_logprobs_is_banned_and_its_rollouts_voided(
    tmp_path: Path,
) -> None:
    t = ScoringTrainer()
    # six open groups, two a step: the liar answers four at once, two wait in the buffer
    c, net, _ = make_coordinator(tmp_path, ["intake.max_refused=3", "staleness.max_staleness=2"],
                                 trainer=t)  # fmt: skip
    honest = FakeGenerator(net, "g0", delay=2)  # slower: the liar's groups pile up buffered
    liar = Claiming(net, "liar", seed=1, logp=-40.0, max_inflight=4)
    drive(c, [honest, liar], 10)
    c.close()
    assert "liar" in c.banned and "logp_mismatch" in c.banned["liar"], c.banned
    q = [e for e in _quarantined(tmp_path) if e["reason"] == "logp_mismatch"]
    assert q and {e["generator"] for e in q} == {"liar"} and {e["source"] for e in q} == {"train"}
    assert len(q) == c.intake.counts["refused_logp_mismatch"] >= 3
    ban_step = next(i for i, s in enumerate(t.trained) if any(g == "liar" for _, g in s)
                    and sum(g == "liar" for st in t.trained[: i + 1] for _, g in st) >= 3)  # fmt: skip
    after = [x for s in t.trained[ban_step + 1 :] for x in s]
    assert after and not [x for x in after if x[1] == "liar"], "the liar trained after its ban"
    # its accepted, untrained rollouts were voided and generated again by g0, then trained
    voided = [json.loads(x) for x in (tmp_path / "voided.jsonl").read_text().splitlines()]
    voided_ids = {v["rollout_id"] for v in voided if v["reason"] == "banned"}
    assert len(voided_ids) == c.intake.counts["voided_banned"] > 0
    trained_later = {rid: g for rid, g in after}
    assert all(trained_later.get(rid) == "g0" for rid in voided_ids), (voided_ids, trained_later)
    ids = [rid for s in t.trained for rid, _ in s]
    assert len(ids) == len(set(ids)), "a sample was trained twice"


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_the_bound_follows_the_numerics_mode(tmp_path: Path, numerics: str) -> None:
    """A claim 1e-6 nats off every token: proof of a lie when generator and learner agree bit
    for bit (exact), numerics noise within the measured fast bound (1e-3) otherwise."""
    t = ScoringTrainer()
    c, net, _ = make_coordinator(tmp_path, [f"numerics={numerics}", "intake.max_refused=3",
                                            "staleness.max_staleness=0"], trainer=t)  # fmt: skip
    g0 = FakeGenerator(net, "g0")
    off = Claiming(net, "off", seed=1, logp=-1.000001)
    drive(c, [g0, off], 6)
    c.close()
    refused = c.intake.counts["refused_logp_mismatch"]
    if numerics == "exact":
        assert "off" in c.banned and refused >= 3 and "g0" not in c.banned
    else:
        assert not c.banned and refused == 0


class Boaster(FakeGenerator):
    """Claims a perfect score for every eval completion it sends."""

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        return dataclasses.replace(r, reward=1.0, reward_info={"correct": True})


def test_eval_rewards_are_scored_again_on_the_learner(tmp_path: Path) -> None:
    """eval/accuracy is the learner's score of the completions (the run's reward on their
    tokens), not the generator's claim: a generator claiming every answer correct gets the
    accuracy its tokens earn (0: it answers [5, 6] to count-on prompts)."""
    from generator.rewards import synthetic_task_prompts
    from pipeline.core.dispatch import Prompt
    from pipeline.core.eval_rounds import EvalRounds, reward_rescorer

    results: list[tuple[int, dict]] = []
    prompts = [Prompt(f"q{i}", toks, task)
               for i, (toks, task) in enumerate(synthetic_task_prompts(4, seed=0))]  # fmt: skip
    rounds = EvalRounds(prompts, n=2, temperature=0.0, max_tokens=8, stop_token_ids=[],
                        run_seed=0, every=2, last_step=2,
                        on_result=lambda s, m: results.append((s, m)),
                        rescore=reward_rescorer("synthetic", tmp_path))  # fmt: skip
    c, net, _ = make_coordinator(tmp_path, [], evals=rounds)
    rounds.start(0, 0)
    gens = [Boaster(net, "boaster", seed=1)]
    drive(c, gens, 2)
    for _ in range(200):
        if not rounds.pending():
            break
        c.turn(0.0)
        for g in gens:
            g.step()
    c.close()
    assert [s for s, _ in results] == [0, 2]
    for _, m in results:
        assert m["eval/accuracy"] == 0.0 and m["eval/mean@n"] == 0.0 and m["eval/reward_mean"] < 1
    assert rounds.counts["rescored_differ"] == rounds.lied["boaster"] == 2 * 4 * 2


@pytest.mark.parametrize(
    ("overrides", "base"),
    [([], LOGP_BOUND_FAST), (["numerics=exact"], 0.0),
     (["learner.precision=bf16"], LOGP_BOUND_LOW_PRECISION),
     (["generators.dtype=bfloat16"], LOGP_BOUND_LOW_PRECISION)],
)  # fmt: skip
def test_the_bound_is_loose_where_either_side_may_run_bf16(
    tmp_path: Path, overrides: list[str], base: float
) -> None:
    """An honest bf16 generator (or learner) must not be taken for a liar: the tight fast bound
    holds only when both compute in float32 (the fake checkpoint is float32)."""
    c, _, _ = make_coordinator(tmp_path, overrides)
    assert c._logp_base == base
    assert logp_bound(base, 2) == base + 2 * LOGP_DRIFT_PER_VERSION
    c.close()
