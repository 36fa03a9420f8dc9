"""pipeline.core.peers.Peers on fakes (no coordinator, no transport): a banned generator stays
banned under its first reason, and whatever it sends later reaches neither the intake, the
dispatcher nor the publisher (only counted, ``from_banned``; a Hello is answered "banned");
one ``poll`` handles what arrived, then declares the silent gone, then bans a generator
that swallowed work ``MAX_WORK_TIMEOUTS`` times (docs/PIPELINE.md, "The coordinator loop")."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np

from pipeline.core.intake import IntakeResult, RefusalTracker
from pipeline.core.peers import MAX_WORK_TIMEOUTS, Peers
from pipeline.core.timeline import StepTimeline
from proto.records import ErrorMsg, Goodbye, Heartbeat, Hello, Rollout, RolloutBatch, Welcome
from weights.deliveries import DeliveryLog


class Log:
    """One list of what every fake was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *call: Any) -> None:
        self.calls.append(call)

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


class FakeEndpoint:
    def __init__(self, log: Log) -> None:
        self.log, self.inbox, self.expired = log, [], []  # type: ignore[var-annotated]
        self.config = SimpleNamespace(heartbeat_interval_s=1.0)

    def send(self, peer: str, rec: Any) -> bool:
        self.log("send", peer, rec)
        return True

    def recv(self, timeout_s: float) -> Any:
        return self.inbox.pop(0) if self.inbox else None

    def expired_peers(self) -> list[str]:
        out, self.expired = self.expired, []
        return out


class FakeDispatcher:
    def __init__(self, log: Log) -> None:
        self.log, self.timeouts = log, Counter()  # type: ignore[var-annotated]

    def incarnation(self, gid: str) -> Any:
        return None

    def add_generator(self, gid: str, max_inflight: int, v: int, inc: Any) -> None:
        self.log("add_generator", gid, v)

    def set_version(self, gid: str, v: int) -> None:
        self.log("set_version", gid, v)

    def remove_generator(self, gid: str) -> int:
        self.log("remove_generator", gid)
        return 2

    def overdue(self, timeout_s: float) -> int:
        self.log("overdue", timeout_s)
        return 0


class FakePublisher:
    def __init__(self, log: Log) -> None:
        self.log, self.gens = log, {}  # type: ignore[var-annotated]

    def generators(self) -> dict[str, int]:
        return dict(self.gens)

    def add_generator(self, gid: str, v: int) -> None:
        self.log("publisher_add", gid)
        self.gens[gid] = v

    def remove_generator(self, gid: str) -> None:
        self.log("publisher_remove", gid)
        self.gens.pop(gid, None)

    def observe(self, gid: str, v: int) -> None:
        self.log("observe", gid, v)

    def target(self, gid: str) -> int:
        return -1

    def gave_up(self, gid: str) -> bool:
        return False


class FakeIntake:
    def __init__(self, log: Log) -> None:
        self.log, self.counts = log, Counter()  # type: ignore[var-annotated]
        self.refusals = RefusalTracker(3, 60.0, lambda: 0.0)

    def receive(self, peer: str, rec: Any) -> IntakeResult:
        self.log("receive", peer, len(rec.rollouts))
        return IntakeResult()

    def void_generator(self, gid: str) -> int:
        self.log("void_generator", gid)
        return 1


def _peers(work_timeout_s: float = 0.0) -> tuple[Peers, FakeEndpoint, Log, FakeIntake]:
    log = Log()
    ep, intake = FakeEndpoint(log), FakeIntake(log)
    p = Peers(ep, dispatcher=FakeDispatcher(log), publisher=FakePublisher(log),  # type: ignore[arg-type]
              intake=intake, deliveries=DeliveryLog(), timeline=StepTimeline(), evals=None,  # type: ignore[arg-type]
              run_id=lambda: "run", version=lambda: 0, welcome_settings={"numerics": "fast"},
              exit_policy=None,
              work_timeout_s=work_timeout_s, clock=lambda: 0.0)  # fmt: skip
    return p, ep, log, intake


def _hello(gid: str) -> Hello:
    return Hello(gid, "host", 1, ["fake"], 2, 0, 0.0)


def _batch(gid: str) -> RolloutBatch:
    r = Rollout(rollout_id="w0/0", work_id="w0", prompt_id="p0", sample_index=0,
                generator_id=gid, latent_seed=1, prompt_tokens=np.array([1], np.int32),
                tokens=np.array([5], np.int32), logprobs=np.array([-1.0], np.float32),
                exit_depths=np.array([4], np.uint8), weight_version=0, reward=0.0)  # fmt: skip
    return RolloutBatch([r])


def test_a_banned_generators_later_records_are_ignored_and_counted() -> None:
    p, ep, log, intake = _peers()
    p.handle("control", "g", _hello("g"))
    assert isinstance(log.of("send")[-1][2], Welcome) and log.of("add_generator")
    p.handle("control", "g", _batch("g"))
    assert log.of("receive") == [("receive", "g", 1)]
    p.ban("g", "lied")
    assert p.banned == {"g": "lied"}
    assert log.calls[-4:] == [("send", "g", ErrorMsg("banned", "dropped for this run: lied")),
                              ("remove_generator", "g"), ("publisher_remove", "g"),
                              ("void_generator", "g")]  # fmt: skip
    before = list(log.calls)
    p.handle("control", "g", _batch("g"))
    p.handle("control", "g", Heartbeat("g", 0.0, 0, 0))
    p.handle("control", "g", Goodbye("g", "bye"))
    p.handle("weights", "g", Heartbeat("g", 0.0, 0, 0))
    assert log.calls == before and intake.counts["from_banned"] == 4  # nothing reached anyone
    p.handle("control", "g", _hello("g"))  # a Hello is told why, and nothing else happens
    assert log.calls == [*before, ("send", "g", ErrorMsg("banned", "dropped for this run: lied"))]
    assert intake.counts["from_banned"] == 5
    p.ban("g", "a second reason")  # banned once: its first reason stays, nothing sent again
    assert p.banned == {"g": "lied"} and len(log.of("send")) == 3


def test_poll_handles_records_then_departures_then_work_timeouts() -> None:
    p, ep, log, intake = _peers(work_timeout_s=30.0)
    ep.inbox = [SimpleNamespace(channel="control", peer=g, record=_hello(g)) for g in "abc"]
    ep.expired = ["b"]
    p.dispatcher.timeouts["c"] = MAX_WORK_TIMEOUTS  # type: ignore[attr-defined]
    assert p.poll(0.0) == 3
    order = [c[:2] for c in log.calls if c[0] in ("add_generator", "remove_generator", "overdue")]
    assert order == [("add_generator", "a"), ("add_generator", "b"), ("add_generator", "c"),
                     ("remove_generator", "b"), ("overdue", 30.0),
                     ("remove_generator", "c")]  # fmt: skip
    assert "work_timeout_s=30" in p.banned["c"] and "b" not in p.banned
