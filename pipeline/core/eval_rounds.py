"""Evaluation during training, run by the generators (``eval.every`` > 0; docs/TASKS.md).

The loop, on the coordinator's thread::

    rounds = EvalRounds(prompts, ...)                 # the eval split, rendered as for training
    after step s published version v: if rounds.due(s): rounds.start(s, v)
    dispatcher.pump(...)  -> rounds.next_item(gid, version)   # eval items first, within the
                                                             # generator's max_inflight
    RolloutBatch with eval work ids (``e<round>-<i>``) -> rounds.receive(gid, rollouts) -> Acks
    generator gone / WorkReturn -> rounds.release(gid, work_ids)   # sent again elsewhere
    a round complete -> on_result(step, {"eval/accuracy", "eval/mean@n", "eval/n",
                                         "eval/reward_mean", "eval/version", "eval/version_max",
                                         "eval/prompts", "eval/s", "eval/mean_depth",
                                         and per fixed depth d of ``depths`` (eval.depths):
                                         "eval/accuracy@d", "eval/mean@n@d",
                                         "eval/mean_depth@d"})

Fixed depths: each round sends every prompt once under the run's exit policy (work ids
``e<round>-<i>``) and once per d in ``depths`` with ``WorkItem.eval_depth = d`` (ids
``e<round>-d<d>-<i>``, the same latent seeds), which a generator runs under FixedDepth(d)
(generator.depth_engines). A rollout of such an item whose exit depths are not all d (a
generator that ignored the field: protocol < 1.4) is refused and its item sent again. The mean
depth is the token mean of the rollouts' exit depths (token 0 included).

Invariants: eval work never enters the ledger, the staleness gate, the training stream or the
step log, and its rollouts are never trained; every eval item is answered by a generator that
serves the round's version (``min_weight_version`` = v) or is sent again; each (prompt,
sample) counts once (late duplicates are acknowledged and ignored). Accuracy is pass@1 (the
first sample of each prompt) and mean@n (all samples), with the task reward's ``correct``
(`correct_of` below).

A generator's own score is not believed: with ``rescore`` (``reward_rescorer``: the run's
reward on the completion's tokens and text, decoded with the model's tokenizer, on the
learner; ``environment_rescorer`` with task.environment: the environment replays the
conversation's model turns, and its observations must be the recorded ones) every eval rollout
is scored again and that score counts; a claim that differs, or a conversation the environment
does not reproduce (``counts["env_mismatch"]``), is counted per generator
(``counts["rescored_differ"]``, ``lied``) and logged (rate-limited). What stays trusted with an
environment: that it is deterministic given the task and the model turns (an environment that
is not scores as a mismatch, never as the generator's claim).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from generator.reward_runner import RewardRunner
from models.errors import ConfigError
from models.noise import derive_latent_seed
from pipeline.net.log_limit import RateLimitedLog
from proto.records import Ack, Nack, Rollout, WorkItem

log = logging.getLogger(__name__)
Rescore = Callable[
    [list[int], dict[str, Any], "np.ndarray | None"], tuple[float | None, dict[str, Any]]
]
"""(completion tokens, the item's task, the rollout's token_mask) -> (reward or None on
failure, reward info)."""


def reward_rescorer(reward: str, model_dir: Path, timeout_s: float = 30.0) -> Rescore:
    """The run's reward (``task.reward``) computed on the learner: the text is decoded from the
    tokens with ``model_dir``/tokenizer.json as a looprl generator decodes it (empty without
    one), the call runs in a thread with ``timeout_s`` (generator.reward_runner)."""
    path = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(path)) if path.is_file() else None
    runner = RewardRunner(reward, timeout_s=timeout_s, workers=1, mode="thread")

    def score(tokens: list[int], task: dict[str, Any],
              mask: np.ndarray | None = None) -> tuple[float | None, dict[str, Any]]:  # fmt: skip
        text = tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""
        res = runner.score_many([(text, tokens, dict(task))])[0]
        return res.reward, dict(res.info)

    return score


def environment_rescorer(
    environment: str, model_dir: Path, *, template: str = "auto", max_turns: int = 8,
    max_env_tokens: int = 512, timeout_s: float = 10.0,
) -> Rescore:  # fmt: skip
    """The run's environment (``task.environment``) replaying each eval conversation on the
    learner (generator.multiturn.replay_conversation): the same environment class, built with
    the generators' config, observations rendered with ``model_dir``'s tokenizer under
    ``template`` (task.template), every reset / step call in a thread under ``timeout_s``.
    The learner's score is the environment's on the recorded model turns; a transcript whose
    observations are not what the environment answers scores 0 (info env_mismatch)."""
    from generator.environments import EnvCalls, resolve_environment
    from generator.multiturn import replay_conversation
    from models.chat import ChatError, ChatRenderer

    try:
        env = resolve_environment(environment, {"max_turns": max_turns,
                                                "max_env_tokens": max_env_tokens})  # fmt: skip
        renderer = ChatRenderer.from_checkpoint(model_dir, template=template)
    except (ValueError, ChatError) as e:
        raise ConfigError(f"run config task.environment={environment!r}: {e}") from None
    calls = EnvCalls(timeout_s, "thread")

    def score(tokens: list[int], task: dict[str, Any],
              mask: np.ndarray | None = None) -> tuple[float | None, dict[str, Any]]:  # fmt: skip
        reward, info = replay_conversation(env, renderer, dict(task), tokens,
                                           None if mask is None else mask.tolist(), calls)  # fmt: skip
        return reward, dict(info)

    return score


EvalDoor = Callable[[str, Rollout, WorkItem], tuple[Rollout, Any, str | None]]
"""(generator, rollout, its eval item) -> (the rollout as the door sees it, refusal or None,
a ban or None): pipeline.core.intake.Intake.check_eval."""

EVAL_PREFIX = "e"


def is_eval_work(work_id: str) -> bool:
    return work_id.startswith(EVAL_PREFIX)


@dataclass
class _Round:
    step: int
    version: int
    started: float
    items: dict[str, WorkItem]
    results: dict[str, dict[int, tuple[float | None, dict[str, Any]]]] = field(default_factory=dict)
    reported: bool = False
    versions: list[int] = field(default_factory=list)
    depth_sums: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    """work id -> sample -> (sum of the rollout's exit depths, its tokens)."""

    def done(self) -> bool:
        return all(
            len(self.results.get(w, {})) == len(it.latent_seeds) for w, it in self.items.items()
        )


class EvalRounds:
    """See the module docstring."""

    def __init__(
        self,
        prompts: Sequence[Any],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        run_seed: int,
        stop: Sequence[str] = (),
        every: int,
        last_step: int,
        on_result: Callable[[int, dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
        rescore: Rescore | None = None,
        depths: Sequence[int] = (),
    ) -> None:
        self.prompts, self.n, self.temperature = list(prompts), n, temperature
        self.max_tokens, self.stop_ids, self.stop = max_tokens, list(stop_token_ids), list(stop)
        self.run_seed, self.every, self.last_step = run_seed, every, last_step
        self.on_result, self.clock = on_result, clock
        self.rounds: dict[int, _Round] = {}
        self.queue: deque[WorkItem] = deque()
        self.held: dict[str, dict[str, WorkItem]] = {}  # generator -> work id -> item
        self.counts = {"rounds": 0, "items_sent": 0, "resent": 0, "duplicates": 0, "refused": 0,
                       "rescored_differ": 0, "env_mismatch": 0}  # fmt: skip
        self.rescore = rescore  # the learner's own score of each eval completion, if set
        self.depths = list(depths)  # fixed depths evaluated beside the run's policy
        self.lied: Counter[str] = Counter()  # generator -> eval scores that differed from ours
        self._warn = RateLimitedLog(log, 30.0, clock)

    def due(self, step: int) -> bool:
        """After step ``step``: every ``every`` steps and the last one (the run starts a round
        at step 0 too, on the starting weights, reported with step 1)."""
        return bool(self.prompts) and (step % self.every == 0 or step == self.last_step)

    def start(self, step: int, version: int) -> None:
        r = len(self.rounds)
        items = {}
        for depth, (i, p) in ((d, ip) for d in [0, *self.depths] for ip in enumerate(self.prompts)):
            wid = f"{EVAL_PREFIX}{r}-{i}" if depth == 0 else f"{EVAL_PREFIX}{r}-d{depth}-{i}"
            seeds = [
                derive_latent_seed(self.run_seed, f"eval/{p.prompt_id}", j) for j in range(self.n)
            ]
            items[wid] = WorkItem(
                work_id=wid, prompt_id=p.prompt_id,
                prompt_tokens=np.asarray(p.tokens, dtype=np.int32),
                latent_seeds=np.asarray(seeds, dtype=np.uint64), temperature=self.temperature,
                top_p=1.0, max_tokens=self.max_tokens, stop_token_ids=list(self.stop_ids),
                stop=list(self.stop),
                task=dict(p.task), min_weight_version=version, issued_at=time.time(),
                eval_depth=depth,
            )  # fmt: skip
        self.rounds[r] = _Round(step, version, self.clock(), items)
        self.queue.extend(items.values())
        self.counts["rounds"] += 1

    def pending(self) -> bool:
        return any(not rd.done() for rd in self.rounds.values())

    def next_item(self, gid: str, version: int) -> WorkItem | None:
        """The next eval item a generator that will serve ``version`` may take."""
        for _ in range(len(self.queue)):
            item = self.queue.popleft()
            if version >= item.min_weight_version:
                self.held.setdefault(gid, {})[item.work_id] = item
                self.counts["items_sent"] += 1
                return item
            self.queue.append(item)
        return None

    def release(self, gid: str, work_ids: Sequence[str] | None = None) -> int:
        """A generator died or handed work back: its unanswered eval items go out again."""
        held = self.held.get(gid, {})
        ids = list(held) if work_ids is None else [w for w in work_ids if w in held]
        for w in ids:
            self.queue.appendleft(held.pop(w))
            self.counts["resent"] += 1
        return len(ids)

    def receive(self, gid: str, rollouts: Sequence[Rollout], door: EvalDoor | None = None
                ) -> tuple[list[Ack | Nack], str | None]:  # fmt: skip
        """Eval rollouts from ``gid``: each through the learner's door (``door``: the rollout
        as the door sees it, a NaN/inf reward made a failed one, the reason it is refused or
        None, and a ban the refusals decided or None), then recorded once per (item, sample)
        and acknowledged. A refused one is answered with a Nack and its item goes out again
        (to any generator). Returns the replies and the first ban (the caller carries it out)."""
        acks: list[Ack | Nack] = []
        ban: str | None = None
        for ro in rollouts:
            rd = self.rounds.get(_round_of(ro.work_id))
            item = rd.items.get(ro.work_id) if rd is not None else None
            if rd is None or item is None:
                acks.append(Ack("rollout", ro.rollout_id))
                self.counts["duplicates"] += 1
                continue
            ro, why, banned = door(gid, ro, item) if door is not None else (ro, None, None)
            ban = ban or banned
            d = item.eval_depth
            if why is None and d and ro.exit_depths.size and bool((ro.exit_depths != d).any()):
                why = (f"eval_depth: the item asks for depth {d}, the rollout ran depths "
                       f"{sorted({int(x) for x in ro.exit_depths})} (protocol >= 1.4 needed)")  # fmt: skip
            if why is not None:
                acks.append(Nack("rollout", ro.rollout_id, f"refused: {why}"))
                self.counts["refused"] += 1
                self.release(gid, [ro.work_id])
                continue
            acks.append(Ack("rollout", ro.rollout_id))
            if self.rescore is not None:
                ro = self._rescored(gid, ro, item)
            seeds = [int(s) for s in item.latent_seeds]
            idx = seeds.index(int(ro.latent_seed)) if int(ro.latent_seed) in seeds else -1
            got = rd.results.setdefault(ro.work_id, {})
            if idx < 0 or idx in got:
                self.counts["duplicates"] += 1
                continue
            got[idx] = (ro.reward, dict(ro.reward_info))
            ed = ro.exit_depths
            rd.depth_sums.setdefault(ro.work_id, {})[idx] = (float(ed.sum()), int(ed.size))
            rd.versions.append(int(ro.weight_version))
            if len(got) == len(seeds):
                self.held.get(gid, {}).pop(ro.work_id, None)
        for rd in list(self.rounds.values()):
            if rd.done() and not rd.reported:
                rd.reported = True
                self.on_result(rd.step, self._metrics(rd))
        return acks, ban

    def _rescored(self, gid: str, ro: Rollout, item: WorkItem) -> Rollout:
        """``ro`` with the learner's score; a claim that differs is counted against ``gid``."""
        assert self.rescore is not None
        reward, info = self.rescore([int(t) for t in ro.tokens], dict(item.task), ro.token_mask)
        claimed = ro.reward
        mismatch = bool(info.get("env_mismatch"))  # a transcript the environment does not give
        self.counts["env_mismatch"] += int(mismatch)
        differ = mismatch or (
            claimed is not None
            and reward is not None
            and (  # a failure is no claim
                not math.isclose(claimed, reward, rel_tol=1e-6, abs_tol=1e-9)
                or correct_of(claimed, dict(ro.reward_info)) != correct_of(reward, info)
            )
        )
        if differ:
            self.counts["rescored_differ"] += 1
            self.lied[gid] += 1
            self._warn.warn(gid, "eval_reward", "generator %s: eval rollout %s claims reward %r "
                            "(correct %s); the learner scores it %r (correct %s): the learner's "
                            "score counts", gid, ro.rollout_id, claimed,
                            correct_of(claimed, dict(ro.reward_info)), reward,
                            correct_of(reward, info))  # fmt: skip
        return dataclasses.replace(ro, reward=reward, reward_info=info)

    def _scores(self, rd: _Round, depth: int) -> tuple[float, float, float, float, int]:
        """(pass@1, mean@n, reward mean, token-mean exit depth, prompts) of the round's items
        at ``depth`` (0: the run's policy)."""
        first, every_sample, rewards, dsum, dn, prompts = [], [], [], 0.0, 0, 0
        for w, it in rd.items.items():
            if it.eval_depth != depth:
                continue
            prompts += 1
            res = rd.results[w]
            for j in sorted(res):
                reward, info = res[j]
                ok = correct_of(reward, info)
                every_sample.append(ok)
                rewards.append(float(reward or 0.0))
                if j == 0:
                    first.append(ok)
            for s_, c in rd.depth_sums.get(w, {}).values():
                dsum, dn = dsum + s_, dn + c
        return (sum(first) / max(len(first), 1), sum(every_sample) / max(len(every_sample), 1),
                sum(rewards) / max(len(rewards), 1), dsum / dn if dn else float("nan"), prompts)  # fmt: skip

    def _metrics(self, rd: _Round) -> dict[str, Any]:
        acc, mean_n, reward, depth, prompts = self._scores(rd, 0)
        out: dict[str, Any] = {
            "eval/accuracy": acc,
            "eval/mean@n": mean_n,
            "eval/n": self.n,
            "eval/reward_mean": reward,
            "eval/mean_depth": depth,
            "eval/version": min(rd.versions, default=rd.version),
            "eval/version_max": max(rd.versions, default=rd.version),
            "eval/prompts": prompts,
            "eval/s": self.clock() - rd.started,
        }
        for d in self.depths:
            acc, mean_n, _, depth, _ = self._scores(rd, d)
            out[f"eval/accuracy@{d}"] = acc
            out[f"eval/mean@n@{d}"] = mean_n
            out[f"eval/mean_depth@{d}"] = depth
        return out


def check_depths(depths: Sequence[int], model_max_depth: int, looped: bool) -> None:
    """ConfigError naming eval.depths unless the served model can run every depth of
    ``depths``: a depth-1 model (llama) runs depth 1 only; a looped one any depth up to
    MAX_DEPTH (deeper than its ``model_max_depth`` = thinking longer than it was trained to)."""
    if not looped and any(d != 1 for d in depths):
        raise ConfigError(
            f"run config eval.depths={list(depths)!r}: the model is a depth-1 family (no "
            f"loops, max_depth {model_max_depth}): only [1] or [] is possible"
        )


def correct_of(reward: float | None, info: dict[str, Any]) -> bool:
    """A scored completion counts as correct: never when its reward failed (None: an error,
    a timeout, or a NaN/inf reward the door made a failure); else info["correct"] if the
    reward sets it, else reward >= 1."""
    if reward is None:
        return False
    if "correct" in info:
        return bool(info["correct"])
    return reward is not None and reward >= 1.0


def _round_of(work_id: str) -> int:
    try:
        return int(work_id[len(EVAL_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1
