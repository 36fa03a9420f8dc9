"""What a trainer's calls return to the coordinator (the ``Trainer`` protocol of
pipeline/backends/trainer_api.py): one step's ``StepResult``, one snapshot's ``SnapshotResult``.
Typed results rather than attributes left on the trainer for the caller to read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from weights.publication import DeviceSnapshot, Publication


@dataclass(frozen=True)
class StepResult:
    """What one ``Trainer.step`` did: trainer -> coordinator (and replay, which reads nothing of
    it). Every trainer measures its rollouts' log-probs; one that checks them before its update
    (both backends: learner.step ``logp_bounds``) refuses a step holding a rollout over its
    bound, and one that does not (the tests' fakes) leaves ``refused`` empty: the coordinator
    then checks ``mismatch`` after the step (pipeline.core.verification)."""

    metrics: dict[str, float]
    """The step's metrics (metrics.jsonl ``train/<key>``); {"refused_rollouts": k} when refused."""
    refused: list[int] = field(default_factory=list)
    """The rollouts over their log-prob bound (indices into the step's input, in input order):
    the step was refused before its update, nothing applied. Empty when it trained."""
    mismatch: list[float] = field(default_factory=list)
    """Per rollout (input order): max |learner - behaviour| log-prob over its tokens (nats) at
    the step's starting weights; NaN (or -1) for a rollout not measured; empty when the trainer
    measures none."""


@dataclass(frozen=True)
class SnapshotResult:
    """What ``Trainer.snapshot`` took: the trainer's part of a two-part publication, done on
    the trainer thread; ``finish()`` hashes and writes the rest on any thread."""

    finish: Callable[[], Publication]
    """Builds the blob and digest and writes the directory (its seconds in ``stage_s`` of the
    Publication it returns)."""
    stage_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the taking's stages (megatron: ``gather``, the HF state gathered over TP)."""
    device: DeviceSnapshot | None = None
    """The taken tensors on the learner's GPU (megatron on CUDA; None on the CPU): what
    publish.transport=cuda_ipc announces from before, or instead of, ``finish()``."""
