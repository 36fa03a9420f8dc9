"""Rule logp_mismatch on stale rollouts: the audit at the weights that sampled them.

One optimizer update can move an honestly sampled token's log-prob further than the rule's
drift allowance (LOGP_DRIFT_PER_UPDATE, 10 nats): on the math example at optimizer.lr=3e-3 a
token claimed at -0.014 (and computed at -0.014 by the learner at the weights that sampled it,
to 1.4e-5) was -10.16 one update later, and both honest vLLM generators were dropped. A stale
rollout over its bound is therefore judged at the weights that sampled it
(pipeline.backends.audit.BehaviourAudit, through the trainer's ``audit``): honest drift is voided
and dispatched again, never counted; a claim off at those weights is still a lie."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pipeline.backends.results import StepResult
from pipeline.core.staleness import StalenessGate
from pipeline.core.validation import LOGP_BOUND_FAST, LOGP_DRIFT_PER_UPDATE, Refusal, logp_bound
from pipeline.core.verification import LogpVerifier
from proto.records import Rollout, WorkItem
from tests.pipeline.fakes import (
    FakeGenerator,
    FakeTrainer,
    drive,
    generated_rollouts,
    make_coordinator,
)

DRIFT = LOGP_DRIFT_PER_UPDATE + 1.0  # one update's honest move, over the allowance


def truth(version: int) -> float:
    """The fakes' log-prob of every token at weights ``version``: each update moves it by
    DRIFT nats (down, then back up)."""
    return -1.0 - DRIFT * (version % 2)


class DriftingTrainer(FakeTrainer):
    """Measures like the real trainers (max |claim - truth(its version)|, refusing a step
    holding a rollout over its bound before its update); ``audits``: it has the backends'
    ``audit`` (max |claim - truth(the rollout's version)|)."""

    def __init__(self, audits: bool = True) -> None:
        super().__init__()
        if audits:
            self.audit = self._audit
        self.audited: list[str] = []
        self.trained_by: set[str] = set()

    def _audit(self, rolls: Sequence[Rollout]) -> list[float | None]:
        self.audited += [r.rollout_id for r in rolls]
        return [float(np.abs(r.logprobs - truth(r.weight_version)).max()) for r in rolls]

    def step(self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
             logp_bounds: Sequence[float] | None = None) -> StepResult:  # fmt: skip
        mine = truth(self.steps)  # publish.every 1: the trainer's weights are version `steps`
        mismatch = [float(np.abs(r.logprobs - mine).max()) for r in rollouts]
        if logp_bounds is not None:
            over = [i for i, (x, b) in enumerate(zip(mismatch, logp_bounds)) if x > b]
            if over:
                return StepResult({"refused_rollouts": float(len(over))}, over, mismatch)
        out = super().step(rollouts, needs_correction, logp_bounds)
        self.trained_by |= {r.generator_id for r in rollouts}
        return dataclasses.replace(out, mismatch=mismatch)


class Honest(FakeGenerator):
    """Claims the truth at the weights it samples with; ``off``: that plus an offset (a liar)."""

    def __init__(self, *args: Any, off: float = 0.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.off = off

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        lp = np.full(len(r.tokens), truth(version) + self.off, np.float32)
        return dataclasses.replace(r, logprobs=lp)


def _run(tmp: Path, trainer: DriftingTrainer, off: float, steps: int = 8,
         stalls: bool = False) -> Any:  # fmt: skip
    c, net, _ = make_coordinator(tmp, ["staleness.max_staleness=1", "intake.max_refused=3",
                                       "numerics=fast"], trainer=trainer)  # fmt: skip
    gens = [Honest(net, "g0"), Honest(net, "g1", seed=1, delay=1),
            Honest(net, "liar", seed=2, off=off, delay=1)]  # fmt: skip
    try:
        drive(c, gens, steps, max_turns=500 if stalls else 5000)
    except AssertionError:
        if not stalls:
            raise
    c.close()
    return c


def test_honest_drift_beyond_the_allowance_is_never_counted_and_a_liar_still_is(
    tmp_path: Path,
) -> None:
    """Every update moves every token by 11 nats (> the 10-nat allowance): each stale honest
    rollout is over its bound, audited, voided and dispatched again, never quarantined; a
    liar 0.5 nats off at its own weights is refused (fresh: on the trainer's measurement;
    stale: on the audit's) and banned."""
    t = DriftingTrainer()
    c = _run(tmp_path, t, off=-0.5)
    assert set(c.banned) == {"liar"} and "logp_mismatch" in c.banned["liar"], c.banned
    assert c.intake.counts["audited_logp_drift"] > 0, "no honest stale rollout was audited"
    assert c.intake.counts["voided_logp_drift"] == c.intake.counts["audited_logp_drift"]
    from tests.pipeline.test_verified_rollouts import _quarantined

    q = _quarantined(tmp_path)
    assert q and {e["generator"] for e in q} == {"liar"}
    # every stale rollout drifted over its bound: only fresh ones trained, none of the liar's
    assert t.steps == 8 and all(set(vs) == {k} for k, vs in enumerate(t.versions_trained))
    assert t.trained_by and "liar" not in t.trained_by
    ids = [rid for b in t.batches for rid in b]
    assert len(ids) == len(set(ids)), "a sample was trained twice"


def test_without_an_audit_honest_drift_is_taken_for_a_lie(tmp_path: Path) -> None:
    """The failure the audit removes: a trainer without ``audit`` (the trainer's measurement
    is the verdict) drops the honest generators whose stale rollouts drifted 11 nats, and the
    run stalls (the reproduction: both vLLM generators dropped at step 22)."""
    c = _run(tmp_path, DriftingTrainer(audits=False), off=0.0, steps=6, stalls=True)
    assert {"g0", "g1"} <= set(c.banned) and c.step < 6, (c.banned, c.step)


# -- the verifier's verdicts, on fakes --------------------------------------------------------


class FakeIntake:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.refused: list[tuple[str, str, Refusal]] = []
        self.taken_back: list[dict[str, str]] = []

    def refuse_trained(self, gid: str, r: Any, why: Refusal) -> str | None:
        self.refused.append((gid, r.rollout_id, why))
        return None

    def take_back(self, groups: list[Any], refused: dict[str, str]) -> int:
        self.taken_back.append(dict(refused))
        return len(refused)


def _roll(rid: str, version: int, gid: str = "g0") -> Any:
    return SimpleNamespace(rollout_id=rid, generator_id=gid, weight_version=version,
                           token_versions=None)  # fmt: skip


@pytest.mark.parametrize("audited", [[1e-5, 0.01, 40.0, None], [0.0, 2e-3, 35.0, None]])
def test_a_refused_step_blames_only_what_the_audit_proves(audited: list) -> None:
    """Four stale rollouts over their bound (one update, 10.001 nats): audited within the
    base (honest drift: voided, not counted), 0.01 and ~40 nats off at their own weights
    (lies: quarantined), unverifiable (voided, not counted); a fresh one over its bound is a
    lie on the trainer's measurement alone (never audited)."""
    intake, seen = FakeIntake(), []

    def audit(rs: Sequence[Any]) -> list:
        seen.extend(r.rollout_id for r in rs)
        return list(audited)

    v = LogpVerifier(base=LOGP_BOUND_FAST, every=1, gate=StalenessGate(4, "drop"),
                     intake=intake, ban=lambda g, w: None, audit=audit)  # type: ignore[arg-type]  # fmt: skip
    rolls = [_roll(f"s{i}", 3) for i in range(4)] + [_roll("f", 4, "g1")]
    bounds = [logp_bound(LOGP_BOUND_FAST, 1)] * 4 + [LOGP_BOUND_FAST]
    v.refuse_step(7, rolls, ["g"], bounds, refused=[0, 1, 2, 3, 4],
                  mismatch=[10.1, 10.2, 45.0, 11.0, 0.01])  # fmt: skip
    assert seen == ["s0", "s1", "s2", "s3"], "only the stale rollouts are audited"
    assert [(g, r) for g, r, _ in intake.refused] == [("g0", "s1"), ("g0", "s2"), ("g1", "f")]
    assert "weights that sampled them" in intake.refused[0][2].detail
    assert intake.taken_back == [{"s0": "logp_drift", "s1": "logp_mismatch",
                                  "s2": "logp_mismatch", "s3": "logp_unverified",
                                  "f": "logp_mismatch"}]  # fmt: skip
    assert intake.counts["audited_logp_drift"] == intake.counts["audited_logp_unverified"] == 1


def test_the_check_after_a_step_audits_stale_rollouts_too() -> None:
    intake = FakeIntake()
    v = LogpVerifier(base=LOGP_BOUND_FAST, every=1, gate=StalenessGate(4, "drop"),
                     intake=intake, ban=lambda g, w: None,  # type: ignore[arg-type]
                     audit=lambda rs: [1e-6, 40.0][: len(rs)])  # fmt: skip
    b = logp_bound(LOGP_BOUND_FAST, 1)
    v.verify([_roll("a", 0), _roll("b", 0, "g1")], [10.5, 50.0], [b, b])
    assert [(g, r) for g, r, _ in intake.refused] == [("g1", "b")]
    assert intake.counts["audited_logp_drift"] == 1


# -- the audit's forward, on a real model -------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RUN_DIR with weights v3 (the tiny Huginn, seed 0) and v4 (seed 1)."""
    from models.random_init import init_checkpoint
    from weights.publication import weights_dir

    run = tmp_path_factory.mktemp("run")
    init_checkpoint("huginn", "tiny", weights_dir(run, 3), seed=0)
    init_checkpoint("huginn", "tiny", weights_dir(run, 4), seed=1)
    return run


def _sampled(run: Path, version: int, k: int = 3) -> list[Rollout]:
    import torch

    from models.checkpoint import load_model
    from models.reference import SamplingParams, generate
    from weights.publication import weights_dir

    model = load_model(weights_dir(run, version))[1]
    with torch.no_grad():
        gens = generate(model, [[1, 20 + i, 30] for i in range(k)], list(range(k)),  # type: ignore[arg-type]
                        SamplingParams(max_new_tokens=6), None, "fast")  # fmt: skip
    return generated_rollouts(gens, version, None)


def test_the_audit_measures_claims_at_the_weights_that_sampled_them(published: Path) -> None:
    from pipeline.backends.audit import BehaviourAudit
    from pipeline.config.run import load_config

    cfg = load_config(None, [f"run_dir={published}", "backend=reference", "rollout.n=1",
                             "rollout.prompts_per_step=3", "rollout.max_tokens=6"])  # fmt: skip
    audit = BehaviourAudit(cfg, published)
    honest = _sampled(published, 3)
    got = audit(honest)
    assert all(x is not None and 0.0 <= x <= 1e-5 for x in got), got  # far below the base
    # the same rollouts judged at other weights (v4) are far off: what the audit avoids
    moved = [dataclasses.replace(r, weight_version=4) for r in honest]
    assert all(x is not None and x > 1e-2 for x in audit(moved))
    # liars at the weights that sampled them: 0.01 nats off, and -40 a token
    off = [dataclasses.replace(r, logprobs=(r.logprobs - 0.01).astype(np.float32)) for r in honest]
    assert all(x is not None and abs(x - 0.01) < 1e-4 for x in audit(off))
    forty = [dataclasses.replace(r, logprobs=np.full(len(r.tokens), -40.0, np.float32))
             for r in honest]  # fmt: skip
    assert all(x is not None and x > 30 for x in audit(forty))
    # per token version: tokens 3.. claimed as sampled by v4 are judged at v4's weights
    tv = [dataclasses.replace(r, token_versions=np.array([3] * 3 + [4] * (len(r.tokens) - 3),
                                                         np.int64)) for r in honest]  # fmt: skip
    assert all(x is not None and x > 1e-2 for x in audit(tv))
    same = [dataclasses.replace(r, token_versions=np.full(len(r.tokens), 3, np.int64))
            for r in honest]  # fmt: skip
    assert audit(same) == got
    # weights gone (pruned): unverifiable
    assert audit([dataclasses.replace(honest[0], weight_version=1)]) == [None]


def test_a_set_too_large_for_the_host_is_not_audited(
    published: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above audit.MAX_PARAMS the weights are not even loaded: unverifiable (None)."""
    from pipeline.backends import audit as audit_mod
    from pipeline.config.run import load_config

    cfg = load_config(None, [f"run_dir={published}", "backend=reference", "rollout.n=1",
                             "rollout.prompts_per_step=3", "rollout.max_tokens=6"])  # fmt: skip
    honest = _sampled(published, 3, k=1)
    monkeypatch.setattr(audit_mod, "MAX_PARAMS", 1000)
    loaded: list[Any] = []
    monkeypatch.setattr("models.checkpoint.load_model", lambda p: loaded.append(p))
    assert audit_mod.BehaviourAudit(cfg, published)(honest) == [None] and not loaded


def test_an_audit_that_fails_proves_nothing() -> None:
    intake = FakeIntake()

    def broken(rs: Sequence[Any]) -> list:
        raise RuntimeError("out of memory")

    v = LogpVerifier(base=LOGP_BOUND_FAST, every=1, gate=StalenessGate(4, "drop"),
                     intake=intake, ban=lambda g, w: None, audit=broken)  # type: ignore[arg-type]  # fmt: skip
    b = logp_bound(LOGP_BOUND_FAST, 1)
    v.refuse_step(3, [_roll("a", 0)], ["g"], [b], refused=[0], mismatch=[40.0])
    assert not intake.refused and intake.taken_back == [{"a": "logp_unverified"}]
