"""The ``perf/*`` keys of every metrics row: where a step's time goes against what the hardware
could do, so a user sees it without a benchmark (the arithmetic is models.cost's).

Per step (``row``), over the rollouts it trained and its wall (``step_s``: since the previous
step ended):

- ``perf/samples_per_s``, ``perf/tokens_per_s``: rollouts and generated (response) tokens
  trained per second of wall: the run's throughput;
- ``perf/train_tflops``: the learner's FLOP/s on real tokens over ``time/train``
  (models.cost.train_flops: forward + backward, no padding counted; each rollout at the core
  iterations its positions run in the learner's replay: under kv last_exited the prompt's at
  its full depth and each response position at its exit depth, which depth batching computes
  and no more; under kv full every position at the row's full depth);
- ``perf/mfu``: that over the learner's cards' dense bf16 peak (every data-parallel rank's);
- ``perf/decode_bound_tokens_per_s`` and ``perf/of_decode_bound``: the decode memory bound
  of the learner's card at the step's shape (its rollouts decoded as one batch, their mean
  context and exit depth, bf16 weights and K/V: models.cost.decode_bound) and the fraction of
  it that ``perf/tokens_per_s`` reaches. A generator on another card has its own bound;
- ``perf/delivery_gb_s``: the newest version's bytes over ``time/weight_delivery``.

The card keys are left out where the card is not in models.cost's table (a CPU learner, an
unlisted card); the rest are always there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from models.checkpoint import load_config
from models.cost import LoopShape, card_peaks, decode_bound, train_flops
from models.exits import ExitPolicy, resolve_kv
from proto.records import Rollout


@dataclass(frozen=True)
class Efficiency:
    """The run's constants; ``row`` per step (module docstring)."""

    shape: LoopShape
    backprop_depth: int = 0
    """Core iterations with gradient (0: all), as the learner trains."""
    peaks: tuple[float, float] | None = None
    """The learner's card: (dense bf16 FLOP/s, memory bytes/s); None: not known."""
    ranks: int = 1
    """Data-parallel x tensor-parallel ranks the learner's FLOPs run on."""
    kv: str = "last_exited"
    """The exit KV semantics the learner replays (docs/CONTRACTS.md 3): which iterations a
    position runs (module docstring, ``perf/train_tflops``)."""

    @classmethod
    def for_run(cls, model_dir: str | Path, *, backprop_depth: int = -1, ranks: int = 1,
                policy: ExitPolicy | None = None) -> Efficiency:  # fmt: skip
        """For the checkpoint at ``model_dir`` (``backprop_depth`` -1: the checkpoint's
        mean_backprop_depth where it has one, else all), on this process's card, the run's
        exit ``policy`` (its kv, else the family's)."""
        cfg = load_config(model_dir)
        if backprop_depth < 0:
            backprop_depth = int(getattr(cfg, "mean_backprop_depth", 0) or 0)
        return cls(LoopShape.of(cfg), backprop_depth, _this_card(), max(1, ranks),
                   resolve_kv(policy, cfg))  # fmt: skip

    def replay_depth(self, r: Rollout) -> float:
        """The mean core iterations of ``r``'s positions in the learner's replay (``kv``)."""
        full = r.full_depth or self.shape.recurrence
        depths = [int(d) for d in r.exit_depths]
        if self.kv == "full":
            return float(max([full, *depths]))
        prompt = max(0, len(r.prompt_tokens) - 1)  # positions 0..P-2; P-1 samples token 0
        n = prompt + len(depths)
        return (prompt * full + sum(depths)) / n if n else float(full)

    def row(self, rolls: Sequence[Rollout], *, train_s: float, step_s: float,
            delivery_s: float | None = None, version_bytes: int = 0) -> dict[str, float]:  # fmt: skip
        """The step's ``perf/*`` keys."""
        out: dict[str, float] = {}
        tokens = sum(len(r.tokens) for r in rolls)
        if step_s > 0:
            out["perf/samples_per_s"] = len(rolls) / step_s
            out["perf/tokens_per_s"] = tokens / step_s
        depths = [float(d) for r in rolls for d in r.exit_depths]
        depth = sum(depths) / len(depths) if depths else 0.0
        if train_s > 0 and rolls:
            flops = sum(train_flops(self.shape, [(len(r.prompt_tokens) + len(r.tokens) - 1,
                                                  len(r.tokens))], depth=self.replay_depth(r),
                                    backprop_depth=self.backprop_depth) for r in rolls)  # fmt: skip
            out["perf/train_tflops"] = flops / train_s / 1e12
            if self.peaks is not None:
                out["perf/mfu"] = flops / train_s / (self.peaks[0] * self.ranks)
        if self.peaks is not None and rolls and step_s > 0:
            context = sum(len(r.prompt_tokens) + len(r.tokens) / 2 for r in rolls) / len(rolls)
            bound = decode_bound(self.shape, len(rolls), context, self.peaks[1], depth=depth)
            out["perf/decode_bound_tokens_per_s"] = bound
            out["perf/of_decode_bound"] = tokens / step_s / bound
        if delivery_s and version_bytes:
            out["perf/delivery_gb_s"] = version_bytes / delivery_s / 1e9
        return out


def _this_card() -> tuple[float, float] | None:
    """models.cost.card_peaks of this process's CUDA device, when it uses one (torch is not
    imported here: a CPU learner that never did stays without it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return card_peaks(torch.cuda.get_device_name(torch.cuda.current_device()))
