"""What the coordinator needs from a trainer, and weight publications (HF dir + blob + digest).

Order of calls (learner rank 0; other ranks, if any, follow the same trainer calls)::

    cfg = with_learner_threads(cfg, n)                 # learner.threads auto -> a number, once,
                                                       # before the run's config.yaml is written
    trainer = build_trainer(backend, cfg, model_dir)   # megatron (learner.trainer) or reference;
                                                       # torch's threads set to learner.threads
    ckpt = trainer.latest(run_dir)                     # on --resume
    state = trainer.load(ckpt)                         # -> the pipeline_state saved with it
    res = trainer.step(rollouts, flags, bounds)        # one training step on complete groups:
                                                       # a StepResult (its metrics, and each
                                                       # rollout's measured log-prob mismatch);
                                                       # res.refused non-empty: a rollout's
                                                       # log-probs were over its bound, the step
                                                       # was refused and nothing applied
                                                       # (bounds None: replay, nothing refused)
    pub = trainer.publish(out_dir, version)            # current weights, HF layout, written to
                                                       # out_dir (= RUN_DIR/weights/v<version>);
                                                       # the Publication the coordinator announces
                                                       # (None on learner ranks > 0); its stage
                                                       # seconds in pub.stage_s
    taken = trainer.snapshot(out_dir, version)         # the same in two parts: the weights taken
    pub = taken.finish()                               # now (the gather, a copy; its seconds in
                                                       # taken.stage_s), the hash and write later,
                                                       # on any thread, while the next step trains;
                                                       # None: no two-part publication (publish)
    trainer.save(run_dir, pipeline_state, keep)        # trainer state + the opaque pipeline dict
    trainer.audit(rollouts)                            # optional (both backends have it): per
                                                       # rollout, max |log-prob at the published
                                                       # weights that sampled it - claim|, None
                                                       # where those are gone: rule
                                                       # logp_mismatch's verdict on a stale
                                                       # rollout over its bound
                                                       # (pipeline.backends.audit)

What ``step`` and ``snapshot`` return, ``StepResult`` and ``SnapshotResult``, is in
pipeline/backends/results.py (the backends import it; this module imports the backends).
``weights.publication.Publication`` is what goes to the generators: the directory, the blob
(every tensor's canonical bytes in sorted-name order, the order of the ``TensorMeta`` offsets)
and the canonical digest (weights.digest) that generator.engine.LoopedEngine.load_weights
verifies (docs/CONTRACTS.md, contract 6). The trainer's publish computes it once (megatron: from
the state it writes; reference: ``Publication.from_dir`` on what it wrote); non-finite weights
are refused (models.errors.NonFiniteWeightsError) and never written or announced.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.backends.results import SnapshotResult, StepResult
from pipeline.config.run import RunConfig
from proto.records import Rollout
from weights.publication import Publication

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """The learner's training side as the coordinator sees it (see the module docstring)."""

    def step(
        self, rollouts: Sequence[Rollout], needs_correction: Sequence[bool],
        logp_bounds: Sequence[float] | None = None,
    ) -> StepResult: ...  # fmt: skip
    def publish(self, out_dir: Path, version: int) -> Publication | None: ...
    def snapshot(self, out_dir: Path, version: int) -> SnapshotResult | None: ...
    def save(self, run_dir: Path, pipeline_state: dict[str, Any], keep: int) -> Path: ...
    def latest(self, run_dir: Path) -> Path | None: ...
    def load(self, ckpt: Path) -> dict[str, Any]: ...
    def close(self) -> None: ...


def with_learner_threads(cfg: RunConfig, local_generator_threads: int = 0) -> RunConfig:
    """``cfg`` with ``learner.threads`` auto resolved to a number (learner.threads: the cores
    minus ``local_generator_threads`` on a CPU learner); a number is kept. The run records
    the result in config.yaml, so replay and a resume train with the same count."""
    from learner.threads import resolve_threads  # local: imports torch

    n = resolve_threads(cfg.learner.threads, local_generator_threads=local_generator_threads)
    if n == cfg.learner.threads:
        return cfg
    return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, threads=n))


def build_trainer(backend: str, cfg: RunConfig, model_dir: Path) -> Trainer:
    """The trainer for ``backend`` ("megatron", "reference", or "auto": megatron if
    learner.trainer is importable, else the reference trainer with a warning), with torch's
    intra-op threads set to ``learner.threads`` first (auto, unresolved: torch's own count)."""
    from learner.threads import apply_threads  # local: imports torch

    apply_threads(cfg.learner.threads)
    if backend in ("auto", "megatron"):
        try:
            # local: megatron-core may be missing (backend auto falls back to reference)
            from pipeline.backends.megatron_adapter import MegatronTrainer
        except ImportError as e:
            if backend == "megatron":
                raise ValueError(f"backend=megatron: learner.trainer is not usable ({e})") from e
            log.warning("learner.trainer not available (%s): using the reference trainer", e)
        else:
            return MegatronTrainer(cfg, model_dir)
    from pipeline.backends.reference_trainer import ReferenceTrainer  # local: as megatron's

    return ReferenceTrainer(cfg, model_dir)
