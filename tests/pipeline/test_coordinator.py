"""Coordinator ordering and invariants, driven by fake generators and a fake trainer
(in-memory transport, one thread): exactly once, record-before-ack, complete groups only,
the staleness bound, re-dispatch after a generator death, resume after a crash."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pipeline.core import resume
from pipeline.core.recorder import read_rollouts, read_steps
from proto.records import Ack, RolloutBatch, WorkItem
from tests.pipeline.fakes import FakeGenerator, FakeTrainer, drive, make_coordinator


def trained_ids(t: FakeTrainer) -> list[str]:
    return [rid for b in t.batches for rid in b]


def check_exactly_once(t: FakeTrainer, n: int) -> None:
    ids = trained_ids(t)
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    groups = Counter(rid.rpartition("/")[0] for rid in ids)
    assert all(c == n for c in groups.values()), f"incomplete groups trained: {groups}"


def test_steps_groups_and_exactly_once(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, ["staleness.max_staleness=1"])
    gens = [FakeGenerator(net, f"g{i}", seed=i) for i in range(2)]
    drive(c, gens, 6)
    assert len(t.batches) == 6 and all(len(b) == 2 * 4 for b in t.batches)
    check_exactly_once(t, 4)
    for b in t.batches:  # groups in order, each by sample index
        for j in range(0, len(b), 4):
            assert [r.rpartition("/")[2] for r in b[j : j + 4]] == ["0", "1", "2", "3"]
    assert c.version == 6 and (tmp_path / "weights" / "v6" / "config.json").is_file()
    c.close()
    # the step log names exactly the trained batches; every trained rollout is in the stream
    assert [s.rollout_ids for s in read_steps(tmp_path / "steps.jsonl")] == t.batches
    recorded = [r.rollout_id for _, r in read_rollouts(tmp_path / "stream")]
    assert len(recorded) == len(set(recorded)) and set(trained_ids(t)) <= set(recorded)


def test_rollouts_recorded_before_ack(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, [])
    order: list[str] = []
    rec, send = c.intake.record, c.endpoint.send

    def record(rolls: list) -> None:
        order.extend(f"rec:{r.rollout_id}" for r in rolls)
        rec(rolls)

    def spy_send(peer: str, r: object, **kw: object) -> bool:
        if isinstance(r, Ack) and r.kind == "rollout":
            order.append(f"ack:{r.ref}")
        return send(peer, r, **kw)

    c.intake.record = record  # type: ignore[method-assign]
    c.endpoint.send = spy_send  # type: ignore[method-assign]
    drive(c, [FakeGenerator(net, "g0")], 2)
    acks = [o for o in order if o.startswith("ack:")]
    assert acks
    for a in acks:  # a rollout's Ack, or its whole group's (ref = the work id)
        ref = a[4:]
        recs = [i for i, o in enumerate(order) if o == f"rec:{ref}" or o.startswith(f"rec:{ref}/")]
        assert recs and max(recs) < order.index(a), a
    assert any("/" not in a for a in acks)  # FakeGenerator sends whole groups: group Acks


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_staleness_bound_never_exceeded(tmp_path: Path, max_staleness: int) -> None:
    rows: list[dict] = []
    c, net, t = make_coordinator(tmp_path, [f"staleness.max_staleness={max_staleness}"])
    c.on_step = rows.append
    gens = [FakeGenerator(net, "g0", delay=3), FakeGenerator(net, "g1", delay=0, seed=1)]
    drive(c, gens, 8)
    for b_versions, row in zip(t.versions_trained, rows):
        assert max(row["version"] - v for v in b_versions) <= max_staleness
        assert row["staleness_max"] <= max_staleness
    check_exactly_once(t, 4)


def test_policy_keep_flags_stale_rollouts(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, ["staleness.max_staleness=1", "staleness.policy=keep",
                                            "objective.is_cap=2.0"])  # fmt: skip
    gens = [FakeGenerator(net, "g0", delay=12), FakeGenerator(net, "g1", seed=1)]
    drive(c, gens, 14)
    check_exactly_once(t, 4)
    assert c.gate.counts["stale_kept"] > 0 and any(any(f) for f in t.flags)


def test_generator_death_redispatches_missing_samples(tmp_path: Path) -> None:
    from tests.pipeline.test_transport import FakeClock  # type: ignore[attr-defined]

    clock = FakeClock()
    c, net, t = make_coordinator(tmp_path, [], clock=clock)
    slow = FakeGenerator(net, "slow", delay=10**9, clock=clock)  # takes work, never answers
    fast = FakeGenerator(net, "fast", seed=1, clock=clock)

    def hook(turn: int) -> None:
        clock.advance(0.01)
        if turn == 20:
            slow.kill()  # silent from now on: expires after peer_timeout_s

    drive(c, [slow, fast], 4, hook=hook)
    check_exactly_once(t, 4)
    assert c.ledger.counts["released"] > 0  # slow's samples were re-dispatched to fast
    assert all(rid.rpartition("/")[0] for rid in trained_ids(t))


def test_late_duplicates_discarded_and_partial_redispatch_renumbered(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, [])
    g0 = FakeGenerator(net, "g0", number_from_zero=True)
    drive(c, [g0], 1)
    # a replayed frame (the generator re-sends after a reconnect): all duplicates, acked
    res = c.intake.receive("g0", RolloutBatch(g0.sent[:4]))
    assert res.accepted == 0 and res.duplicate == 4
    assert all(isinstance(r, Ack) for r in res.replies)
    # a partial re-dispatch numbered 0..k-1 is renumbered by latent seed
    spec = c.dispatcher.make_spec(1000)
    c.dispatcher.open[spec.work_id] = spec
    c.ledger.dispatch(spec.work_id, "g0", 4, indices=[2, 3])
    p = spec.prompt  # the rollout answers what was dispatched (the door checks the prompt)
    r = g0._rollout(WorkItem(spec.work_id, p.prompt_id, __import__("numpy").array(p.tokens, "int32"),
                    __import__("numpy").array(spec.seeds[2:3], "uint64")), 0, spec.seeds[2])  # fmt: skip
    res = c.intake.receive("g0", r)
    assert res.accepted == 1 and c.intake.counts["remapped"] == 1
    assert c.ledger.state(spec.work_id)[2] == "accepted"


def test_resume_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, ["staleness.max_staleness=1", "checkpoint.every=2"])
    gens = [FakeGenerator(net, f"g{i}", seed=i, delay=2 * i) for i in range(2)]
    for _turn in range(5000):  # run past the step-2 checkpoint, then "kill -9" mid-flight
        if c.turn(0.0) and c.step % 2 == 0:
            resume.save(c, keep=2)
        for g in gens:
            g.step()
        if c.step == 3 and c.dispatcher.inflight() > 0:
            break
    assert c.step == 3 and c.dispatcher.inflight() > 0
    before_ckpt = [list(b) for b in t.batches[:2]]
    c.recorder.close()  # the process dies; the stream on disk is what survives
    c.endpoint.close()
    ckpt = t.latest(tmp_path)
    assert ckpt is not None and ckpt.name == "step_00000002"
    t2 = FakeTrainer()
    c2, net2, _ = make_coordinator(tmp_path, ["staleness.max_staleness=1"], net=net, trainer=t2)
    counts = resume.restore(c2, ckpt)
    assert counts["from_stream"] + counts["from_buffer"] + counts["redispatch"] > 0
    assert c2.step == 2 and c2.version == 4  # newer than everything published before (v3)
    gens2 = [FakeGenerator(net2, f"h{i}", seed=10 + i) for i in range(2)]
    drive(c2, gens2, 8)
    c2.close()
    trained = [rid for b in before_ckpt for rid in b] + trained_ids(t2)
    assert len(trained) == len(set(trained)), "trained twice across the restart"
    steps = read_steps(tmp_path / "steps.jsonl")
    assert [s.step for s in steps] == list(range(1, 9))
    assert [rid for s in steps for rid in s.rollout_ids] == trained
    groups = Counter(rid.rpartition("/")[0] for rid in trained)
    assert all(v == 4 for v in groups.values())
    # no work lost: every work id ever created is trained, dropped as stale, or still open
    first = {rid.rpartition("/")[0] for b in before_ckpt for rid in b}
    accounted = first | c2.intake.trained | set(c2.dispatcher.open)
    assert accounted == {f"w{i}" for i in range(c2.dispatcher.counter)}


def test_rehello_same_process_keeps_work_new_process_releases_it(tmp_path: Path) -> None:
    c, net, t = make_coordinator(tmp_path, [])
    d = c.dispatcher
    d.add_generator("g", 2, 0, (11, 1.0))
    sent: list = []
    d.pump(0, lambda gid, item: sent.append(item) or True)
    assert len(sent) == 2 and d.inflight() == 2
    d.add_generator("g", 2, 0, (11, 1.0))  # reconnect of the same process: it still holds them
    assert d.inflight() == 2 and c.ledger.counts["released"] == 0
    d.add_generator("g", 2, 0, (12, 2.0))  # a new process under the same id: they are lost
    assert d.inflight() == 0 and c.ledger.counts["released"] == 2 * 4
    sent.clear()
    d.pump(0, lambda gid, item: sent.append(item) or True)
    assert sorted(i.work_id for i in sent) == ["w0", "w1"]  # re-dispatched, same work ids


class SlowTrainer(FakeTrainer):
    """A step takes ``seconds`` of wall time on the trainer thread."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.threads: set[str] = set()

    def step(self, rollouts, needs_correction, logp_bounds=None):  # type: ignore[no-untyped-def]
        import threading
        import time

        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return super().step(rollouts, needs_correction, logp_bounds)


def test_background_training_keeps_listening(tmp_path: Path) -> None:
    """background=True: while a step runs on the trainer thread, the coordinator keeps
    taking rollouts in (recorded, acknowledged) and dispatching; order and exactly-once are
    unchanged and every step is logged before the next starts."""
    import time

    from pipeline.core.coordinator import Coordinator
    from pipeline.net.transport.memory import MemoryNetwork
    from tests.pipeline.fakes import FAKE_LIMITS, TCFG, prompts

    cfg = make_coordinator(tmp_path / "cfg", ["staleness.max_staleness=1"])[0].cfg
    net = MemoryNetwork()
    t = SlowTrainer(0.2)
    c = Coordinator(cfg, endpoint=net.bind("learner", TCFG), trainer=t, prompts=prompts(),
                    run_dir=tmp_path, limits=FAKE_LIMITS, background=True)  # fmt: skip
    # answers a few turns after the work arrives: a completed step sends new work at once, so
    # instant answers would all be in before the next step starts
    gens = [FakeGenerator(net, f"g{i}", seed=i, delay=3) for i in range(2)]
    during = 0
    t0 = time.monotonic()
    while c.step < 4 and time.monotonic() - t0 < 60:
        busy = c.training
        before = c.intake.counts["accepted"]
        c.turn(0.005)
        for g in gens:
            g.step()
        if busy and c.training:
            during += c.intake.counts["accepted"] - before
    c.drain()
    c.close()
    assert c.step >= 4, (c.step, c.intake.counts, c.gate.inflight())
    assert t.threads and all(n.startswith("trainer") for n in t.threads)
    assert during > 0, "nothing was taken in while a step ran"
    check_exactly_once(t, 4)
    assert [s.rollout_ids for s in read_steps(tmp_path / "steps.jsonl")] == t.batches


def test_resume_republishes_a_version_written_but_never_announced(tmp_path: Path) -> None:
    """digests.jsonl is written before a version is announced; a weights/vN directory beyond
    its last line (a learner killed between writing the weights and announcing them) was heard
    of by no generator: a resume removes it and publishes N again, so versions stay 1, 2, ...
    without a gap."""
    import json

    w = tmp_path / "weights"
    for v in (1, 2, 3):
        (w / f"v{v}").mkdir(parents=True)
    (w / "digests.jsonl").write_text("".join(json.dumps({"version": v, "digest": f"d{v}"}) + "\n"
                                             for v in (1, 2)))  # fmt: skip
    assert resume._max_published(tmp_path) == 2
    assert sorted(p.name for p in w.glob("v*")) == ["v1", "v2"]


def test_a_generator_that_joins_later_gets_its_share(tmp_path: Path) -> None:
    """When work, not generators, is short (the staleness gate holds it back), the items that
    free up go to the least loaded generator, ties to the one served least recently: one that
    joins later is not starved by the first taking every freed item."""
    c, net, t = make_coordinator(tmp_path, ["staleness.max_staleness=1"])
    first = FakeGenerator(net, "g0", seed=0)
    drive(c, [first], 2)
    before = {r.rollout_id for _, r in read_rollouts(tmp_path / "stream")}
    drive(c, [first, FakeGenerator(net, "g1", seed=1)], 14)
    c.close()
    after = Counter(r.generator_id for _, r in read_rollouts(tmp_path / "stream")
                    if r.rollout_id not in before)  # fmt: skip
    total = sum(after.values())
    assert total >= 12 * 2 * 4, after
    assert min(after["g0"], after["g1"]) >= total / 3, after  # each at least a third


def test_publish_keep_prunes_every_older_weights_dir(tmp_path: Path) -> None:
    """publish.keep=2: after each announcement only the two newest versions stay on disk,
    directories a killed run left below them included (weights/v0 here); a directory above the
    current version is not touched."""
    from weights.publication import weight_versions, weights_dir

    for v in (0, 50):  # a killed run's leftover below, one in writing far above
        weights_dir(tmp_path, v).mkdir(parents=True)
    c, net, t = make_coordinator(tmp_path, ["publish.keep=2"])
    drive(c, [FakeGenerator(net, f"g{i}", seed=i) for i in range(2)], 5)
    c.close()
    assert c.version == 5
    assert weight_versions(tmp_path) == [4, 5, 50]


def test_the_first_step_waits_for_min_generators(tmp_path: Path) -> None:
    """min_generators=2: with one generator serving, its complete groups are buffered (more
    than a step's) and nothing trains; once a second registers the steps run, the buffered
    groups among the first trained. Alone past max_wait_s: an error naming the wait."""
    from pipeline.core.coordinator_errors import CoordinatorError

    c, net, t = make_coordinator(tmp_path, ["min_generators=2"])
    g0 = FakeGenerator(net, "g0")
    for _ in range(300):
        c.turn(0.0)
        g0.step()
    assert c.step == 0 and not t.batches
    buffered = list(c.intake.complete)
    assert len(buffered) >= c.cfg.rollout.prompts_per_step, buffered
    g1 = FakeGenerator(net, "g1", seed=1)
    drive(c, [g0, g1], 3)
    assert len(t.batches) == 3 and set(c.dispatcher.generators()) == {"g0", "g1"}
    first = {rid.rpartition("/")[0] for rid in t.batches[0]}
    assert first <= set(buffered), (first, buffered)
    check_exactly_once(t, 4)
    c.close()

    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    c2, net2, t2 = make_coordinator(tmp_path / "alone", ["min_generators=2", "max_wait_s=20"],
                                    clock=clock)  # fmt: skip
    FakeGenerator(net2, "g0")
    with pytest.raises(CoordinatorError, match=r"\(min_generators=2: the first step waits"):
        c2.run(1)
    assert not t2.batches
    c2.close()
