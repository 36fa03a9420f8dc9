"""The depth frontier of the learned exit: held-out accuracy against mean exit depth (and
against generation's samples/s) for a sweep of depth costs, beside the fixed-depth curve.

    python benchmarks/exit_frontier.py --seeds 2      # CPU: tiny Ouro, full + 5 costs x 2 seeds
    python benchmarks/exit_frontier.py --smoke        # 1 seed, full + 2 costs, 3 steps, ~1-2 min

benchmarks/exit_pays.py's pipeline, its functions (one implementation): ONE warm start, the
product's (`looprl sft --config configs/depth_mix.yaml`; ``--warm DIR`` reuses one), then for
each seed in 0..seeds-1 a real `looprl run` of the ``full`` arm (every token at the full depth
D = 4) and of the ``exit`` arm (the sampled gate, the exit term, the depth cost in the
advantage) at each depth cost of ``--costs`` (default 0,0.02,0.05,0.1,0.2), each followed by
`looprl eval` of its last weights on the test split (greedy, by ``hops``).

The reference, the fixed-depth curve: the full arm's held-out ``accuracy@d`` at each fixed
depth d = 1..D (mean depth d). A cost's point: the exit arm's held-out ``accuracy`` under its
own exit policy at its held-out mean exit depth (``eval_mean_depth``: the same questions'
token-mean exit depth, which is what the accuracy was bought with; the trained rollouts' is
``train_mean_depth``), with the run's ``samples_per_s`` and generation alone's
``gen_samples_per_s`` (exit_pays.one_run's figures). Against the curve: per seed, the point's
accuracy minus the same seed's full-arm curve interpolated linearly at the point's mean depth
(clamped to 1..D); the mean of those differences and its 95% t-interval
(loop_credit_stats.compare: "above" the curve when the interval lies above 0, "below" when
below, else "level"; 1 seed: level, an interval of width 0).

Output: one JSON line per run as it ends ({"arm", "cost" (null for full), "seed", and
exit_pays.one_run's figures}); last, the frontier: {"fixed": [{"depth", "accuracy",
"accuracy_ci95", "accuracy_seeds"}], "full": the full arm's mean and 95% CI of its figures,
"exit": [{"cost", "mean_depth", "accuracy", "gen_samples_per_s", "samples_per_s",
"train_mean_depth" (each with _ci95), "fixed_at_depth", "vs_fixed": {"diff", "ci95", "seeds",
"call"}}], "above": the costs above the curve, "verdict": one sentence, "png", "warm_start",
"settings", "samples_per_run", "wall_s", "load_1m"}. The PNG (``--png``, default
docs/images/exit_frontier.png; --smoke's: exit_frontier_smoke.png in the temporary directory)
has two panels: accuracy against mean exit depth (the curve with its intervals, the costs'
points with theirs in both axes), and accuracy against generation alone's samples/s (the full
arm at depth D and the costs' points; the fixed depths below D have no run of their own, so
no throughput). ``--replot FILE`` draws it again from a saved output, without a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import exit_pays as ep  # noqa: E402
from benchmarks.loop_credit_stats import compare, t_interval  # noqa: E402

COSTS = (0.0, 0.02, 0.05, 0.1, 0.2)
PNG = ep.REPO / "docs" / "images" / "exit_frontier.png"
FIGURES = ("mean_depth", "accuracy", "gen_samples_per_s", "samples_per_s", "train_mean_depth")
CALLS = {"ahead": "above", "behind": "below", "level": "level"}


def _costs(text: str) -> list[float]:
    try:
        costs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: expected e.g. 0,0.05,0.2") from None
    if not costs or min(costs) < 0:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: one or more costs >= 0")
    return costs


def interp(depths: Sequence[float], accs: Sequence[float], x: float) -> float:
    """The piecewise-linear curve through (depths, accs) at ``x`` (depths ascending; clamped to
    the first and last depth)."""
    if x <= depths[0]:
        return float(accs[0])
    for (d0, a0), (d1, a1) in zip(zip(depths, accs), zip(depths[1:], accs[1:])):
        if x <= d1:
            return float(a0 + (a1 - a0) * (x - d0) / (d1 - d0))
    return float(accs[-1])


def _stat(vals: list[float]) -> tuple[float, list[float]]:
    mean, lo, hi = t_interval(vals)
    return mean, [lo, hi]


def _held(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record with the held-out mean exit depth as ``mean_depth`` (the trained
    rollouts' as ``train_mean_depth``)."""
    return {**run, "mean_depth": run["eval_mean_depth"], "train_mean_depth": run["mean_depth"]}


def frontier(points: list[dict[str, Any]], depths: Sequence[int] = ep.DEPTHS) -> dict[str, Any]:
    """The per-run records (module doc; ``arm`` full or exit, ``cost``, ``seed``) -> the
    frontier: the fixed-depth curve, each cost's point, each against the curve, the verdict."""
    full = {p["seed"]: p for p in points if p["arm"] == "full"}
    if not full:
        raise ValueError("frontier: needs the full arm's runs (the fixed-depth curve)")
    seeds = sorted(full)
    out: dict[str, Any] = {"fixed": [], "full": {}, "exit": [], "seeds": len(seeds)}
    for d in depths:
        vals = [full[s][f"accuracy@{d}"] for s in seeds]
        mean, ci = _stat(vals)
        out["fixed"].append({"depth": d, "accuracy": mean, "accuracy_ci95": ci,
                             "accuracy_seeds": vals})  # fmt: skip
    for key in FIGURES:
        out["full"][key], out["full"][f"{key}_ci95"] = _stat([_held(full[s])[key] for s in seeds])
    for cost in sorted({p["cost"] for p in points if p["arm"] == "exit"}):
        runs = {p["seed"]: p for p in points if p["arm"] == "exit" and p["cost"] == cost}
        if sorted(runs) != seeds:
            raise ValueError(f"frontier: cost {cost} ran seeds {sorted(runs)}, full {seeds}")
        rows = [_held(runs[s]) for s in seeds]
        at = [interp(depths, [full[s][f"accuracy@{d}"] for d in depths], r["mean_depth"])
              for s, r in zip(seeds, rows)]  # fmt: skip
        pt: dict[str, Any] = {"cost": cost}
        for key in FIGURES:
            pt[key], pt[f"{key}_ci95"] = _stat([r[key] for r in rows])
        pt["fixed_at_depth"] = statistics.fmean(at)
        vs = compare([r["accuracy"] for r in rows], at)
        pt["vs_fixed"] = {**vs, "call": CALLS[vs["call"]]}
        out["exit"].append(pt)
    out["above"] = [p["cost"] for p in out["exit"] if p["vs_fixed"]["call"] == "above"]
    out["verdict"] = verdict(out)
    return out


def verdict(fr: dict[str, Any]) -> str:
    """One sentence: each cost's accuracy minus the fixed-depth curve at its mean exit depth,
    with the interval, and which costs lie above (or below) the curve."""
    n = fr["seeds"]
    parts = [f"cost {p['cost']:g} at depth {p['mean_depth']:.2f}: {p['vs_fixed']['diff']:+.3f} "
             f"({p['vs_fixed']['ci95'][0]:+.3f}..{p['vs_fixed']['ci95'][1]:+.3f})"
             for p in fr["exit"]]  # fmt: skip
    below = [p["cost"] for p in fr["exit"] if p["vs_fixed"]["call"] == "below"]
    tail = (f"above the curve: cost {', '.join(f'{c:g}' for c in fr['above'])}" if fr["above"]
            else "no cost is above the fixed-depth curve")  # fmt: skip
    if below:
        tail += f"; below it: cost {', '.join(f'{c:g}' for c in below)}"
    if n < 2:
        tail += " (1 seed: no interval, every call level)"
    return (f"learned exit minus the fixed-depth curve at its mean exit depth ({n} seed(s), "
            f"paired by seed, 95% t-intervals): {'; '.join(parts)}; {tail}")  # fmt: skip


def _bars(mean: float, ci: list[float]) -> list[list[float]]:
    return [[max(mean - ci[0], 0.0)], [max(ci[1] - mean, 0.0)]]


def plot(fr: dict[str, Any], path: Path, title: str = "") -> Path:
    """The frontier's two panels (module doc) as a PNG at ``path`` (its directory made)."""
    import matplotlib  # local: ~1 s of imports

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    fixed = fr["fixed"]
    ds = [f["depth"] for f in fixed]
    left.errorbar(ds, [f["accuracy"] for f in fixed], capsize=3, marker="s", color="0.35",
                  yerr=[[f["accuracy"] - f["accuracy_ci95"][0] for f in fixed],
                        [f["accuracy_ci95"][1] - f["accuracy"] for f in fixed]],
                  label="fixed depth d (full arm, accuracy@d)")  # fmt: skip
    full, top = fr["full"], fixed[-1]
    right.errorbar([full["gen_samples_per_s"]], [top["accuracy"]], marker="s", color="0.35",
                   capsize=3, xerr=_bars(full["gen_samples_per_s"], full["gen_samples_per_s_ci95"]),
                   yerr=_bars(top["accuracy"], top["accuracy_ci95"]),
                   label=f"fixed depth {top['depth']} (full arm)")  # fmt: skip
    n = len(fr["exit"])
    for i, p in enumerate(fr["exit"]):
        c, rise = f"C{i}", 12 * i - 6 * (n - 1)  # labels staggered: the points may crowd
        label = f"learned exit, cost {p['cost']:g}"
        yerr = _bars(p["accuracy"], p["accuracy_ci95"])
        for ax, key in ((left, "mean_depth"), (right, "gen_samples_per_s")):
            ax.errorbar([p[key]], [p["accuracy"]], xerr=_bars(p[key], p[f"{key}_ci95"]),
                        yerr=yerr, marker="o", color=c, capsize=3, label=label)  # fmt: skip
            ax.annotate(f"c={p['cost']:g}", (p[key], p["accuracy"]), textcoords="offset points",
                        xytext=(8, rise), fontsize=8, color=c)  # fmt: skip
    left.set_xlabel("mean exit depth (held out; fixed: d)")
    left.set_xticks(ds)
    right.set_xlabel("samples/s of generation alone (engine batches, not the run's)")
    for ax in (left, right):
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.margins(x=0.1)
        lo, hi = ax.get_ylim()  # 2 seeds' t-intervals can run past [0, 1]
        ax.set_ylim(max(lo, -0.02), min(hi, 1.02))
    right.set_xlim(left=max(right.get_xlim()[0], 0.0))  # and below 0 samples/s
    left.legend(fontsize=7, loc="lower right")
    fig.suptitle(title or f"exit frontier: {fr['seeds']} seed(s), 95% t-intervals", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def title(fr: dict[str, Any], settings: dict[str, Any]) -> str:
    """The figure's title: the task, the seeds, each run's shape."""
    shape = f"{settings['steps']} steps of {settings['prompts']} x {settings['n']}"
    return (f"learned exit vs fixed depth (configs/depth_mix.yaml, {settings.get('size') or 'tiny'} Ouro"
            f"{', ' + settings['device'] if settings.get('device', 'cpu') != 'cpu' else ''}): "
            f"{fr['seeds']} seed(s), {shape}; 95% t-intervals")  # fmt: skip


def replot(results: Path, png: Path) -> Path:
    """The PNG again from an earlier call's output (its last line: the frontier), no run."""
    fr = json.loads(results.read_text().strip().splitlines()[-1])
    return plot(fr, png, title(fr, fr["settings"]))


def run_args(args: argparse.Namespace, cost: float) -> argparse.Namespace:
    """``args`` with exit_pays's --depth-cost set to ``cost`` (what exit_pays.one_run reads)."""
    return argparse.Namespace(**{**vars(args), "depth_cost": cost})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=2)
    ep.add_run_arguments(p)
    p.add_argument("--costs", type=_costs, default=list(COSTS),
                   help="the exit arm's depth costs, comma-separated (default 0,0.02,0.05,0.1,0.2)")  # fmt: skip
    ep.add_warm_arguments(p)
    p.add_argument("--png", default="", help=f"the figure (default {PNG.relative_to(ep.REPO)})")
    p.add_argument("--replot", default="", metavar="FILE",
                   help="no run: the PNG again from an earlier call's output, saved in FILE")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="exit_pays's smoke shape (1 seed, 3 steps of 4 x 4, 40 + 5 warm-start "
                   "steps, 40 eval prompts) at the first and last cost; the PNG in the temp dir")  # fmt: skip
    args = p.parse_args(argv)
    ep.check_args(args)
    if args.smoke:
        args.costs = sorted({args.costs[0], args.costs[-1]})
    png = Path(args.png or (Path(tempfile.gettempdir()) / "exit_frontier_smoke.png"
                            if args.smoke else PNG))  # fmt: skip
    if args.replot:
        print(replot(Path(args.replot), png))
        return 0
    t0, load0 = time.time(), os.getloadavg()[0]
    points: list[dict[str, Any]] = []
    with ep.work_root(args) as (root, ws):
        for seed in ep.seeds_in_budget(args, t0):  # interleaved: a load change hits every arm alike
            for cost in (None, *args.costs):
                arm = "full" if cost is None else "exit"
                name = f"full-{seed}" if cost is None else f"exit-c{cost:g}-{seed}"
                run = ep.one_run(root, arm, seed, run_args(args, cost or 0.0), name=name)
                points.append({"arm": arm, "cost": cost, "seed": seed, **run})
                print(json.dumps(points[-1]), flush=True)
    fr = frontier(points)
    plot(fr, png, title(fr, vars(args)))
    print(json.dumps({
        **fr, "png": str(png), "warm_start": ws,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "samples_per_run": args.steps * args.prompts * args.n,
        "wall_s": round(time.time() - t0, 1), "load_1m": [load0, os.getloadavg()[0]],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
