"""Fakes for coordinator tests: an in-memory generator and a trainer that only records."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.backends.results import StepResult
from pipeline.config.run import RunConfig, load_config
from pipeline.core.coordinator import Coordinator
from pipeline.core.dispatch import Prompt, PromptSource
from pipeline.core.validation import ModelLimits
from pipeline.net.transport.config import TransportConfig
from pipeline.net.transport.memory import MemoryNetwork
from proto.records import (
    Ack,
    Heartbeat,
    Hello,
    Rollout,
    RolloutBatch,
    WeightAnnounce,
    Welcome,
    WorkItem,
)
from weights.publication import Publication


class FakeTrainer:
    """Records every batch; its "weights" are one tensor holding the step count."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.flags: list[list[bool]] = []
        self.versions_trained: list[list[int]] = []
        self.steps = 0

    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
        logp_bounds: Sequence[float] | None = None,
    ) -> StepResult:  # fmt: skip
        """Trains everything: checks no bound and measures no rollout."""
        self.batches.append([r.rollout_id for r in rollouts])
        self.flags.append(list(needs_correction))
        self.versions_trained.append([r.weight_version for r in rollouts])
        self.steps += 1
        return StepResult({"logprob_mismatch": 0.0})

    def publish(self, out_dir: Path, version: int) -> Publication:
        from models.checkpoint import save_checkpoint

        state = {"w": torch.tensor([float(self.steps)])}
        save_checkpoint(state, {"architectures": ["Fake"]}, out_dir)
        return Publication.from_dir(out_dir, version)

    def snapshot(self, out_dir: Path, version: int) -> None:
        """No two-part publication: the coordinator writes each version with ``publish``."""
        return None

    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path:
        path = run_dir / "checkpoints" / f"step_{self.steps:08d}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(
            json.dumps({"steps": self.steps, "pipeline": pipeline_state})
        )
        return path

    def latest(self, run_dir: Path) -> Path | None:
        found = sorted((run_dir / "checkpoints").glob("step_*"))
        return found[-1] if found else None

    def load(self, ckpt_dir: Path) -> dict[str, Any]:
        d = json.loads((ckpt_dir / "state.json").read_text())
        self.steps = d["steps"]
        return dict(d["pipeline"])

    def close(self) -> None:
        pass


def reference_trainer_and_pair(tmp: Path, lr: float = 0.1) -> tuple[Any, list[Rollout]]:
    """A backend=reference trainer on a fresh tiny Huginn (tmp/m) and one group of two
    FakeGenerator rollouts of work item w0 (prompt [1, 2], seeds 11 and 12)."""
    from models.random_init import init_checkpoint
    from pipeline.backends.reference_trainer import ReferenceTrainer

    init_checkpoint("huginn", "tiny", tmp / "m", seed=0)
    tr = ReferenceTrainer(load_config(None, [f"optimizer.lr={lr}"]), tmp / "m")
    g = FakeGenerator.__new__(FakeGenerator)
    g.gid, g.rng = "g0", random.Random(0)
    item = WorkItem("w0", "p0", np.array([1, 2], np.int32), np.array([11, 12], np.uint64))
    return tr, [g._rollout(item, i, s) for i, s in enumerate([11, 12])]


def generated_rollouts(gens: Sequence[Any], version: int, reward: float | None) -> list[Rollout]:
    """models.reference.generate's completions as the rollouts a generator sends (work item
    w<i>, sample 0, generator g0), sampled by weights ``version``."""
    return [
        Rollout(
            rollout_id=f"w{i}/0",
            work_id=f"w{i}",
            prompt_id=f"p{i}",
            sample_index=0,
            generator_id="g0",
            latent_seed=g.latent_seed,
            prompt_tokens=np.array(g.prompt_tokens, np.int32),
            tokens=np.array(g.tokens, np.int32),
            logprobs=g.logprobs.numpy(),
            exit_depths=np.array(g.exit_depths, np.uint8),
            full_depth=g.full_depth,
            weight_version=version,
            reward=reward,
        )  # fmt: skip
        for i, g in enumerate(gens)
    ]


FAKE_LIMITS = ModelLimits(vocab_size=64, max_depth=4)  # what FakeGenerator's rollouts fit
TCFG = TransportConfig(heartbeat_interval_s=0.5, peer_timeout_s=2.0)


class FakeGenerator:
    """Answers WorkItems with rollouts (reward = random), loads announced weights at once.

    ``number_from_zero``: number a partial re-dispatch's samples 0..k-1 (the bug intake
    corrects by latent seed). ``delay``: turns before a work item is answered.
    """

    def __init__(self, net: MemoryNetwork, gid: str, *, max_inflight: int = 2,
                 delay: int = 0, number_from_zero: bool = False, seed: int = 0,
                 clock: Any = None) -> None:  # fmt: skip
        hello = Hello(gid, "host", 1, ["fake"], max_inflight, 0, 0.0)
        kw = {"clock": clock} if clock is not None else {}
        self.conn = net.connect("learner", hello, TCFG, **kw)
        self.gid, self.delay, self.zero = gid, delay, number_from_zero
        self.version = 0
        self.queue: list[tuple[int, WorkItem, int]] = []  # (turns left, item, version or -1)
        self.sent: list[Rollout] = []
        self.rng = random.Random(seed)
        self.alive = True
        self.paused = False
        self.welcome: Welcome | None = None  # the last Welcome heard

    def step(self) -> None:
        if not self.alive:
            return
        inc = self.conn.recv(0.0)
        while inc is not None:
            rec = inc.record
            if isinstance(rec, WorkItem):  # started (and stamped) once its weights are here
                self.queue.append((self.delay, rec, -1))
            elif isinstance(rec, WeightAnnounce):
                self.version = rec.version
                self.conn.send(Ack("weights", str(rec.version), rec.version), channel="weights")
                # and on the control channel, ahead of rollouts claiming it (generator.loop)
                self.conn.send(Heartbeat(self.gid, time.time(), rec.version, len(self.queue)))
            elif isinstance(rec, Welcome):
                self.welcome = rec
            inc = self.conn.recv(0.0)
        self.conn.set_status(self.version, len(self.queue))
        if self.paused:
            return
        keep = []
        for wait, item, v in self.queue:
            if v < 0:  # like a real generator: never start below min_weight_version
                if self.version < item.min_weight_version:
                    keep.append((wait, item, v))
                    continue
                v = self.version
            if wait > 0:
                keep.append((wait - 1, item, v))
                continue
            idx = list(range(item.n)) if self.zero else item.indices()
            rolls = [self._rollout(item, i, int(s), v) for i, s in zip(idx, item.latent_seeds)]
            self.sent.extend(rolls)
            self.conn.send(RolloutBatch(rolls))
        self.queue = keep

    def _rollout(self, item: WorkItem, i: int, seed: int, version: int = 0) -> Rollout:
        return Rollout(
            rollout_id=f"{item.work_id}/{i}", work_id=item.work_id, prompt_id=item.prompt_id,
            sample_index=i, generator_id=self.gid, latent_seed=seed,
            prompt_tokens=item.prompt_tokens, tokens=np.array([5, 6], np.int32),
            logprobs=np.array([-1.0, -1.0], np.float32), exit_depths=np.array([4, 4], np.uint8),
            weight_version=version, reward=self.rng.random(),
        )  # fmt: skip

    def kill(self) -> None:
        """Vanish without Goodbye (like kill -9)."""
        self.alive = False


def prompts(k: int = 10) -> PromptSource:
    return PromptSource([Prompt(f"p{i}", [1, 18 + i % 10], {"i": i}) for i in range(k)], seed=0)


def make_coordinator(tmp: Path, overrides: list[str], *, net: MemoryNetwork | None = None,
                     trainer: FakeTrainer | None = None, clock: Any = None,
                     evals: Any = None, background: bool = False,
                     ) -> tuple[Coordinator, MemoryNetwork, FakeTrainer]:  # fmt: skip
    cfg: RunConfig = load_config(None, [f"run_dir={tmp}", "rollout.n=4", "rollout.prompts_per_step=2",
                                        "publish.keep=0", *overrides])  # fmt: skip
    net = net or MemoryNetwork()
    kw = {"clock": clock} if clock is not None else {}
    ep = net.bind("learner", TCFG, **kw)
    trainer = trainer or FakeTrainer()
    ckw = {"clock": clock} if clock is not None else {}
    c = Coordinator(cfg, endpoint=ep, trainer=trainer, prompts=prompts(), run_dir=tmp,
                    limits=FAKE_LIMITS, evals=evals, background=background, **ckw)  # fmt: skip
    return c, net, trainer


def drive(c: Coordinator, gens: list[FakeGenerator], steps: int, max_turns: int = 5000,
          hook: Any = None) -> None:  # fmt: skip
    """Alternate coordinator turns and generator steps until ``steps`` training steps."""
    for turn in range(max_turns):
        if c.step >= steps:
            return
        c.turn(0.0)
        for g in gens:
            g.step()
        if hook is not None:
            hook(turn)
    raise AssertionError(f"only {c.step} of {steps} steps after {max_turns} turns")


POISONS = ("reward_inf", "reward_nan", "token_oov", "depth_200", "too_long", "prompt", "seed",
           "claims_other", "future_version")  # fmt: skip
"""The ways a generator can send a rollout that decodes but is wrong (the door's rules,
pipeline/core/validation.py)."""


def poison(r: Rollout, kind: str) -> Rollout:
    """``r`` (a correct rollout at full depth ``r.exit_depths[0]``) made wrong in one way."""
    import dataclasses
    import math

    depth = int(r.exit_depths[0])
    change: dict[str, Any] = {
        "reward_inf": {"reward": math.inf},
        "reward_nan": {"reward": math.nan},
        "token_oov": {"tokens": np.array([5, 99999], np.int32)},
        "depth_200": {"exit_depths": np.array([200, depth], np.uint8)},
        "too_long": {
            "tokens": np.full(4000, 5, np.int32),
            "logprobs": -np.ones(4000, np.float32),
            "exit_depths": np.full(4000, depth, np.uint8),
        },  # fmt: skip
        "prompt": {"prompt_tokens": np.concatenate([r.prompt_tokens, [7]]).astype(np.int32)},
        "seed": {"latent_seed": (int(r.latent_seed) + 1) % (1 << 64)},
        "claims_other": {"generator_id": "someone-else"},
        "future_version": {"weight_version": r.weight_version + 7},
    }[kind]
    return dataclasses.replace(r, **change)


def drive_with_a_hole(tmp_path: Path, steps: int) -> tuple[Coordinator, FakeGenerator, Any]:
    """intake.work_timeout_s=30 on a fake clock one second a turn; generator "hole" takes
    work, acks weights and heartbeats but never generates, "g0" answers. Drives ``steps``
    training steps; returns (coordinator, hole, trainer)."""
    now = [0.0]
    c, net, t = make_coordinator(tmp_path, ["intake.work_timeout_s=30"])
    c.dispatcher.clock = lambda: now[0]
    hole = FakeGenerator(net, "hole", seed=2)
    hole.paused = True  # receives, acks weights, heartbeats; never generates
    honest = FakeGenerator(net, "g0", seed=1, delay=1)

    def tick(_turn: int) -> None:
        now[0] += 1.0

    drive(c, [hole, honest], steps, hook=tick)
    return c, hole, t
