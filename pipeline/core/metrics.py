"""Run metrics: RUN_DIR/metrics.jsonl (always), TensorBoard (optional), a PNG plot at the end.

    m = MetricsWriter(run_dir, tensorboard=True)
    m.log(row)          # one dict per training step, with "step"; appended + flushed
    m.close(plot=True)  # RUN_DIR/metrics.png: reward, staleness, log-prob mismatch per step

TensorBoard needs ``torch.utils.tensorboard`` (the ``tensorboard`` package); the plot needs
matplotlib. Either missing is a warning, never an error. Weights & Biases (``metrics.wandb``)
is imported only when enabled, logs every row's scalars by step, and runs offline (files in
RUN_DIR/wandb, `wandb sync` uploads them) unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "looprl", config: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.path = run_dir / METRICS_NAME
        self._wb: Any = None
        if wandb:  # imported only when enabled; no network here: offline unless WANDB_MODE
            try:
                import wandb as wandb_mod  # local: an optional extra (metrics.wandb)
            except ImportError as e:
                raise ValueError(
                    "run config metrics.wandb=true needs the wandb package "
                    "(pip install wandb, or looprl[wandb])"
                ) from e

            self._wb = wandb_mod.init(
                project=wandb_project, dir=str(run_dir), name=run_dir.name, config=config or {},
                mode=os.environ.get("WANDB_MODE", "offline"), resume="allow",  # type: ignore[arg-type]
            )  # fmt: skip
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._tb: Any = None
        if tensorboard:
            try:
                # local: tensorboard loads only when metrics.tensorboard is on
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"))
            except Exception as e:  # ImportError, or tensorboard's own import errors
                log.warning("TensorBoard disabled (%s); metrics go to %s only", e, self.path)

    def log(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}  # fmt: skip
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)
                   and not isinstance(v, bool) and math.isfinite(v)}  # fmt: skip
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(row["step"]))
        if self._wb is not None:
            self._wb.log(scalars, step=int(row["step"]))

    def close(self, *, plot: bool = True) -> Path | None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()
        return plot_metrics(self.path, self.run_dir / PLOT_NAME) if plot else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a resumed run's repeated steps keep the last occurrence."""
    rows: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def summary(rows: list[dict[str, Any]], k: int = 5) -> dict[str, float]:
    """Mean reward of the first and last k steps, steps and wall time."""
    if not rows:
        return {}

    def mean(vals: list[Any]) -> float:  # a non-finite value was logged as null
        ok = [float(v) for v in vals if isinstance(v, int | float)]
        return sum(ok) / len(ok) if ok else float("nan")

    first = [r.get("reward_mean") for r in rows[:k]]
    last = [r.get("reward_mean") for r in rows[-k:]]
    return {
        "steps": len(rows),
        "reward_first": mean(first),
        "reward_last": mean(last),
        "staleness_max": max(int(r.get("staleness_max") or 0) for r in rows),
        "elapsed_s": rows[-1]["elapsed_s"],
    }


def depth_curves(rows: list[dict[str, Any]], most: int = 6
                 ) -> dict[int, tuple[list[tuple[int, float]], tuple[float, float] | None]]:  # fmt: skip
    """eval.depths rows -> {step: ([(depth, eval/accuracy@depth)], (eval/mean_depth,
    eval/accuracy) of the run's policy or None)}: the last eval step and up to ``most`` - 1
    earlier ones, evenly spaced."""
    found = []
    for r in rows:
        pts = sorted((int(k.split("@")[1]), float(v)) for k, v in r.items()
                     if k.startswith("eval/accuracy@") and v is not None)  # fmt: skip
        if pts:
            md, acc = r.get("eval/mean_depth"), r.get("eval/accuracy")
            ok = isinstance(md, int | float) and md == md and isinstance(acc, int | float)
            found.append((int(r["step"]), pts, (float(md), float(acc)) if ok else None))  # type: ignore[arg-type]
    if len(found) > most:
        keep = {round(i * (len(found) - 1) / (most - 1)) for i in range(most)}
        found = [f for i, f in enumerate(found) if i in keep]
    return {step: (pts, adaptive) for step, pts, adaptive in found}


def plot_metrics(path: Path, out: Path) -> Path | None:
    """Reward, staleness and log-prob mismatch per step -> ``out`` (None without matplotlib).

    The mismatch panel shows ``logprob_mismatch`` (fresh rollouts: numerics) and
    ``logprob_mismatch_all`` (every rollout of the step: includes the policy change of stale
    ones), on a log scale. With eval.depths a last panel shows eval/accuracy@d against d, one
    curve per eval step (``depth_curves``), the run's own policy a star at its mean depth."""
    try:
        import matplotlib  # local: ~1 s of imports, once at the end of a run

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    rows = read_metrics(path)
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    panels = [
        ("reward", ["reward_mean", "reward_correct", "eval/accuracy"]),
        ("staleness (versions)", ["staleness_mean", "staleness_max"]),
        ("max |learner - generator logprob|", ["logprob_mismatch", "logprob_mismatch_all"]),
    ]
    curves = depth_curves(rows)
    extra = 1 if curves else 0
    fig, axes = plt.subplots(len(panels) + extra, 1, figsize=(7, 8 + 3 * extra))
    for ax in axes[1 : len(panels)]:
        ax.sharex(axes[0])
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            ys = [r.get(key) for r in rows]
            if key.startswith("eval/"):  # every eval.every steps: points joined over the gaps
                pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=key)
            elif any(y is not None for y in ys):
                ax.plot(steps, [float("nan") if y is None else y for y in ys], label=key)
        ax.set_title(title)
        if title.startswith("max |"):  # numerics (~1e-6) next to policy change (~1): log scale
            ax.set_yscale("log")
        ax.legend(loc="best", fontsize=8)
    axes[len(panels) - 1].set_xlabel("training step")
    if curves:  # eval.depths: accuracy at each fixed depth, one curve per eval step
        ax = axes[-1]
        for step, (pts, adaptive) in curves.items():
            line = ax.plot(*zip(*pts), marker="o", label=f"step {step}")[0]
            if adaptive is not None:  # the run's own policy at its mean depth
                ax.plot(*adaptive, marker="*", markersize=12, color=line.get_color())
        ax.set_title("eval accuracy vs test-time depth (*: the run's exit policy)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth (core iterations)")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
