"""Evaluation rounds on the generators (pipeline.core.eval_rounds): eval items go out before
training work, outside the ledger, the gate, the stream and the step log; every round is
reported once with pass@1 / mean@n and the versions it was measured at; a generator that
dies holding eval items has them sent again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.core.dispatch import Prompt
from pipeline.core.eval_rounds import EvalRounds, is_eval_work
from pipeline.core.recorder import read_rollouts, read_steps
from proto.records import Rollout, WorkItem
from tests.pipeline.fakes import FakeGenerator, drive, make_coordinator, poison


class Grader(FakeGenerator):
    """Eval prompts whose id ends in an even digit are answered correctly."""

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        ok = int(item.prompt_id[-1]) % 2 == 0
        return dataclasses.replace(r, reward=float(ok), reward_info={"correct": ok})


def _rounds(results: list[tuple[int, dict[str, Any]]], last: int) -> EvalRounds:
    prompts = [Prompt(f"q{i}", [1, 30 + i], {}) for i in range(6)]
    return EvalRounds(prompts, n=2, temperature=0.0, max_tokens=8, stop_token_ids=[],
                      run_seed=0, every=2, last_step=last,
                      on_result=lambda s, m: results.append((s, m)))  # fmt: skip


def test_eval_rounds_on_generators(tmp_path: Path) -> None:
    results: list[tuple[int, dict[str, Any]]] = []
    c, net, t = make_coordinator(tmp_path, [], evals=_rounds(results, last=5))
    assert c.evals is not None and c.dispatcher.evals is c.evals
    c.evals.start(0, 0)
    gens = [Grader(net, "g0", seed=1), Grader(net, "g1", seed=2)]
    drive(c, gens, 5)
    for _ in range(200):  # the last round: served after the last step, as Coordinator.run does
        if not c.evals.pending():
            break
        c.serve(0.0)
        for g in gens:
            g.step()
    c.close()
    assert [s for s, _ in results] == [0, 2, 4, 5]
    for _, m in results:
        assert m["eval/accuracy"] == 0.5 and m["eval/mean@n"] == 0.5 and m["eval/prompts"] == 6
    assert results[-1][1]["eval/version"] >= 5
    trained = [rid for st in read_steps(tmp_path / "steps.jsonl") for rid in st.rollout_ids]
    recorded = [r.rollout_id for _, r in read_rollouts(tmp_path / "stream")]
    assert trained and not any(is_eval_work(x) for x in trained + recorded)
    eval_ids = [w for rd in c.evals.rounds.values() for w in rd.items]
    assert not any(c.ledger.is_open(w) or c.ledger.is_done(w) for w in eval_ids)  # never seen
    assert not c.gate.inflight().keys() & set(eval_ids)
    assert c.evals.counts["items_sent"] == 4 * 6


def test_eval_items_of_a_dead_generator_are_sent_again(tmp_path: Path) -> None:
    results: list[tuple[int, dict[str, Any]]] = []
    c, net, t = make_coordinator(tmp_path, ["transport.peer_timeout_s=2.0"],
                                 evals=_rounds(results, last=100))  # fmt: skip
    assert c.evals is not None
    c.evals.start(0, 0)
    dead = Grader(net, "dead", seed=1)
    dead.paused = True
    dead.step()
    c.turn(0.0)
    dead.step()
    assert c.evals.held.get("dead"), "the first generator took eval items"
    c.dispatcher.remove_generator("dead")  # as on heartbeat expiry
    live = Grader(net, "live", seed=2)
    for _ in range(100):
        c.turn(0.0)
        live.step()
        if results:
            break
    assert results and results[0][0] == 0 and c.evals.counts["resent"] >= 1


class DepthGrader(Grader):
    """Runs an eval_depth item at that depth (every exit depth d) and answers it correctly iff
    d >= 4 (or as Grader at eval_depth 0); ``deaf``: ignores eval_depth (a 1.3 generator)."""

    deaf = False

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        d = item.eval_depth
        if not d or self.deaf:
            return r
        return dataclasses.replace(r, exit_depths=np.full(2, d, np.uint8),
                                   reward=float(d >= 4), reward_info={"correct": d >= 4})  # fmt: skip


def test_fixed_depth_rounds(tmp_path: Path) -> None:
    """eval.depths: each round also sends every prompt once per depth d (WorkItem.eval_depth,
    the same latent seeds) and reports eval/accuracy@d and eval/mean_depth@d from those
    rollouts alone; a depth above the run's max depth (4 here) passes the door; a generator
    that ignores eval_depth (its rollouts ran the run's depth) is refused, the item sent again."""
    results: list[tuple[int, dict[str, Any]]] = []
    prompts = [Prompt(f"q{i}", [1, 30 + i], {}) for i in range(6)]
    rounds = EvalRounds(prompts, n=2, temperature=0.0, max_tokens=8, stop_token_ids=[],
                        run_seed=0, every=2, last_step=100, depths=[1, 9],
                        on_result=lambda s, m: results.append((s, m)))  # fmt: skip
    c, net, _ = make_coordinator(tmp_path, [], evals=rounds)
    rounds.start(0, 0)
    items = rounds.rounds[0].items
    assert len(items) == 18 and {it.eval_depth for it in items.values()} == {0, 1, 9}
    by_id = {(w.split("-")[-1], it.eval_depth): it for w, it in items.items()}
    assert all(
        list(by_id[(k, d)].latent_seeds) == list(by_id[(k, 0)].latent_seeds)
        for k, d in by_id if d
    )  # fmt: skip
    deaf = DepthGrader(net, "deaf", seed=1)
    deaf.deaf = True
    for _ in range(12):
        c.turn(0.0)
        deaf.step()
    assert rounds.counts["refused"] >= 1 and not results
    deaf.paused = True
    c.dispatcher.remove_generator("deaf")  # its held items go out again
    good = DepthGrader(net, "good", seed=2)
    for _ in range(300):
        c.turn(0.0)
        good.step()
        if results:
            break
    c.close()
    ((step, m),) = results
    assert step == 0 and m["eval/prompts"] == 6
    assert m["eval/accuracy"] == 0.5 and m["eval/mean_depth"] == 4.0  # the run's policy
    assert m["eval/accuracy@1"] == 0.0 and m["eval/mean_depth@1"] == 1.0
    assert m["eval/accuracy@9"] == 1.0 and m["eval/mean@n@9"] == 1.0
    assert m["eval/mean_depth@9"] == 9.0


class SampledDepthGrader(DepthGrader):
    """A sampled-exit run's generator: the run's own items (training, eval_depth 0) claim exit
    log-probs; an eval_depth item runs FixedDepth and claims none."""

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        if item.eval_depth:
            return r
        return dataclasses.replace(r, exit_logprobs=np.array([-0.5, -0.5], np.float32))


def test_fixed_depth_rounds_on_a_sampled_exit(tmp_path: Path) -> None:
    """rollout.exit_policy sampled_gate with eval.depths: the fixed-depth items' rollouts carry
    no exit log-probs and the door admits them (before: every one refused, reason
    exit_logprob, until the generator was dropped); the round reports each depth."""
    results: list[tuple[int, dict[str, Any]]] = []
    prompts = [Prompt(f"q{i}", [1, 30 + i], {}) for i in range(6)]
    rounds = EvalRounds(prompts, n=2, temperature=0.0, max_tokens=8, stop_token_ids=[],
                        run_seed=0, every=2, last_step=100, depths=[1, 4],
                        on_result=lambda s, m: results.append((s, m)))  # fmt: skip
    c, net, _ = make_coordinator(tmp_path, ["rollout.exit_policy={kind: sampled_gate}"],
                                 evals=rounds)  # fmt: skip
    assert c.intake.rules.sampled_exit
    rounds.start(0, 0)
    g = SampledDepthGrader(net, "g", seed=2)
    for _ in range(300):
        c.turn(0.0)
        g.step()
        if results:
            break
    c.close()
    ((step, m),) = results
    assert rounds.counts["refused"] == 0 and m["eval/prompts"] == 6
    assert m["eval/mean_depth@1"] == 1.0 and m["eval/accuracy@1"] == 0.0
    assert m["eval/mean_depth@4"] == 4.0 and m["eval/accuracy@4"] == 1.0


def test_depth_checks() -> None:
    """eval.depths refused in one line naming the key: 0, > 255, not ints, duplicates; a
    depth-1 family takes [1] only."""
    from models.errors import ConfigError
    from pipeline.config.run import load_config
    from pipeline.core.eval_rounds import check_depths

    base = ["eval.every=1", "task.kind=dataset", "task.path=x"]
    for bad in ("[0]", "[256]", "[2,2]"):
        with pytest.raises(ConfigError, match=r"eval\.depths=.*distinct ints in \[1, 255\]"):
            load_config(None, [*base, f"eval.depths={bad}"])
    for bad in ("[a]", "[true]", "[1.5]"):  # the schema's type check, naming the element
        with pytest.raises(ConfigError, match=r"run config eval\.depths\[0\]: "):
            load_config(None, [*base, f"eval.depths={bad}"])
    assert load_config(None, [*base, "eval.depths=[1,2,255]"]).eval.depths == [1, 2, 255]
    check_depths([1], 1, looped=False)
    check_depths([1, 2, 64], 4, looped=True)
    with pytest.raises(ConfigError, match=r"eval\.depths=\[1, 2\]: the model is a depth-1"):
        check_depths([1, 2], 1, looped=False)


class Liar(Grader):
    """Claims every eval answer correct, with rollouts the door must refuse (one poison each)."""

    def __init__(self, *a: Any, kind: str, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.kind = kind

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        r = super()._rollout(item, i, seed, version)
        if not is_eval_work(item.work_id):
            return r
        return poison(dataclasses.replace(r, reward=1.0, reward_info={"correct": True}), self.kind)


@pytest.mark.parametrize("kind", ["token_oov", "seed", "claims_other", "depth_200", "reward_inf"])
def test_eval_rollouts_go_through_the_door(tmp_path: Path, kind: str) -> None:
    """A generator lying in its eval rollouts cannot bend eval/accuracy: they are refused
    (Nack, quarantined, counted toward a ban) and their items answered by another generator."""
    results: list[tuple[int, dict[str, Any]]] = []
    c, net, _ = make_coordinator(tmp_path, ["intake.max_refused=0"],
                                 evals=_rounds(results, last=100))  # fmt: skip
    assert c.evals is not None
    c.evals.start(0, 0)
    liar, honest = Liar(net, "liar", seed=1, kind=kind), Grader(net, "honest", seed=2)
    honest.paused = True
    for _ in range(6):  # the liar takes eval items first
        c.turn(0.0)
        liar.step()
    assert c.evals.counts["refused"] >= 1 or kind == "reward_inf"
    honest.paused = False
    for _ in range(300):
        c.turn(0.0)
        liar.step()
        honest.step()
        if results:
            break
    c.close()
    assert results
    if kind != "reward_inf":
        assert results[0][1]["eval/accuracy"] == 0.5  # the honest answers only
        assert c.intake.counts["refused"] == c.evals.counts["refused"] >= 1
    if kind == "reward_inf":  # not refused: a failed reward (as in training), so not correct
        assert c.evals.counts["refused"] == 0 and results[0][1]["eval/accuracy"] <= 0.5
        return
    reason = {"token_oov": "token_out_of_vocab", "seed": "seed_mismatch",
              "claims_other": "wrong_generator", "depth_200": "exit_depth"}[kind]  # fmt: skip
    quarantined = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined and all(q["generator"] == "liar" for q in quarantined)
    assert {q["reason"] for q in quarantined} <= {reason}


def test_wandb_logging_offline(tmp_path: Path) -> None:
    """metrics.wandb: every row's scalars go to a Weights & Biases run (offline here), with the
    step; the run's files land in RUN_DIR/wandb."""
    import json

    from pipeline.core.metrics import MetricsWriter

    m = MetricsWriter(tmp_path, tensorboard=False, wandb=True, wandb_project="looprl-test",
                      config={"seed": 0})  # fmt: skip
    m.log({"step": 1, "reward_mean": 0.5, "eval/accuracy": 0.25, "note": "x"})
    m.log({"step": 2, "reward_mean": 0.75})
    m.close(plot=False)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2]


def test_accuracy_vs_depth_panel(tmp_path: Path) -> None:
    """eval.depths rows -> the plot's accuracy-vs-depth curves: x = depth, one curve per eval
    step (the last always, at most 6), the run's policy at (mean depth, accuracy)."""
    from pipeline.core.metrics import MetricsWriter, depth_curves, read_metrics

    m = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 11):
        row: dict[str, Any] = {"step": step, "reward_mean": 0.1 * step, "elapsed_s": step}
        if step % 2 == 1 or step == 10:
            row |= {"eval/accuracy": 0.5, "eval/mean_depth": 3.5, "eval/accuracy@1": 0.1,
                    "eval/accuracy@4": 0.02 * step, "eval/accuracy@16": 0.3}  # fmt: skip
        m.log(row)
    m.close(plot=True)
    curves = depth_curves(read_metrics(tmp_path / "metrics.jsonl"))
    assert list(curves) == [1, 3, 5, 7, 9, 10]  # 6 eval steps: all kept
    pts, adaptive = curves[10]
    assert pts == [(1, 0.1), (4, 0.2), (16, 0.3)] and adaptive == (3.5, 0.5)
    assert len(depth_curves(read_metrics(tmp_path / "metrics.jsonl"), most=3)) == 3
    assert (tmp_path / "metrics.png").stat().st_size > 10_000
