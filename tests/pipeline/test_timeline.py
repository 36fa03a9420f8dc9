"""pipeline.core.timeline.StepTimeline on a fake clock: what each time/* key of a step's row
measures (the coordinator's calls in their order; the live keys are checked end to end in
tests/cli/test_run_llama.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.core.timeline import StepTimeline


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def roll(gen: float, queue: float, reward: float) -> SimpleNamespace:
    return SimpleNamespace(metrics={"gen_time_s": gen, "queue_time_s": queue,
                                    "reward_time_s": reward})  # fmt: skip


def test_one_step_then_the_next() -> None:
    c = Clock()
    tl = StepTimeline(c)
    c.t += 0.5
    tl.intake_start()
    c.t += 0.25  # rollouts in: 0.25 s
    tl.intake_end()
    c.t += 1.0
    tl.step_started()  # idle since construction: 1.75 s
    row = tl.row([roll(0.2, 0.1, 0.01), roll(0.4, 0.3, 0.03)], train_s=0.3,
                 publish={"gather": 0.02, "total": 0.05}, announce_s=0.004)  # fmt: skip
    assert row == pytest.approx({
        "time/train": 0.3, "time/dispatch_wait": 1.75, "time/intake": 0.25,
        "time/generation": 0.3, "time/queue": 0.2, "time/reward": 0.04,
        "time/publish": 0.05, "time/publish_gather": 0.02, "time/publish_announce": 0.004,
    })  # fmt: skip
    tl.step_done()
    tl.announced(1)
    c.t += 0.5
    tl.served({"gen0": 1, "gen1": 0})  # not every generator yet: not delivered
    c.t += 0.25
    tl.served({"gen0": 1, "gen1": 1})  # announce -> the last one: 0.75 s
    c.t += 0.25
    tl.step_started()
    row = tl.row([], train_s=0.1, publish=None, announce_s=None)
    assert row == pytest.approx({"time/train": 0.1, "time/dispatch_wait": 1.0,
                                 "time/intake": 0.0, "time/weight_delivery": 0.75})  # fmt: skip
    assert "time/weight_delivery" not in tl.row([], train_s=0.1, publish=None, announce_s=None)


def test_delivery_of_the_newest_version_served_by_all() -> None:
    """Two versions announced before the slowest generator acknowledges: the row reports the
    newest one it serves (announce of v2 -> now), and v1 is not reported later."""
    c = Clock()
    tl = StepTimeline(c)
    tl.announced(1)
    c.t += 1.0
    tl.announced(2)
    c.t += 0.5
    tl.served({"gen0": 2})
    assert tl.row([], train_s=0.0, publish=None, announce_s=None)["time/weight_delivery"] == 0.5
    tl.served({"gen0": 2})
    assert "time/weight_delivery" not in tl.row([], train_s=0.0, publish=None, announce_s=None)
