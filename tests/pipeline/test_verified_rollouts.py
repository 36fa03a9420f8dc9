"""Verified rollouts: each trained rollout's claimed behaviour log-probs are
compared with the learner's (the trainer's per-rollout ``StepResult.mismatch``) under the bound of
the run's numerics and the rollout's staleness (pipeline.core.validation.check_logp); a lie is
quarantined and counted, a generator over its budget is banned, and the ban voids its accepted
but untrained rollouts, whose samples are generated again by the others and trained.

Fake trainer and generators on the in-memory transport: the trainer's "learner log-prob" of
every token is -1.0, so a rollout's mismatch is max |claim + 1| (computed from the claim)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.backends.results import StepResult
from pipeline.core.validation import (
    LOGP_BOUND_FAST,
    LOGP_BOUND_LOW_PRECISION,
    LOGP_DRIFT_PER_UPDATE,
    logp_bound,
)
from proto.records import Rollout, WorkItem
from tests.pipeline.fakes import FakeGenerator, FakeTrainer, drive, make_coordinator


class ScoringTrainer(FakeTrainer):
    """mismatch = max |claimed log-prob - (-1.0)| per rollout; records who was trained."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[list[tuple[str, str]]] = []  # per step: (rollout id, generator)

    def step(self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
             logp_bounds: Sequence[float] | None = None) -> StepResult:  # fmt: skip
        out = super().step(rollouts, needs_correction, logp_bounds)
        mismatch = [float(np.abs(r.logprobs.astype(np.float64) + 1.0).max()) for r in rollouts]
        self.trained.append([(r.rollout_id, r.generator_id) for r in rollouts])
        return dataclasses.replace(out, mismatch=mismatch)


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
    assert c.verifier.base == base
    assert logp_bound(base, 2) == base + 2 * LOGP_DRIFT_PER_UPDATE
    c.close()


# -- refused before the step trains (real trainer, real numbers) -------------------------------


class SpecGenerator(FakeGenerator):
    """A generator with real numbers: each WorkItem sampled by models.reference.generate (the
    numerical spec) from the weights of the version it serves (the run's checkpoint for v0,
    RUN_DIR/weights/v<N> after), claiming its own log-probs; ``claim`` (a liar) replaces every
    claimed log-prob with that value."""

    def __init__(self, *args: object, model_dir: Path, run_dir: Path,
                 claim: float | None = None, **kw: object) -> None:  # fmt: skip
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.model_dir, self.run_dir, self.claim = model_dir, run_dir, claim
        self._models: dict[int, object] = {}

    def _model(self, version: int) -> object:
        from models.checkpoint import load_model
        from weights.publication import weights_dir

        if version not in self._models:
            path = self.model_dir if version == 0 else weights_dir(self.run_dir, version)
            self._models = {version: load_model(path)[1]}
        return self._models[version]

    def _generate(self, item: WorkItem, version: int) -> dict[int, object]:
        """Every sample of ``item`` in one batch: latent seed -> Generation."""
        import torch

        from models.reference import SamplingParams, generate

        key = (item.work_id, tuple(int(s) for s in item.latent_seeds), version)
        if getattr(self, "_batch", (None, {}))[0] != key:
            sp = SamplingParams(temperature=item.temperature, top_p=item.top_p,
                                max_new_tokens=item.max_tokens,
                                stop_token_ids=tuple(item.stop_token_ids))  # fmt: skip
            seeds = [int(s) for s in item.latent_seeds]
            with torch.no_grad():
                gens = generate(
                    self._model(version),  # type: ignore[arg-type]
                    [[int(t) for t in item.prompt_tokens]] * len(seeds),
                    seeds,
                    sp,
                )
            self._batch = (key, dict(zip(seeds, gens, strict=True)))
        return self._batch[1]

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        g: Any = self._generate(item, version)[seed]
        lp = g.logprobs.float().numpy().astype(np.float32)
        if self.claim is not None:
            lp = np.full(len(g.tokens), self.claim, np.float32)
        return Rollout(
            rollout_id=f"{item.work_id}/{i}", work_id=item.work_id, prompt_id=item.prompt_id,
            sample_index=i, generator_id=self.gid, latent_seed=seed,
            prompt_tokens=item.prompt_tokens, tokens=np.asarray(g.tokens, np.int32),
            logprobs=lp, exit_depths=np.asarray(g.exit_depths, np.uint8),
            full_depth=int(g.full_depth), weight_version=version, reward=self.rng.random(),
        )  # fmt: skip


def _spec_run(
    tmp: Path, model_dir: Path, backend: str, over: list[str]
) -> tuple[object, object, list]:
    """A Coordinator over a real trainer of ``backend`` that records, per trainer.step call,
    (rollouts, refused indices, weights after)."""
    import torch

    from pipeline.config.run import load_config
    from pipeline.core.coordinator import Coordinator
    from pipeline.core.dispatch import Prompt, PromptSource
    from pipeline.core.validation import ModelLimits
    from pipeline.net.transport.memory import MemoryNetwork
    from tests.pipeline.fakes import TCFG

    cfg = load_config(None, [f"run_dir={tmp}", f"backend={backend}", "rollout.n=4",
                             "rollout.prompts_per_step=2", "rollout.max_tokens=4",
                             "staleness.max_staleness=0", "optimizer.lr=0.05",
                             "learner.backprop_depth=0", "publish.keep=0", *over])  # fmt: skip
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer as Base
    else:
        from pipeline.backends.megatron_adapter import MegatronTrainer as Base  # type: ignore[assignment]
    calls: list[tuple[list[Rollout], list[int], dict[str, torch.Tensor]]] = []

    class Recording(Base):  # type: ignore[valid-type, misc]
        def step(self, rollouts: Sequence[Rollout], flags: Sequence[bool],
                 logp_bounds: Sequence[float] | None = None) -> StepResult:  # fmt: skip
            out = super().step(rollouts, flags, logp_bounds)
            calls.append((list(rollouts), list(out.refused), _weights(self)))
            return out

    trainer = Recording(cfg, model_dir)
    calls.append(([], [], _weights(trainer)))  # the starting weights
    prompts = PromptSource([Prompt(f"p{i}", [1, 20 + i, 30 + i], {}) for i in range(8)], seed=0)
    net = MemoryNetwork()
    c = Coordinator(cfg, endpoint=net.bind("learner", TCFG), trainer=trainer, prompts=prompts,
                    run_dir=tmp, limits=ModelLimits.from_checkpoint(model_dir, cfg.rollout.parsed_policy))  # fmt: skip
    return c, net, calls


def _weights(trainer: object) -> dict:
    if hasattr(trainer, "model"):
        mod = trainer.model  # type: ignore[attr-defined]
    else:
        mod = trainer.trainer.policy_model  # type: ignore[attr-defined]
    return {k: v.detach().clone() for k, v in mod.state_dict().items() if v is not None
            and hasattr(v, "clone")}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.random_init import init_checkpoint

    d = tmp_path_factory.mktemp("m") / "huginn"
    init_checkpoint("huginn", "tiny", d, seed=0)
    return d


@pytest.mark.parametrize(
    ("backend", "claim", "over"),
    [("reference", -40.0, []),  # GRPO: judged in the training forward, before the update
     ("reference", -0.01, ["objective.is_cap=2.0"]),  # judged on the proximal pass
     ("reference", -40.0, ["objective.minibatches=2"]),  # the second mini-batch measured first
     pytest.param("megatron", -0.01, [], marks=pytest.mark.megatron)],
)  # fmt: skip
def test_a_lying_generator_is_refused_before_its_step_trains(
    tmp_path: Path, tiny_model: Path, backend: str, claim: float, over: list[str]
) -> None:
    """A real trainer, an honest generator with the spec's log-probs and a liar claiming
    ``claim`` nats for every token: the first step holds one group of each; the trainer
    measures every rollout before its update and refuses the step (weights unchanged); the
    liar's 4 rollouts are quarantined, its samples generated again by the honest generator;
    the step then trained is bit for bit the step of a fresh trainer on those rollouts (the
    honest group of the refused step included), and no liar token is ever trained."""
    import torch

    run = tmp_path / "run"
    c, net, calls = _spec_run(run, tiny_model, backend, over)
    kw = {"model_dir": tiny_model, "run_dir": run}
    honest = SpecGenerator(net, "g0", **kw)  # type: ignore[arg-type]
    liar = SpecGenerator(net, "liar", seed=1, claim=claim, **kw)  # type: ignore[arg-type]
    try:
        drive(c, [honest, liar], 2)
    finally:
        c.close()
    start = calls[0][2]
    first, refused, after = calls[1]
    assert {r.generator_id for r in first} == {"g0", "liar"}, "one group of each in step 1"
    lies = [i for i, r in enumerate(first) if r.generator_id == "liar"]
    assert refused == lies and len(lies) == 4
    assert all(torch.equal(after[k], start[k]) for k in start), "a refused step changed weights"
    trained = [(rolls, w) for rolls, ref, w in calls[1:] if not ref]
    assert len(trained) == c.step == 2
    assert not [r for rolls, _ in trained for r in rolls if r.generator_id == "liar"]
    # the refused step's honest group and the liar's samples (generated again by g0) are the
    # next step trained
    step1 = {r.rollout_id: r.generator_id for r in trained[0][0]}
    assert {first[i].rollout_id for i in range(len(first))} == set(step1)
    assert set(step1.values()) == {"g0"}
    honest_first = [r for r in first if r.generator_id == "g0"]
    by_id = {r.rollout_id: r for r in trained[0][0]}
    assert all(np.array_equal(by_id[r.rollout_id].tokens, r.tokens) for r in honest_first)
    # its weights: those of a fresh trainer stepping the same rollouts (nothing of the
    # refused step remains: weights, optimizer state, schedule, counters)
    if backend == "reference":
        from pipeline.backends.reference_trainer import ReferenceTrainer
        from pipeline.config.run import load_config

        cfg = c.cfg
        fresh = ReferenceTrainer(load_config(None, [f"run_dir={run}", "backend=reference",
                                                    "rollout.n=4", "rollout.prompts_per_step=2",
                                                    "rollout.max_tokens=4",
                                                    "staleness.max_staleness=0",
                                                    "optimizer.lr=0.05", "learner.backprop_depth=0",
                                                    "publish.keep=0", *over]), tiny_model)  # fmt: skip
        assert fresh.run_cfg.objective == cfg.objective
        fresh.step(trained[0][0], [False] * len(trained[0][0]))
        want = _weights(fresh)
        assert all(torch.equal(trained[0][1][k], want[k]) for k in want), "not the honest step"
        assert any(not torch.equal(want[k], start[k]) for k in want)  # the step did train
    q = [e for e in _quarantined(run) if e["reason"] == "logp_mismatch"]
    assert {e["generator"] for e in q} == {"liar"} and {e["source"] for e in q} == {"train"}
    assert len(q) == c.intake.counts["refused_logp_mismatch"] >= 4
    assert c.intake.counts["steps_refused"] >= 1
    voided = [json.loads(x) for x in (run / "voided.jsonl").read_text().splitlines()]
    assert {first[i].rollout_id for i in lies} <= {v["rollout_id"] for v in voided
                                                    if v["reason"] == "logp_mismatch"}  # fmt: skip
    assert "g0" not in c.banned


def _refuse_on_two_ranks(model_dir: str) -> dict[str, Any]:
    """One rank of a data-parallel pair (megatron backend, DP 2): a step whose only liar sits
    in the other rank's rows for rank 0, then the same rollouts stepped honestly."""
    import torch
    import torch.distributed as dist

    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.config.run import load_config
    from tests.pipeline.test_epochs import _rollouts

    cfg = load_config(None, ["backend=megatron", "rollout.n=4", "rollout.prompts_per_step=2",
                             "optimizer.lr=0.05", "learner.backprop_depth=0"])  # fmt: skip
    t = MegatronTrainer(cfg, Path(model_dir))
    rolls = _rollouts()  # w0/0..3 (rank 0's rows), w1/0..3 (rank 1's)
    bounds = [0.1 if r.rollout_id == "w1/3" else 1e9 for r in rolls]
    before = _weights(t)
    out = t.step(rolls, [False] * len(rolls), bounds)
    refused, same = (
        list(out.refused),
        all(torch.equal(v, before[k]) for k, v in _weights(t).items()),
    )
    t.step(rolls, [False] * len(rolls), [1e9] * len(rolls))
    moved = any(not torch.equal(v, before[k]) for k, v in _weights(t).items())
    res = {"rank": dist.get_rank(), "dp": t.trainer.dp_size, "refused": refused, "same": same,
           "metrics": dict(out.metrics), "moved": moved, "steps": t.trainer.step_count}  # fmt: skip
    t.close()
    return res


@pytest.mark.megatron
def test_data_parallel_ranks_refuse_the_same_step(tiny_model: Path) -> None:
    """DP 2: the liar's rows are rank 1's; both ranks measure, take the max over DP and refuse
    the step (nothing applied on either), then train the honest step that follows."""
    from tests.learner.dist_utils import run_distributed

    res = run_distributed(_refuse_on_two_ranks, 2, str(tiny_model), timeout_s=300)
    liar = 7  # w1/3, the last of the 8 rollouts
    for r in res:
        assert r["dp"] == 2 and r["refused"] == [liar] and r["same"], r
        assert r["metrics"] == {"refused_rollouts": 1.0} and r["moved"] and r["steps"] == 1
