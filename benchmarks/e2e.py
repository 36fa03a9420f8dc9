"""End to end: samples/s of the asynchronous pipeline vs the same system run synchronously.

    python benchmarks/e2e.py                     # ~5.5 minutes on the 2-core CPU host
    python benchmarks/e2e.py --steps 30 --async-staleness 1 --max-tokens 8

Two runs of the real system, identical except ``staleness.max_staleness``: ``looprl learner``
(megatron backend, coordinator on rank 0) and ONE ``looprl generator`` (vLLM on CPU), each a
process of its own, pinned to one core (learner -> ``--learner-core``, generator ->
``--generator-core``, ``os.sched_setaffinity``; OMP_NUM_THREADS = MKL_NUM_THREADS = 1), talking
ZMQ over loopback, publishing weights every step (disk), recording the rollout stream. The
model is the tiny random Huginn of the quickstart, the task the synthetic count-on task; the
default workload (16 prompts x 8 samples, 16 tokens, the generator holding one step's work)
makes generation and training take comparable time per step (docs/PERFORMANCE.md).

- sync: max_staleness 0 -- the learner waits for rollouts of its current weights, the generator
  waits for the weights of every step (on-policy RL; generation and training alternate).
- async: max_staleness 2, then 1 (``--async-staleness``; policy drop) -- generation may run that
  many learner versions ahead, so the two processes overlap; nothing staler is trained. The
  first is the headline figure; the others are reported as ``speedup_async_s<N>``.

Samples/s = trained samples (prompts_per_step x group size per step) per second of the learner's
own clock (``elapsed_s`` of RUN_DIR/metrics.jsonl) over the steps after ``--warmup``. Where the
time goes is reported per run: the CPU utilisation of each process over the same window (from
/proc, sampled by this script), the learner's ``train_s`` and the generator's ``gen_time_s``
(recorded with every rollout) summed over the window. Every process started here is stopped
by its pid. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.commands.launcher import generator_command  # noqa: E402
from pipeline.config.run import load_config  # noqa: E402
from pipeline.core.metrics import read_metrics  # noqa: E402
from pipeline.core.recorder import read_rollouts  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes ------------------------------------------------------------------------------------
def _pinned(core: int) -> Any:
    def pin() -> None:
        os.sched_setaffinity(0, {core})

    return pin


def spawn(cmd: list[str], core: int, logfile: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    with open(logfile, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=_pinned(core))  # fmt: skip


def stop(p: subprocess.Popen[bytes] | None, name: str, timeout_s: float = 20.0) -> None:
    """SIGTERM the process by its pid, SIGKILL after ``timeout_s``."""
    if p is None or p.poll() is not None:
        return
    os.kill(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log(f"{name} pid {p.pid} did not stop; SIGKILL")
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime + cutime + cstime in ticks) of a live pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2 :].split()
    return int(f[1]), sum(int(x) for x in f[11:15])


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants (vLLM / reward helpers included)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s is not None:
                stats[int(d)] = s
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += [c for c, (pp, _) in stats.items() if pp == pid]
    return total / TICK


def affinity_of(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


# -- one run -------------------------------------------------------------------------------------
def run_once(name: str, overrides: list[str], out: Path, args: argparse.Namespace) -> dict:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [f"run_dir={run_dir}", *overrides]
    cfg = load_config(None, overrides)
    log(f"{name}: starting the learner (core {args.learner_core}) ...")
    learner = spawn([sys.executable, "-m", "pipeline.cli", "learner", *overrides],
                    args.learner_core, run_dir / "learner.log")  # fmt: skip
    gen: subprocess.Popen[bytes] | None = None
    polls: list[tuple[float, int, float, float]] = []  # (time, steps done, learner cpu, gen cpu)
    t_start = time.time()
    try:
        ep = run_dir / "endpoints.json"
        while not ep.is_file():
            if learner.poll() is not None:
                raise RuntimeError(f"{name}: learner exited {learner.returncode}; see {run_dir}")
            if time.time() - t_start > 300:
                raise RuntimeError(f"{name}: learner did not bind within 300 s")
            time.sleep(0.2)
        time.sleep(0.2)
        eps = json.loads(ep.read_text())
        cmd = generator_command(cfg, 0, eps["control"], eps["weights"], run_dir / "init")
        gen = spawn(cmd, args.generator_core, run_dir / "generator.log")
        log(f"{name}: generator pid {gen.pid} (core {args.generator_core}), learner pid "
            f"{learner.pid}; {cfg.steps} steps ...")  # fmt: skip
        pinned = {"learner": affinity_of(learner.pid), "generator": affinity_of(gen.pid)}
        metrics = run_dir / "metrics.jsonl"
        while learner.poll() is None:
            if gen.poll() is not None:
                raise RuntimeError(f"{name}: the generator exited {gen.returncode}; see {run_dir}")
            if time.time() - t_start > args.run_timeout:
                raise RuntimeError(f"{name}: not done within {args.run_timeout} s")
            done = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
            polls.append((time.time(), done, tree_cpu_s(learner.pid), tree_cpu_s(gen.pid)))
            time.sleep(args.poll)
        if learner.returncode != 0:
            raise RuntimeError(f"{name}: learner exited {learner.returncode}; see {run_dir}")
    finally:
        stop(learner, "learner", 60.0)
        stop(gen, "generator")
    res = analyse(run_dir, cfg, polls, args.warmup)
    res["wall_s"] = round(time.time() - t_start, 1)
    res["pinned_cores"] = pinned
    log(f"{name}: {json.dumps(res)}")
    return res


def analyse(run_dir: Path, cfg: Any, polls: list, warmup: int) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = len(rows)
    if steps != cfg.steps or steps <= warmup + 1:
        raise RuntimeError(f"{run_dir}: {steps} steps recorded, expected {cfg.steps}")
    r = cfg.rollout
    win = rows[warmup:]
    t0, t1 = rows[warmup - 1]["elapsed_s"] if warmup else 0.0, rows[-1]["elapsed_s"]
    dt = t1 - t0
    samples = len(win) * r.prompts_per_step * r.n
    # CPU utilisation over the same steps (the polls know when each step's row appeared)
    a = next((p for p in polls if p[1] >= warmup), None)
    b = next((p for p in polls if p[1] >= steps - 1), polls[-1] if polls else None)
    util: dict[str, float | None] = {"learner": None, "generator": None}
    if a is not None and b is not None and b[0] > a[0]:
        util = {"learner": round((b[2] - a[2]) / (b[0] - a[0]), 3),
                "generator": round((b[3] - a[3]) / (b[0] - a[0]), 3)}  # fmt: skip
    # generator batches: the rollouts of one engine.generate call share its gen_time_s
    batches: dict[float, list[float]] = {}  # gen_time_s -> [last created_at, samples]
    for _, ro in read_rollouts(run_dir / "stream"):
        e = batches.setdefault(float(ro.metrics.get("gen_time_s") or 0.0), [0.0, 0])
        e[0], e[1] = max(e[0], float(ro.created_at)), e[1] + 1
    gen_win = []
    if a is not None and b is not None:
        gen_win = [(g, n) for g, (c, n) in batches.items() if a[0] <= c <= b[0]]
    span = (b[0] - a[0]) if a is not None and b is not None and b[0] > a[0] else float("nan")
    train = sum(x["train_s"] for x in win)
    gen_s = sum(g for g, _ in gen_win)
    gen_per_step = gen_s / max(1, sum(n for _, n in gen_win)) * r.prompts_per_step * r.n
    return {
        "samples_per_s": round(samples / dt, 2),
        "steps_per_s": round(len(win) / dt, 3),
        "step_s_mean": round(dt / len(win), 3),
        "train_s_mean": round(train / len(win), 3),
        "learner_train_frac": round(train / dt, 3),
        "learner_cpu_util": util["learner"],
        "generator_cpu_util": util["generator"],
        "gen_batches_in_window": len(gen_win),
        "gen_s_per_batch": round(gen_s / max(1, len(gen_win)), 3),
        "gen_s_per_step": round(gen_per_step, 3),
        "samples_per_batch": round(sum(n for _, n in gen_win) / max(1, len(gen_win)), 1),
        "generator_gen_frac": round(gen_s / span, 3),
        "staleness_mean": round(sum(x["staleness_mean"] for x in win) / len(win), 3),
        "staleness_max": max(x["staleness_max"] for x in rows),
        "dropped_stale": rows[-1]["dropped_stale_total"],
        "reward_first5": round(sum(x["reward_mean"] for x in rows[:5]) / 5, 3),
        "reward_last5": round(sum(x["reward_mean"] for x in rows[-5:]) / 5, 3),
        "measured_steps": len(win),
        "window_s": round(dt, 2),
    }


# -- main --------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the figure")
    p.add_argument("--async-staleness", type=int, nargs="+", default=[2, 1],
                   help="max_staleness of the async run(s); the first is the headline")  # fmt: skip
    p.add_argument("--group-size", type=int, default=8, help="rollout.n")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-inflight", type=int, default=0,
                   help="work items the generator holds; 0: prompts_per_step (one step's worth)")  # fmt: skip
    p.add_argument("--backend", default="megatron", choices=["megatron", "reference"])
    p.add_argument("--learner-core", type=int, default=0)
    p.add_argument("--generator-core", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.2, help="seconds between /proc samples")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--out", default="", help="run directories (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for both runs")
    args = p.parse_args()
    # SIGTERM -> SystemExit, so the finally clauses stop the learner and the generator
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if args.learner_core == args.generator_core:
        p.error("the learner and the generator need different cores")
    cores = sorted(os.sched_getaffinity(0))
    if not {args.learner_core, args.generator_core} <= set(cores):
        p.error(f"cores {args.learner_core}, {args.generator_core} not all available ({cores})")
    inflight = args.max_inflight or args.prompts_per_step
    common = [
        f"steps={args.steps}", f"seed={args.seed}", f"backend={args.backend}",
        f"rollout.n={args.group_size}", f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.max_tokens={args.max_tokens}", "generators.count=1",
        f"generators.max_inflight={inflight}", "generators.threads=1", "staleness.policy=drop",
        "checkpoint.every=0", "metrics.progress=false", "metrics.tensorboard=false",
        "metrics.plot=false", "max_wait_s=120", *args.extra,
    ]  # fmt: skip
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="looprl-e2e-"))
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    runs: dict[str, dict] = {}
    try:
        runs["sync"] = run_once("sync", [*common, "staleness.max_staleness=0"], out, args)
        for s in args.async_staleness:
            runs[f"async_s{s}"] = run_once(
                f"async_s{s}", [*common, f"staleness.max_staleness={s}"], out, args
            )
    finally:
        if not args.keep and not args.out:
            shutil.rmtree(out, ignore_errors=True)
    head = runs[f"async_s{args.async_staleness[0]}"]
    sync = runs["sync"]
    speedup = head["samples_per_s"] / sync["samples_per_s"]
    # overlap bound: a step of the sync run costs train + generate (+ publish, load, messages);
    # perfect overlap costs max(train, generate)
    t, g = sync["train_s_mean"], sync["gen_s_per_step"]
    result = {
        "benchmark": "e2e",
        "async_samples_per_s": head["samples_per_s"],
        "sync_samples_per_s": sync["samples_per_s"],
        "speedup": round(speedup, 3),
        "target_speedup": 1.6,
        "meets_target": speedup >= 1.6,
        "max_staleness_async": args.async_staleness[0],
        "staleness_policy": "drop",
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step,
        "samples_per_step": args.group_size * args.prompts_per_step,
        "max_tokens": args.max_tokens,
        "generator_max_inflight": inflight,
        "model": "huginn tiny (random init, quickstart)",
        "task": "synthetic count-on",
        "backend": args.backend,
        "generators": 1,
        "cores": {"learner": args.learner_core, "generator": args.generator_core},
        "omp_threads": 1,
        "publish_every": 1,
        "extra_overrides": args.extra,
        "sync_train_s_per_step": t,
        "sync_gen_s_per_step": g,
        "overlap_bound_speedup": round(sync["step_s_mean"] / max(t, g), 3),
        "loadavg_before": load,
        "total_wall_s": round(time.time() - t0, 1),
        "runs": runs,
    }
    for name, r in runs.items():
        if name.startswith("async_s") and name != f"async_s{args.async_staleness[0]}":
            result[f"speedup_{name}"] = round(r["samples_per_s"] / sync["samples_per_s"], 3)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
