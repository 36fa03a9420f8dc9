"""Fixed-depth evaluation on a generator: work items with ``eval_depth`` d > 0 (eval.depths,
pipeline.core.eval_rounds) run under ``FixedDepth(d)``, every other item under the run's own
exit policy.

    engines = DepthEngines(main, build=lambda d: LoopedEngine(..., exit_policy=FixedDepth(d)))
    engines.generate(items)   # items grouped by eval_depth; main serves eval_depth 0 (and d
                              # when the main policy is FixedDepth(d)); one engine per other
                              # depth, built on first use, results in the order of ``items``
    engines.load_weights(weights)   # main at once; the others before their next generate
                                    # (the last VerifiedWeights is kept)

The vLLM plugin sizes its KV cache by the policy's depth when the engine is built (one
attention slot per core iteration), so a depth the main engine does not run needs an engine of
its own: built lazily, only where eval.depths asks, with the main engine's settings. A plain
(depth-1) model serves eval_depth 1 itself and refuses any other depth (its items fail the
batch: the learner never sends them, see EvalRounds.check_depths).

Invariant: a depth engine serves the same weight version as the main one whenever it
generates; its rollouts carry that version and exit depths all equal to d.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from models.exits import FixedDepth
from proto.records import WorkItem
from weights.verified import VerifiedWeights


class DepthEngines:
    """The Engine protocol (generator.collaborators.Engine) over a main engine plus one engine per
    extra fixed eval depth; see the module doc."""

    def __init__(self, main: Any, build: Callable[[int], Any], *, looped: bool = True,
                 main_fixed_depth: int = 0) -> None:  # fmt: skip
        self.main, self.build, self.looped = main, build, looped
        self.main_fixed_depth = main_fixed_depth  # d when the main policy is FixedDepth(d)
        self.engines: dict[int, Any] = {}
        self._last: VerifiedWeights | None = None  # the newest weights loaded

    @property
    def weight_version(self) -> int:
        return int(self.main.weight_version)

    def __getattr__(self, name: str) -> Any:  # broken, inflight_updates, ...: the main engine's
        return getattr(self.__dict__["main"], name)

    def load_weights(self, weights: VerifiedWeights) -> None:
        self.main.load_weights(weights)
        self._last = weights

    def _engine(self, depth: int) -> Any:
        if depth == 0 or depth == self.main_fixed_depth:
            return self.main
        if not self.looped:
            if depth == 1:
                return self.main
            raise ValueError(f"eval_depth {depth}: a depth-1 model runs only eval_depth 1")
        eng = self.engines.get(depth)
        if eng is None:
            eng = self.engines[depth] = self.build(depth)
        if self._last is not None and eng.weight_version < self._last.version:
            eng.load_weights(self._last)
        return eng

    def generate(
        self, items: list[WorkItem], sampling_offsets: Sequence[int] | None = None
    ) -> list[list[Any]]:
        out: list[list[Any] | None] = [None] * len(items)
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(int(it.eval_depth), []).append(i)
        for depth, idx in sorted(groups.items()):
            eng, sub = self._engine(depth), [items[i] for i in idx]
            res_ = (eng.generate(sub) if sampling_offsets is None else
                    eng.generate(sub, sampling_offsets=[sampling_offsets[i] for i in idx]))  # fmt: skip
            for i, res in zip(idx, res_):
                out[i] = res
        return [r for r in out if r is not None]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
        self.engines.clear()
        self.main.close()


def fixed_depth_of(policy: Any) -> int:
    """d for a FixedDepth(d) policy, else 0 (the main engine serves that eval depth)."""
    return int(policy.depth) if isinstance(policy, FixedDepth) else 0


__all__ = ["DepthEngines", "fixed_depth_of"]
