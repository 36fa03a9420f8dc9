"""The coordinator logs the behaviour-vs-learner log-prob mismatch per generator
(`mismatch/<generator_id>`): the max of the trainer's per-rollout
`StepResult.mismatch` over that generator's rollouts of the step (fake trainer and generators, the
in-memory transport)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from pipeline.backends.results import StepResult
from proto.records import Rollout
from tests.pipeline.fakes import FakeGenerator, FakeTrainer, drive, make_coordinator


class MeasuringTrainer(FakeTrainer):
    """mismatch per rollout: generator g1 drifts (0.5 + sample index / 10), g0 is exact
    to 1e-6 except one unmeasured rollout (-1.0, as LearnerStep reports one)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_gen: list[dict[str, float]] = []

    def step(self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
             logp_bounds: Sequence[float] | None = None) -> StepResult:  # fmt: skip
        out = super().step(rollouts, needs_correction, logp_bounds)
        mismatch = [
            (0.5 + r.sample_index / 10 if r.generator_id == "g1" else
             -1.0 if i == 0 else 1e-6)
            for i, r in enumerate(rollouts)
        ]  # fmt: skip
        want: dict[str, float] = {}
        for x, r in zip(mismatch, rollouts, strict=True):
            if x >= 0:
                want[r.generator_id] = max(x, want.get(r.generator_id, 0.0))
        self.by_gen.append(want)
        return dataclasses.replace(out, mismatch=mismatch)


def test_mismatch_is_logged_per_generator(tmp_path: Path) -> None:
    rows: list[dict] = []
    trainer = MeasuringTrainer()
    c, net, _ = make_coordinator(tmp_path, ["staleness.max_staleness=2"], trainer=trainer)
    c.on_step = rows.append
    drive(c, [FakeGenerator(net, "g0"), FakeGenerator(net, "g1", seed=1)], 6)
    c.close()
    seen = set()
    for row, want in zip(rows, trainer.by_gen, strict=True):
        got = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("mismatch/")}
        assert got == want, (got, want)
        seen |= set(got)
    assert seen == {"g0", "g1"}  # both generators trained in some step
    assert all(row.get("mismatch/g1", 0.8) >= 0.5 for row in rows)
