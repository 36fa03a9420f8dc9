"""The whole system on one GPU: `looprl run` with the learner and a torch-engine
generator as two processes sharing the device, at a Huginn GPU shape, on a verifiable task.

    python benchmarks/gpu_e2e.py --size 1b                  # one H200: ~6 min (scripts/gpu_check.sh PARTS=e2e)
    python benchmarks/gpu_e2e.py --size tiny --device cpu   # the CPU twin (vLLM not needed either)

What runs, in order, each step timed:
1. ``looprl model init`` of the shape (random init, no download; ``models.random_init`` sizes 1b and 0125).
2. A format-only warm start on the device: ``pipeline.commands.warm_start.sft_steps`` on the
   count-on prompts with *random* alphabet symbols as targets, so the policy learns to answer in
   the task's alphabet (the 0.2 format part of the reward) but is taught nothing of the count
   (the 0.8 part): a randomly initialised model over a 65,536-token vocabulary almost never
   samples a symbol (10 of 65,536), so GRPO would see no signal. Chance on the count is 1/10,
   so the run starts near 0.2 + 0.8 x 0.1 = 0.28 and what RL adds is the count itself.
3. ``looprl run`` (the product's command, unchanged): the megatron learner (bf16, the shape's
   realistic lr) and ONE ``looprl generator --engine torch`` (bf16, CUDA graphs off: adaptive
   batches) on the same GPU, weights published each step through the shared filesystem and
   digest-checked by the generator, the synthetic count-on task (16 prompts x 8 samples, 8
   tokens), asynchronous (max_staleness 1), then the same run synchronous (max_staleness 0).

Prints one JSON line: per run, samples/s and generated tokens/s over the steps after the warm-up,
the learner's busy fraction (sum of time/train over the window), weight delivery and publish
seconds per step, staleness, reward over the first and last 5 steps; the warm start's loss;
the decode HBM bound (tokens/s at the run's batch if every decode step read the bf16 weights
once per core iteration at 4.8 TB/s) beside the generated tokens/s. Every process is started
by `looprl run`, which stops its generator by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from generator.rewards import SYNTHETIC_BASE, synthetic_task_prompts  # noqa: E402
from models.checkpoint import load_model, read_config  # noqa: E402
from models.random_init import init_checkpoint  # noqa: E402
from pipeline.commands.warm_start import save_like, sft_steps  # noqa: E402
from pipeline.core.metrics import read_metrics  # noqa: E402

LR = {"tiny": 3e-3, "small": 1e-3, "1b": 1e-5, "0125": 1e-6}  # trainer_gpu.py's realistic rates
HBM_BYTES_PER_S = 4.8e12  # H200
PROMPTS, N, TOKENS = 16, 8, 8


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warm_start(init: Path, out: Path, device: str, steps: int, lr: float) -> dict[str, Any]:
    """Format-only warm start (module doc, step 2); writes a bf16 checkpoint on CUDA."""
    t0 = time.perf_counter()
    config, module = load_model(init)
    module = module.to(device)
    hf = read_config(init)
    prompts = synthetic_task_prompts(64, 0, int(hf["vocab_size"]))
    rng = random.Random(0)

    def pick(_: int) -> list[tuple[list[int], list[int]]]:
        rows = rng.sample(prompts, 32)
        return [(p, [SYNTHETIC_BASE + rng.randrange(10) for _ in range(TOKENS)]) for p, _ in rows]

    losses = sft_steps(module, pick, steps, lr, 0, rng)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    save_like(module, init, out, dtype)
    params = sum(p.numel() for p in module.parameters())
    core = sum(p.numel() for b in module.core_blocks() for p in b.parameters())
    del module
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"steps": steps, "lr": lr,  # 0 steps: the init as it is (an 80 GB card's 0125)
            "loss_first": round(losses[0], 4) if losses else None,
            "loss_last": round(losses[-1], 4) if losses else None, "s": round(time.perf_counter() - t0, 1),
            "params": params, "core_params": core,
            "depth": int(getattr(config, "mean_recurrence", 1))}  # fmt: skip


def looprl_run(run_dir: Path, model: Path, steps: int, staleness: int, lr: float, device: str,
               timeout: float, extra: list[str] | None = None) -> tuple[int, float]:  # fmt: skip
    """`looprl run` as a user types it; (exit code, wall seconds)."""
    args = [f"run_dir={run_dir}", f"model.path={model}", f"steps={steps}",
            "generators.engine=torch", "generators.count=1", f"optimizer.lr={lr}",
            f"staleness.max_staleness={staleness}", f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n={N}", f"rollout.max_tokens={TOKENS}",
            # no checkpoints (a Huginn-0125 one with Adam is ~57 GB: the GPU host's 64 GB disk
            # holds it beside nothing else) and the fewest published versions staleness 1 needs
            "checkpoint.every=0", "checkpoint.final=false", "publish.keep=2",
            f"generators.max_inflight={PROMPTS}",  # max_num_seqs = a step's 128 samples
            "metrics.progress=false", "metrics.plot=false", "metrics.tensorboard=false"]  # fmt: skip
    if device.startswith("cuda"):  # the torch engine's cache budget (kv_cache_mb): 32 GiB
        args += ["learner.precision=bf16", "generators.kv_cache_mb=32768"]
    args += list(extra or [])  # --set: e.g. learner.lora.rank=16
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.out", "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", *args], cwd=ROOT,
                             stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()  # looprl run stops its generators by pid on SIGTERM
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
    return rc, time.perf_counter() - t0


def summarise(run_dir: Path, warmup: int, bound: float) -> dict[str, Any]:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]
    if len(rows) <= warmup + 1:
        return {"steps_done": len(rows)}
    win = rows[warmup:]
    span = win[-1]["elapsed_s"] - rows[warmup - 1]["elapsed_s"] if warmup else win[-1]["elapsed_s"]

    def total(key: str) -> float:
        return float(sum(r.get(key, 0.0) for r in win))

    rewards = [r["reward_mean"] for r in rows]
    tokens_per_s = total("tokens") / span
    return {
        "steps_done": len(rows),
        "samples_per_s": round(len(win) * PROMPTS * N / span, 2),
        "generated_tokens_per_s": round(tokens_per_s, 1),
        "of_hbm_bound": round(tokens_per_s / bound, 3) if bound else None,
        "learner_busy": round(total("time/train") / span, 3),
        "step_s_median": round(sorted(r["step_s"] for r in win)[len(win) // 2], 3),
        "weight_delivery_s_mean": round(total("time/weight_delivery") / len(win), 3),
        "publish_s_mean": round(total("time/publish") / len(win), 3),
        "staleness_max": max(int(r.get("staleness_max", 0)) for r in rows),
        "reward_first5": round(sum(rewards[:5]) / len(rewards[:5]), 4),
        "reward_last5": round(sum(rewards[-5:]) / len(rewards[-5:]), 4),
        "logprob_mismatch_max": max(float(r.get("logprob_mismatch") or 0.0) for r in rows),
        "refused_total": int(rows[-1].get("refused_total", 0)),
        "learner_peak_gib": max(
            (float(r["mem/peak_gib"]) for r in rows if "mem/peak_gib" in r), default=None
        ),  # fmt: skip
        "delivery_s_max": round(max(float(r.get("time/weight_delivery") or 0.0) for r in win), 3),
        "timeline_mean_s": {
            k: round(total(k) / len(win), 4)  # where a step's time went
            for k in sorted({k for r in win for k in r if k.startswith("time/")})
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", choices=sorted(LR), default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/gpu_e2e")
    ap.add_argument("--steps", type=int, default=40, help="asynchronous run's steps")
    ap.add_argument("--sync-steps", type=int, default=15, help="synchronous run's steps (0: none)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=None, help="RL lr (default: the shape's)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per looprl run")
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more run keys for both runs (e.g. learner.lora.rank=16)",
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lr = a.lr if a.lr is not None else LR[a.size]
    result: dict[str, Any] = {"size": a.size, "device": a.device, "lr": lr, "set": a.set,
                              "prompts": PROMPTS, "n": N, "max_tokens": TOKENS}  # fmt: skip
    if a.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    init = init_checkpoint("huginn", a.size, out / "init", seed=0)
    result["init_s"] = round(time.perf_counter() - t0, 1)
    log(f"init {a.size} in {result['init_s']} s")
    ws = warm_start(init, out / "warm", a.device, a.sft_steps, a.sft_lr)
    result["warm_start"] = ws
    log(f"warm start: {ws}")
    # decode at batch 128 (max_num_seqs): prelude + coda + head once, the core block once per
    # iteration, bf16, per token step
    bytes_per_step = 2 * (ws["params"] + ws["core_params"] * (ws["depth"] - 1))
    bound = HBM_BYTES_PER_S / bytes_per_step * PROMPTS * N if a.device.startswith("cuda") else 0.0
    result["hbm_bound_tokens_per_s"] = round(bound, 1)
    for name, steps, stale in (("async", a.steps, 1), ("sync", a.sync_steps, 0)):
        if steps <= 0:
            continue
        run_dir = out / f"run_{name}"
        rc, wall = looprl_run(run_dir, out / "warm", steps, stale, lr, a.device, a.timeout, a.set)
        log(f"{name}: rc {rc} in {wall:.0f} s")
        result[name] = {"rc": rc, "wall_s": round(wall, 1), **summarise(run_dir, a.warmup, bound)}
        if rc != 0:
            tail = (out / f"run_{name}.out").read_text(errors="replace").splitlines()[-15:]
            result[name]["tail"] = tail
        shutil.rmtree(run_dir / "weights", ignore_errors=True)  # the next run's disk room
    if "async" in result and "sync" in result:
        s, y = result["async"].get("samples_per_s"), result["sync"].get("samples_per_s")
        result["async_over_sync"] = round(s / y, 3) if s and y else None
    print(json.dumps(result))
    ok = all(result[k]["rc"] == 0 for k in ("async", "sync") if k in result)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
