"""An accepted group that grows too stale in the buffer (policy drop) is generated again, never
dropped (a resume's regenerated copy was once dropped as stale the second time,
`intake.rollouts_dropped_stale=64`): its samples are re-opened in the ledger, queued for
re-dispatch under the same work id and named in voided.jsonl (fake generator and trainer)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.pipeline.fakes import FakeGenerator, make_coordinator


def test_a_stale_accepted_group_is_generated_again_not_dropped(tmp_path: Path) -> None:
    c, net, _ = make_coordinator(tmp_path, ["staleness.max_staleness=0"])
    c.gate.can_train = lambda *_a, **_k: False  # type: ignore[method-assign]  # hold the buffer
    g = FakeGenerator(net, "g0", max_inflight=2)
    for _ in range(200):
        c.turn(0.0)
        g.step()
        if len(c.intake.complete) >= 2:
            break
    groups = list(c.intake.complete)
    assert len(groups) >= 2
    assert c.intake.select(5, 1) is None  # v0 rollouts at learner v5: too stale to train
    assert c.intake.counts["rollouts_dropped_stale"] == 0
    assert c.intake.counts["rollouts_regenerated_stale"] == 4 * len(groups)
    for w in groups:
        assert c.ledger.is_open(w) and c.ledger.state(w) == ["unassigned"] * 4
        assert w in c.dispatcher.open  # same work id, same seeds: dispatched again
    voided = [json.loads(x) for x in (tmp_path / "voided.jsonl").read_text().splitlines()]
    assert sorted(v["rollout_id"] for v in voided) == sorted(
        f"{w}/{i}" for w in groups for i in range(4)
    )
    c.gate.can_train = type(c.gate).can_train.__get__(c.gate)  # type: ignore[method-assign]
    c.close()
