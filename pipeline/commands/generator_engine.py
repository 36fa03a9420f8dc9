"""What the generator process wraps around its engine (``looprl generator``, serve()):

- ``StopOnFailedLoad``: a weight set the engine cannot load stops the generator (its work
  handed back) unless the version was merely ``superseded`` (pruned while it was paused);
- ``multi_turn``: the engine driven as conversations with the run's environment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from generator.config import GeneratorConfig
from generator.environments import EnvCalls
from generator.multiturn import MultiTurnEngine
from models.chat import ChatError, ChatRenderer
from models.checkpoint import load_config as load_model_config
from models.errors import ConfigError
from weights.verified import VerifiedWeights

log = logging.getLogger(__name__)


class StopOnFailedLoad:
    """The loop's engine (generator.collaborators.Engine) around a LoopedEngine: the first weight
    set that fails to load calls ``on_failure(line)`` (the loop's ``stop``) and re-raises.

    Why a generator stops rather than serving on: the learner sends only its newest version,
    work soon needs it (``min_weight_version``), and after a few refusals the learner gives the
    generator up without telling it; an engine whose loader failed part way serves nothing
    (generator.engine.WeightLoadError). Stopping hands the work back at once, and a run whose
    generators all stopped fails fast (pipeline.commands.launcher)."""

    def __init__(self, engine: Any, on_failure: Callable[[str], None] | None = None,
                 batches: Any = None) -> None:  # fmt: skip
        self.engine, self.on_failure = engine, on_failure
        self.failure = ""
        """One line: the version that failed and why ('' while none did)."""
        self.batches = batches
        """A pipeline.core.profiling.StepProfiler over this engine's batches (the generator's
        profile_batches), or None."""
        self._done = 0

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    @property
    def inflight_updates(self) -> bool:
        """The engine swaps a version in between the steps of a running batch (the loop then
        loads beside the batch); without this the loop waited for every batch to end."""
        return bool(getattr(self.engine, "inflight_updates", False))

    @property
    def broken(self) -> str:
        return str(getattr(self.engine, "broken", "") or "")

    def notify_swaps(self, callback: Callable[[], None]) -> None:
        """``callback`` once a version staged during a batch is served, for an engine that
        says so (the torch engine's ``on_swapped``); nothing otherwise."""
        if hasattr(self.engine, "on_swapped"):
            self.engine.on_swapped = callback

    def generate(self, items: list[Any]) -> list[list[Any]]:
        if self.batches is None:
            return self.engine.generate(items)  # type: ignore[no-any-return]
        self.batches.observe(self._done)  # the window opens before its first batch
        try:
            return self.engine.generate(items)  # type: ignore[no-any-return]
        finally:
            self._done += 1
            self.batches.observe(self._done)

    def load_weights(self, weights: VerifiedWeights) -> None:
        version = weights.version
        try:
            self.engine.load_weights(weights)
        except Exception as e:
            if superseded(weights.directory, version):  # refused, not fatal: the newest follows
                log.warning("weights v%d were pruned (a newer version was published meanwhile, "
                            "e.g. while this process was paused): waiting for the newest",
                            version)  # fmt: skip
                raise
            why = " ".join(str(e).split())[:500] or type(e).__name__
            if not why.startswith(f"weights v{version}"):
                why = f"weights v{version}: {type(e).__name__}: {why}"
            self.failure = f"cannot serve {why}"
            if self.on_failure is not None:
                self.on_failure(self.failure)
            raise


def superseded(directory: str, version: int) -> bool:
    """An on-disk version (publish.transport shared_fs: ``directory`` is RUN_DIR/weights/v<N>;
    "" for a set in memory) that is gone because newer versions were published and the old
    pruned (publish.keep): its directory is missing and a newer v<M> stands beside where it
    was. A generator that was paused past its announce meets this on resuming; a generator
    that cannot see the run's directory at all (no shared filesystem) does not, and stops as
    before."""
    if not directory:
        return False
    path = Path(directory)
    if path.exists() or not path.parent.is_dir():
        return False
    newer = (d.name[1:] for d in path.parent.iterdir() if d.name.startswith("v"))
    return any(n.isdigit() and int(n) > version for n in newer)


def multi_turn(cfg: GeneratorConfig, engine: Any, env: Any) -> MultiTurnEngine:
    """``engine`` driven as conversations with ``env`` (generator.multiturn): observations are
    rendered under ``template`` (task.template: the checkpoint's chat template, or plain text); the whole conversation stays within the engine's
    max_model_len (the checkpoint's context length when 0); each environment call
    runs under ``reward_timeout_s`` in threads (inline with reward_mode inline)."""

    mc = load_model_config(cfg.model)  # Huginn names its context length block_size
    length = cfg.max_model_len or int(getattr(mc, "max_position_embeddings", 0) or mc.block_size)
    calls = EnvCalls(cfg.reward_timeout_s, "inline" if cfg.reward_mode == "inline" else "thread")
    try:
        renderer = ChatRenderer.from_checkpoint(cfg.model, template=cfg.template)
    except ChatError as e:
        raise ConfigError(f"generator config template={cfg.template!r}: {e}") from None
    return MultiTurnEngine(engine, env, renderer,
                           max_turns=cfg.max_turns, max_env_tokens=cfg.max_env_tokens,
                           max_model_len=length, calls=calls)  # fmt: skip
