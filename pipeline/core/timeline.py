"""Where one training step's time goes: the ``time/*`` keys of each metrics.jsonl row.

The coordinator feeds one ``StepTimeline`` as things happen and merges ``row()`` into the
step's metrics (docs/PERFORMANCE.md "Per-step timeline" reads them):

    tl.intake_start() / tl.intake_end()   around each intake.receive (rollouts in)
    tl.step_started()                     a step is handed to the trainer (its wait ends)
    tl.announced(v)                       weight version v announced to the generators
    tl.served(v, serving)                 a generator acknowledged a version: v is delivered
                                          once every connected generator serves >= v
    row = tl.row(rolls, train_s=..., publish=..., announce_s=...)   once per completed step

Keys (seconds; absent when the step had nothing to measure):

- ``time/train``: the trainer's step (forward, backward, optimizer), on the trainer thread;
- ``time/publish``: the publication's hash and write (learner.publish), and
  ``time/publish_<stage>`` for each stage the trainer reports (the megatron backend's
  ``gather``, in ``SnapshotResult.stage_s`` or the Publication's; the publication's own
  ``blob``, ``digest`` and ``write``, weights.publication.Publication.stage_s). With publish.max_pending > 0 (weights.pending)
  the step's row has ``time/publish_snapshot`` (gather + copy, on the critical path) and
  ``time/publish_room_wait``; the hash and write run beside the next step, so ``time/publish``
  (with its ``_blob``, ``_digest``, ``_write``), ``time/publish_lag`` (handed over -> announced)
  and ``time/publish_announce`` come in the row
  of the step during which the version was announced (summed if several were);
- ``time/publish_announce``: digests.jsonl + the announcement (+ chunking) on the coordinator;
- ``time/weight_delivery``: announce -> the last connected generator acknowledged serving the
  newest version delivered since the previous row (transfer + verify + engine load);
- ``time/dispatch_wait``: the trainer idle before this step, waiting for complete groups;
- ``time/generation``: mean engine time of the engine batches that produced the step's
  rollouts (the rollouts' ``gen_time_s``), ``time/reward`` the reward seconds summed over
  them (``reward_time_s``), ``time/queue`` their mean wait on the generator before the
  engine (``queue_time_s``);
- ``time/intake``: coordinator seconds spent taking rollouts in (decode excluded: the
  transport decodes) since the previous row.

- ``mem/peak_gib``: the learner process's peak CUDA memory allocated so far (GiB, the largest
  over its visible devices; absent when this process has not initialised CUDA).

The generator's engine load of a version alone is not reported back by the wire messages
(the weights Ack carries only the version): it is inside ``time/weight_delivery``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class StepTimeline:
    """See the module docstring. Single-threaded: called from the coordinator's thread."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._idle_since = clock()
        self._wait = 0.0
        self._intake = 0.0
        self._intake_t0: float | None = None
        self._announced: dict[int, float] = {}
        self._delivered: float | None = None

    def intake_start(self) -> None:
        self._intake_t0 = self.clock()

    def intake_end(self) -> None:
        if self._intake_t0 is not None:
            self._intake += self.clock() - self._intake_t0
            self._intake_t0 = None

    def step_started(self) -> None:
        self._wait = self.clock() - self._idle_since

    def step_done(self) -> None:
        """The trainer is idle again (the step's row was made)."""
        self._idle_since = self.clock()

    def announced(self, version: int) -> None:
        self._announced[version] = self.clock()

    def served(self, serving: Mapping[str, int]) -> None:
        """Every connected generator's acknowledged version: the newest announced version all
        of them serve is delivered (its announce -> now)."""
        if not serving or not self._announced:
            return
        low = min(serving.values())
        done = [v for v in self._announced if v <= low]
        if done:
            now = self.clock()
            self._delivered = now - self._announced[max(done)]
            for v in done:
                del self._announced[v]

    def row(self, rolls: Sequence[Any], *, train_s: float, publish: Mapping[str, float] | None,
            announce_s: float | None) -> dict[str, float]:  # fmt: skip
        out: dict[str, float] = {"time/train": train_s, "time/dispatch_wait": self._wait,
                                 "time/intake": self._intake}  # fmt: skip
        for key, stage in (("gen_time_s", "generation"), ("queue_time_s", "queue")):
            vals = [float(r.metrics[key]) for r in rolls if key in r.metrics]
            if vals:
                out[f"time/{stage}"] = sum(vals) / len(vals)
        rew = [float(r.metrics["reward_time_s"]) for r in rolls if "reward_time_s" in r.metrics]
        if rew:
            out["time/reward"] = sum(rew)
        if publish:
            out.update({("time/publish" if k == "total" else f"time/publish_{k}"): float(s)
                        for k, s in publish.items()})  # fmt: skip
        if announce_s is not None:
            out["time/publish_announce"] = announce_s
        if self._delivered is not None:
            out["time/weight_delivery"] = self._delivered
            self._delivered = None
        peak = cuda_peak_gib()
        if peak is not None:
            out["mem/peak_gib"] = peak
        self._intake = 0.0
        return out


def cuda_peak_gib() -> float | None:
    """torch.cuda.max_memory_allocated in GiB, the largest over the visible devices, when
    this process has initialised CUDA (torch is not imported here: the CPU path stays free)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    n = torch.cuda.device_count()
    return max(torch.cuda.max_memory_allocated(d) for d in range(n)) / 2**30 if n else None
