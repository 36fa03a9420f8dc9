"""The learner's door (pipeline.core.validation + intake): a rollout that decodes but is wrong is
refused (Nack with the reason, quarantined, re-dispatched, never trained); NaN/inf rewards
are failed rewards; a generator that keeps sending bad rollouts is dropped for the run; a
non-finite step is skipped and non-finite weights are never published; a resume over a
stream holding an invalid rollout quarantines it and continues; rollouts restored after a
resume are trained, not dropped as stale because the version numbers jumped."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint
from pipeline.core import resume
from pipeline.core.coordinator_errors import CoordinatorError
from pipeline.core.quarantine import read_quarantine
from pipeline.core.recorder import read_rollouts, read_steps
from pipeline.core.validation import (
    DoorRules,
    Expected,
    ModelLimits,
    check_rollout,
    sanitize_reward,
)
from proto.records import ErrorMsg, Nack, Rollout, WorkItem
from tests.pipeline.fakes import (
    POISONS,
    FakeGenerator,
    FakeTrainer,
    drive,
    drive_with_a_hole,
    make_coordinator,
    poison,
    reference_trainer_and_pair,
)

LIMITS = ModelLimits(vocab_size=256, max_depth=8)
RULES = DoorRules(reward_bound=10.0)


def good() -> tuple[Rollout, Expected]:
    r = Rollout(
        rollout_id="w0/1", work_id="w0", prompt_id="p0", sample_index=1, generator_id="g0",
        latent_seed=77, prompt_tokens=np.array([1, 2, 3], np.int32),
        tokens=np.array([5, 6, 7], np.int32), logprobs=np.array([-1, -2, -0.5], np.float32),
        exit_depths=np.array([8, 3, 5], np.uint8), weight_version=3, reward=1.0,
    )  # fmt: skip
    exp = Expected(prompt_id="p0", prompt_tokens=[1, 2, 3], latent_seed=77, max_tokens=4,
                   min_version=2, max_version=4, sender="g0")  # fmt: skip
    return r, exp


BAD: dict[str, dict[str, Any]] = {
    "prompt_mismatch": {"prompt_tokens": np.array([1, 2, 4], np.int32)},
    "seed_mismatch": {"latent_seed": 78},
    "wrong_generator": {"generator_id": "g1"},
    "token_out_of_vocab": {"tokens": np.array([5, 99999, 7], np.int32)},
    "too_long": {
        "tokens": np.arange(5, dtype=np.int32),
        "logprobs": -np.ones(5, np.float32),
        "exit_depths": np.full(5, 8, np.uint8),
    },  # fmt: skip
    "exit_depth": {"exit_depths": np.array([200, 3, 5], np.uint8)},
    "logprob": {"logprobs": np.array([-1, -np.inf, -0.5], np.float32)},
    "reward_bound": {"reward": 11.0},
    "weight_version": {"weight_version": 5},
}


def test_a_good_rollout_passes() -> None:
    r, exp = good()
    assert check_rollout(r, expect=exp, limits=LIMITS, rules=RULES) is None


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_rule_refuses_with_its_reason(reason: str) -> None:
    r, exp = good()
    bad = dataclasses.replace(r, **BAD[reason])
    why = check_rollout(bad, expect=exp, limits=LIMITS, rules=RULES)
    assert why is not None and why.reason == reason, why


def test_more_rules() -> None:
    r, exp = good()
    for kw in ({"exit_depths": np.array([3, 4, 5], np.uint8)},  # [0] is not the full depth
               {"exit_depths": np.array([9, 9, 9], np.uint8)}):  # deeper than the model  # fmt: skip
        why = check_rollout(dataclasses.replace(r, **kw), expect=exp, limits=LIMITS, rules=RULES)
        assert why is not None and why.reason == "exit_depth"
    old = dataclasses.replace(r, weight_version=1)  # below min_weight_version
    assert check_rollout(old, expect=exp, limits=LIMITS, rules=RULES).reason == "weight_version"  # type: ignore[union-attr]
    mixed = dataclasses.replace(r, token_versions=np.array([3, 4, 5], np.int64))
    assert check_rollout(mixed, expect=exp, limits=LIMITS, rules=RULES).reason == "weight_version"  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_reward_is_a_failed_reward(value: float) -> None:
    r, exp = good()
    s, failed = sanitize_reward(dataclasses.replace(r, reward=value))
    assert failed and s.reward is None and "non-finite" in str(s.reward_info["error"])
    assert check_rollout(s, expect=exp, limits=LIMITS, rules=RULES) is None


# -- through the coordinator (in-memory transport) ---------------------------------------------
POISON = list(POISONS)


class PoisonGenerator(FakeGenerator):
    """Answers every WorkItem, each item's rollouts poisoned with one kind (by work id)."""

    def __init__(self, *a: Any, kinds: list[str], **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.kinds = kinds
        self.kind_of: dict[str, str] = {}  # work id -> its poison, in order of arrival
        self.errors: list[ErrorMsg] = []
        self.nacks: list[Nack] = []
        recv = self.conn.recv

        def spy(timeout_s: float) -> Any:
            inc = recv(timeout_s)
            if inc is not None and isinstance(inc.record, ErrorMsg):
                self.errors.append(inc.record)
            if inc is not None and isinstance(inc.record, Nack):
                self.nacks.append(inc.record)
            return inc

        self.conn.recv = spy  # type: ignore[method-assign]

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        kind = self.kind_of.setdefault(
            item.work_id, self.kinds[len(self.kind_of) % len(self.kinds)]
        )
        return poison(r, kind)


def test_poisoned_rollouts_never_trained_run_finishes(tmp_path: Path) -> None:
    """Every poisoned kind next to an honest generator: refused ones are Nack'ed with the
    reason, quarantined and re-generated by the honest one; NaN/inf rewards are trained as
    failed rewards (finite numbers); every step trains complete, clean groups."""
    c, net, t = make_coordinator(tmp_path, ["intake.max_refused=0"])
    bad = PoisonGenerator(net, "bad", kinds=POISON, seed=2)  # first: it gets work first
    honest = FakeGenerator(net, "g0", seed=1)
    seen: list[dict] = []
    c.on_step = seen.append
    drive(c, [bad, honest], 12)
    c.close()
    refused = {k[len("refused_"):]: v for k, v in c.intake.counts.items()
               if k.startswith("refused_")}  # fmt: skip
    expect = {"token_out_of_vocab", "exit_depth", "too_long", "prompt_mismatch", "seed_mismatch",
              "wrong_generator", "weight_version"}  # fmt: skip
    assert expect <= set(refused), refused
    assert c.intake.counts["reward_nonfinite"] >= 1
    assert sum(refused.values()) == c.intake.counts["refused"] == len(read_quarantine(tmp_path))
    assert {q["reason"] for q in read_quarantine(tmp_path)} == set(refused)
    assert all(n.reason.startswith("refused: ") for n in bad.nacks) and bad.nacks
    # the quarantine stream holds the refused rollouts; the training stream none of them
    q_ids = {
        (r.work_id, int(r.latent_seed), r.num_tokens)
        for _, r in read_rollouts(tmp_path / "quarantine")
    }
    assert len(q_ids) >= len(expect) - 1
    recorded = [r for _, r in read_rollouts(tmp_path / "stream")]
    for r in recorded:
        assert int(r.tokens.max()) < 64 and r.num_tokens <= 8 and int(r.exit_depths.max()) <= 4
        assert r.reward is None or math.isfinite(r.reward)
    trained = [rid for s in read_steps(tmp_path / "steps.jsonl") for rid in s.rollout_ids]
    assert len(trained) == len(set(trained)) == 12 * 8
    assert all(math.isfinite(m["reward_mean"]) for m in seen)
    assert c.counts()["refused_by_generator"]["bad"] == refused
    assert "g0" not in c.counts()["refused_by_generator"]


def test_repeat_offender_dropped_for_the_run(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, ["intake.max_refused=3", "intake.window_s=1000"])
    bad = PoisonGenerator(net, "bad", kinds=["token_oov"], seed=2)
    honest = FakeGenerator(net, "g0", seed=1)
    drive(c, [honest, bad], 4)
    assert "bad" in c.banned and "3 refused rollouts" in c.banned["bad"]
    assert "bad" not in c.dispatcher.generators()
    assert any(e.code == "banned" for e in bad.errors)
    before = c.intake.counts["refused"]
    drive(c, [honest, bad], 6)  # whatever it still sends is ignored, never refused again
    assert c.intake.counts["refused"] == before == 4  # the 4 samples of the frame that tipped it
    assert c.counts()["banned"] == {"bad": c.banned["bad"]}


class NanTrainer(FakeTrainer):
    def publish(self, out_dir: Path, version: int) -> Any:
        from models.checkpoint import save_checkpoint
        from weights.publication import Publication

        save_checkpoint({"w": torch.tensor([1.0, float("nan")])}, {"architectures": ["F"]}, out_dir)
        return Publication.from_dir(out_dir, version)


def test_non_finite_weights_never_published(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, [], trainer=NanTrainer())
    with pytest.raises(CoordinatorError, match="not finite.*'w' has 1 non-finite .* of 2"):
        drive(c, [FakeGenerator(net, "g0")], 1)
    assert c.version == 0 and not (tmp_path / "weights" / "v1").exists()
    assert not (tmp_path / "weights" / "digests.jsonl").exists()


def test_reference_trainer_skips_a_non_finite_step(tmp_path: Path) -> None:
    """A NaN advantage (an inf reward fed past the door) -> no update, counted."""
    tr, rolls = reference_trainer_and_pair(tmp_path)
    rolls[0] = dataclasses.replace(rolls[0], reward=math.inf)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    m = tr.step(rolls, [False, False]).metrics
    assert m["skipped_nonfinite"] == 1.0 and m["skipped_nonfinite_total"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    rolls[0] = dataclasses.replace(rolls[0], reward=0.0)
    m = tr.step(rolls, [False, False]).metrics  # a finite step updates again
    assert m["skipped_nonfinite"] == 0.0 and m["skipped_nonfinite_total"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    tr.publish(tmp_path / "pub", 1)
    _, state = load_checkpoint(tmp_path / "pub")
    assert all(bool(torch.isfinite(v).all()) for v in state.values())


def test_resume_quarantines_an_invalid_recorded_rollout(tmp_path: Path) -> None:
    """An older learner (no door) recorded an out-of-vocabulary rollout; the resumed one
    quarantines it, dispatches its sample again and trains on: no crash loop."""
    c, net, t = make_coordinator(tmp_path, ["checkpoint.every=2"])
    c.intake.limits = ModelLimits(vocab_size=1 << 30, max_depth=255)  # the old, doorless one
    bad = PoisonGenerator(net, "bad", kinds=["token_oov"], seed=2)
    honest = FakeGenerator(net, "g0", seed=1)
    drive(c, [honest, bad], 1)
    resume.save(c, keep=0)
    saved = c.version
    for _ in range(40):  # more intake after the checkpoint, then a crash
        c.turn(0.0)
        honest.step()
        bad.step()
    c.recorder.close()
    oov = [r.rollout_id for _, r in read_rollouts(tmp_path / "stream") if int(r.tokens.max()) > 64]
    assert oov, "the doorless learner recorded no invalid rollout"
    c2, net2, t2 = make_coordinator(tmp_path, ["checkpoint.every=2"], trainer=t)
    counts = resume.restore(c2, resume.latest_checkpoint(c2))  # type: ignore[arg-type]
    assert counts["quarantined"] >= 1
    q = [x for x in read_quarantine(tmp_path) if x["source"] == "resume"]
    assert {x["reason"] for x in q} == {"token_out_of_vocab"}
    voided = [json.loads(x) for x in (tmp_path / "voided.jsonl").read_text().splitlines()]
    by_reason: dict[str, set[str]] = {}
    for v in voided:
        by_reason.setdefault(v["reason"], set()).add(v["rollout_id"])
    assert set(by_reason) <= {"token_out_of_vocab", "stale"}, by_reason.keys()
    assert by_reason["token_out_of_vocab"] == {x["rollout_id"] for x in q}
    # the others: clean rollouts of weights published after the checkpoint (void on resume)
    stale = by_reason.get("stale", set())
    assert len(stale) == counts["redispatch_stale"]
    for _, r in read_rollouts(tmp_path / "stream"):
        if r.rollout_id in stale:
            assert r.weight_version > saved and int(r.tokens.max()) <= 64, r.rollout_id
    drive(c2, [FakeGenerator(net2, "g0", seed=3)], 5)
    c2.close()
    steps = read_steps(tmp_path / "steps.jsonl")
    assert len(steps) == 5
    last: dict[str, Rollout] = {}  # what replay trains: the last copy of each id
    for _, r in read_rollouts(tmp_path / "stream"):
        last[r.rollout_id] = r
    trained = [last[rid] for s in steps for rid in s.rollout_ids]
    assert all(int(r.tokens.max()) < 64 for r in trained)
    assert {r.rollout_id for r in trained} & set(oov)  # their samples were generated again


def test_restored_rollouts_trained_after_a_version_jump(tmp_path: Path) -> None:
    """Checkpoint at step 2; the run goes on to publish v5 and accept rollouts of v3..v5;
    kill; the resumed learner publishes v6 with the weights of v2. The rollouts restored
    from the stream are within max_staleness of v2's weights: they are trained, none is
    dropped as stale (the old code measured them against v6 and dropped them all)."""
    c, net, t = make_coordinator(tmp_path, ["checkpoint.every=2", "staleness.max_staleness=2"])
    gens = [FakeGenerator(net, f"g{i}", seed=i) for i in range(2)]
    drive(c, gens, 2)
    resume.save(c, keep=0)
    drive(c, gens, 4)
    for _ in range(3):  # accepted, not yet trained (intake and dispatch only)
        c.poll(0.0)
        c.dispatcher.pump(c.version, c._send_work, c._expected_version)
        c.publisher.pump()
        for g in gens:
            g.step()
    c.recorder.close()
    assert c.version == 4
    t2 = FakeTrainer()
    c2, net2, _ = make_coordinator(tmp_path, ["checkpoint.every=2", "staleness.max_staleness=2"],
                                   trainer=t2)  # fmt: skip
    counts = resume.restore(c2, resume.latest_checkpoint(c2))  # type: ignore[arg-type]
    assert c2.version == 5 and counts["from_stream"] > 0
    restored = set(c2.intake.buffered_ids())
    assert len(restored) == counts["from_stream"] + counts["from_buffer"] == 40
    drive(c2, [FakeGenerator(net2, "g0", seed=5)], 8)
    trained = {rid for b in t2.batches for rid in b}
    assert c2.intake.counts["rollouts_dropped_stale"] == 0
    regenerated = c2.intake.counts["restored_regenerated"]
    # each restored sample was trained, or (past the bound after waiting) generated again
    assert restored <= trained and regenerated < len(restored)
    voided = [json.loads(x) for x in (tmp_path / "voided.jsonl").read_text().splitlines()]
    assert len(voided) == regenerated
    assert json.loads(json.dumps(resume.pipeline_state(c2)))["lineage"] == [[2, 5, 4]]


def test_work_held_without_answer_is_dispatched_elsewhere(tmp_path: Path) -> None:
    """A generator that takes work and never answers (but keeps its heartbeat) cannot stall
    the run: after intake.work_timeout_s its samples go to another generator."""
    c, hole, t = drive_with_a_hole(tmp_path, 4)
    assert c.ledger.counts["released"] >= 1 and hole.queue  # it held work, which went elsewhere
    trained = {rid for b in t.batches for rid in b}
    assert len(trained) == 4 * 8


def test_dynamic_sampling_drops_uniform_groups_and_refills(tmp_path: Path) -> None:
    """objective.dynamic_sampling: a group whose samples all scored the same is dropped
    (counted, never trained) and new prompts take its place; the steps still fill."""

    class HalfUniform(FakeGenerator):
        def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
            r = super()._rollout(item, i, seed, version)
            return dataclasses.replace(r, reward=1.0) if int(item.work_id[1:]) % 2 else r

    c, net, t = make_coordinator(tmp_path, ["objective.dynamic_sampling=true"])
    drive(c, [HalfUniform(net, "g0", seed=1), HalfUniform(net, "g1", seed=2)], 5)
    trained = {rid.rpartition("/")[0] for b in t.batches for rid in b}
    assert trained and all(int(w[1:]) % 2 == 0 for w in trained)
    assert c.intake.counts["groups_filtered_uniform"] >= 3
    assert len(trained) == 5 * 2  # every step still trains prompts_per_step groups


def test_reward_shaping_fills_failed_rewards_then_applies_the_overlong_penalty() -> None:
    """learner.shaping.shape_rollouts, which LearnerStep.step runs on the raw rewards (the
    coordinator and replay hand it the same rollouts, so both train on these numbers)."""
    from learner.shaping import shape_rollouts

    g = FakeGenerator.__new__(FakeGenerator)
    g.gid, g.rng = "g0", __import__("random").Random(0)
    item = WorkItem("w0", "p0", np.array([1, 2], np.int32), np.array([1, 2, 3], np.uint64))
    rolls = [g._rollout(item, i, s) for i, s in enumerate([1, 2, 3])]
    lens = [4, 6, 8]
    rolls = [dataclasses.replace(r, reward=1.0, tokens=np.full(n, 5, np.int32),
                                 logprobs=-np.ones(n, np.float32),
                                 exit_depths=np.full(n, 4, np.uint8)) for r, n in zip(rolls, lens)]  # fmt: skip
    out, failed = shape_rollouts(rolls, max_tokens=8, overlong_buffer=4, overlong_penalty=0.5)
    assert [r.reward for r in out] == [1.0, 0.75, 0.5] and failed == 0  # -0.25 at 6, -0.5 at 8
    same, _ = shape_rollouts(rolls, max_tokens=8)
    assert [r.reward for r in same] == [1.0, 1.0, 1.0]
    # a failed reward is its group's worst (0.3 here), before the penalty (then 0.3 - 0.5)
    mixed = [dataclasses.replace(rolls[0], reward=0.3), rolls[1],
             dataclasses.replace(rolls[2], reward=None)]  # fmt: skip
    out, failed = shape_rollouts(mixed, max_tokens=8, overlong_buffer=4, overlong_penalty=0.5)
    assert failed == 1 and [r.reward for r in out] == pytest.approx([0.3, 0.75, -0.2])
    out, _ = shape_rollouts([dataclasses.replace(r, reward=None) for r in rolls], max_tokens=8)
    assert [r.reward for r in out] == [0.0, 0.0, 0.0]  # a wholly failed group: 0.0
