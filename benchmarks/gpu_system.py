"""`looprl run` on one GPU at a shape users run, against its own parts run alone.

    python benchmarks/gpu_system.py --size 1b --tokens 512              # 32 x 8 x 512 a step
    python benchmarks/gpu_system.py --size 1b --tokens 2048 --prompts 8
    python benchmarks/gpu_system.py --size 1b --tokens 8 --prompts 16   # the quickstart's job
    python benchmarks/gpu_system.py --size tiny --device cpu --tokens 8 --prompts 4 --n 2 \
        --steps 4 --engine torch                                       # the CPU twin (the suite)

What runs, in order (one process each, every one the product's own):

1. ``looprl model init`` of the Huginn shape ``--size`` (random init: responses run to
   ``--tokens``, a random model over 65,536 tokens almost never samples its EOS).
2. ``looprl run`` given only the model, the task (the default count-on task) and the batch
   (``rollout.prompts_per_step``, ``rollout.n``, ``rollout.max_tokens``, ``steps``): every
   other key at its default, i.e. ``auto`` chosen for the host (pipeline.config.device; the
   choices are in the JSON). Its metrics rows after ``--warmup`` steps give the step time and
   the rows' ``perf/*`` keys (pipeline.core.efficiency).
3. Training alone: the run's own Trainer (its recorded config.yaml, so the same auto choices)
   on the run's own recorded steps (RUN_DIR/stream, steps.jsonl), no generator on the card,
   no publication: seconds per step after ``--warmup``.
4. Generation alone: the run's own engine (generator.config at the run's generator settings,
   built by the generator's own ``build_engines``) on one step's work (the run's prompts x n,
   max_tokens), no learner on the card: seconds per step, best of 2 after a warm-up.

One JSON line: ``step_s`` (median), ``generation_alone_s``, ``training_alone_s``,
``step_over_parts`` = step_s / max(the two) (1.0: the run costs no more than its slower part;
the issue's target <= 1.15), ``samples_per_s``, ``tokens_per_s``, the rows' ``of_decode_bound``,
``mfu`` (learner, real tokens), ``delivery_s`` and ``delivery_gb_s`` (a version into the
generator), ``publish_critical_s`` (the publication's part on the step's path: the snapshot and
the wait for room), the card, the auto choices and the run's rc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[gpu_system {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def looprl(*args: str, timeout: float, out: Path) -> tuple[int, float]:
    """``looprl ARGS`` (this interpreter's ``pipeline.cli``), its output into ``out``."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with out.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def run_rows(run_dir: Path, warmup: int) -> list[dict[str, Any]]:
    from pipeline.core.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return [r for r in rows if int(r.get("step", 0)) > warmup]


def training_alone(run_dir: Path, warmup: int, device: str) -> float | None:
    """Seconds a step of the run's Trainer on the run's recorded steps, nothing else on the card."""
    import torch

    from pipeline.backends.trainer_api import build_trainer, with_learner_threads
    from pipeline.commands.learner_main import model_dir, resolve_config
    from pipeline.core.recorder import read_rollouts, read_steps

    cfg = with_learner_threads(resolve_config(None, str(run_dir), []))
    steps = read_steps(run_dir / "steps.jsonl")
    need = {rid for s in steps for rid in s.rollout_ids}
    rolls = {r.rollout_id: r for _, r in read_rollouts(run_dir / "stream") if r.rollout_id in need}
    if not steps or need - rolls.keys():
        return None
    trainer = build_trainer(cfg.backend, cfg, model_dir(cfg, run_dir))
    times = []
    try:
        for s in steps:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.step([rolls[rid] for rid in s.rollout_ids], s.corrections)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    timed = times[warmup:] or times
    return statistics.median(timed)


def generation_alone(cfg: Any, model: Path, prompts: int, n: int, tokens: int, device: str,
                     profile: Path | None = None) -> float | None:  # fmt: skip
    """Seconds for one step's work on the run's own engine (the generator settings of the run
    config ``cfg``), nothing else on the card; ``profile``: one more call under torch.profiler,
    its kernels by CUDA time into PROFILE/generation_kernels.txt."""
    import numpy as np
    import torch

    from generator.config import for_this_host
    from pipeline.commands.generator_cli import build_engines
    from pipeline.commands.generator_flags import generator_config
    from proto.records import WorkItem

    gen, _ = for_this_host(generator_config(cfg, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", model))
    engines = build_engines(gen)
    rng = np.random.default_rng(0)
    vocab = 512 if "tiny" in str(model) else 65536

    def work(k: int) -> list[WorkItem]:
        return [
            WorkItem(work_id=f"w{k}-{i}", prompt_id=str(i),
                     prompt_tokens=rng.integers(3, vocab, 16).astype(np.int32),
                     latent_seeds=rng.integers(0, 2**31, n).astype(np.uint64),
                     max_tokens=tokens, temperature=1.0, top_p=1.0)
            for i in range(prompts)
        ]  # fmt: skip

    times = []
    for k in range(3):  # a warm-up, then the best of 2
        items = work(k)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engines.generate(items)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            engines.generate(work(9))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "generation_kernels.txt").write_text(table)
        log("generation profile:\n" + "\n".join(table.splitlines()[:30]))
    return min(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size", default="1b", help="models.random_init size of the Huginn shape")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--prompts", type=int, default=32, help="rollout.prompts_per_step")
    ap.add_argument("--n", type=int, default=8, help="rollout.n")
    ap.add_argument("--tokens", type=int, default=512, help="rollout.max_tokens")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    ap.add_argument("--engine", default=None, help="generators.engine (default: auto)")
    ap.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="more run keys (the default run sets none)")  # fmt: skip
    ap.add_argument("--out", default="/tmp/gpu_system")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the run")
    ap.add_argument("--skip-parts", action="store_true", help="the run alone")
    ap.add_argument(
        "--generation-only",
        action="store_true",
        help="no run: generation alone at the settings the run would choose",
    )
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile one more generation-alone call into DIR")  # fmt: skip
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU twin: no card even on a GPU host
    from models.random_init import init_checkpoint

    model = out / f"init_{a.size}"
    if not (model / "config.json").exists():
        init_checkpoint("huginn", a.size, model, seed=0)
    run_dir = out / f"run_{a.size}_{a.prompts}x{a.n}x{a.tokens}"
    keys = [f"run_dir={run_dir}", f"model.path={model}", f"steps={a.steps}",
            f"rollout.prompts_per_step={a.prompts}", f"rollout.n={a.n}",
            f"rollout.max_tokens={a.tokens}", *a.set]  # fmt: skip
    if a.engine:
        keys.append(f"generators.engine={a.engine}")
    if a.generation_only:
        from pipeline.config.run import load_config

        cfg = load_config(None, keys)
        gen_s = generation_alone(cfg, model, a.prompts, a.n, a.tokens, a.device,
                                 Path(a.profile) if a.profile else None)  # fmt: skip
        print(json.dumps({"size": a.size, "prompts": a.prompts, "n": a.n, "tokens": a.tokens,
                          "generation_alone_s": _r(gen_s),
                          "tokens_per_s": _r(a.prompts * a.n * a.tokens / gen_s) if gen_s else None}))  # fmt: skip
        return 0
    log(f"looprl run {' '.join(keys)}")
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    rc, wall = looprl("run", *keys, timeout=a.timeout, out=out / f"{run_dir.name}.out")
    rows = run_rows(run_dir, a.warmup)
    res: dict[str, Any] = {
        "size": a.size, "device": a.device, "prompts": a.prompts, "n": a.n, "tokens": a.tokens,
        "steps": a.steps, "warmup": a.warmup, "rc": rc, "run_wall_s": round(wall, 1),
        "rows": len(rows),
    }  # fmt: skip
    if a.device == "cuda":
        import torch

        res["card"] = torch.cuda.get_device_name(0)
    if (run_dir / "config.yaml").exists():  # what the auto keys became (recorded by the run)
        from pipeline.commands.learner_main import resolve_config

        c = resolve_config(None, str(run_dir), [])
        res["chosen"] = {
            "learner.precision": c.learner.precision, "learner.compile": c.learner.compile,
            "learner.max_tokens_per_micro": c.learner.max_tokens_per_micro,
            "generators.engine": c.generators.engine,
            "generators.kv_cache_mb": c.generators.kv_cache_mb,
            "generators.max_inflight": c.generators.max_inflight,
            "publish.transport": c.publish.transport,
            "publish.directories": c.publish.directories,
            "learner.lora.rank": c.learner.lora.rank,
            "generators.placement": c.generators.placement,
            "generators.decode_chunk": c.generators.decode_chunk,
            "generators.mps": c.generators.mps,
            "generators.learner_mps_percent": c.generators.learner_mps_percent,
            "generators.mps_percent": c.generators.mps_percent,
        }  # fmt: skip
    if rows:
        step = statistics.median(float(r["step_s"]) for r in rows)
        res.update({
            "step_s": round(step, 3),
            "train_s": _r(mean(rows, "time/train")),
            "generation_s": _r(mean(rows, "time/generation")),
            "samples_per_s": _r(mean(rows, "perf/samples_per_s")),
            "tokens_per_s": _r(mean(rows, "perf/tokens_per_s")),
            "of_decode_bound": _r(mean(rows, "perf/of_decode_bound")),
            "decode_bound_tokens_per_s": _r(mean(rows, "perf/decode_bound_tokens_per_s")),
            "mfu": _r(mean(rows, "perf/mfu")),
            "train_tflops": _r(mean(rows, "perf/train_tflops")),
            "delivery_s": _r(mean(rows, "time/weight_delivery")),
            "delivery_gb_s": _r(mean(rows, "perf/delivery_gb_s")),
            "publish_critical_s": _r((mean(rows, "time/publish_snapshot") or 0.0)
                                     + (mean(rows, "time/publish_room_wait") or 0.0)),
            "publish_s": _r(mean(rows, "time/publish")),
            "peak_gib": _r(max((float(r["mem/peak_gib"]) for r in rows if "mem/peak_gib" in r), default=None)),
        })  # fmt: skip
    if rows and not a.skip_parts:
        log("training alone: the run's Trainer on its recorded steps")
        train = training_alone(run_dir, a.warmup, a.device)
        log("generation alone: the run's engine on one step's work")
        from pipeline.commands.learner_main import resolve_config

        gen = generation_alone(resolve_config(None, str(run_dir), []), model, a.prompts, a.n,
                               a.tokens, a.device, Path(a.profile) if a.profile else None)  # fmt: skip
        res["training_alone_s"] = _r(train)
        res["generation_alone_s"] = _r(gen)
        parts = max(x for x in (train, gen, 1e-9) if x is not None)
        res["step_over_parts"] = _r(res["step_s"] / parts)
    print(json.dumps(res), flush=True)
    return 0 if rc == 0 and rows else 1


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


if __name__ == "__main__":
    sys.exit(main())
