"""The real `looprl learner` process fed over ZeroMQ by simulated generator processes: one JSON line.

    python benchmarks/learner_process.py --device cuda          # Huginn-0125 shape, bf16, lr 1e-6
    python benchmarks/learner_process.py --device cpu --tiny    # CPU smoke (tests/cli)

What runs is the product's path: `python -m pipeline.cli learner` (megatron backend, the
coordinator, the door, the recorder, publication of one version per step into RUN_DIR/weights,
metrics.jsonl), started as a process with run-config overrides. Only the generators are
simulated: `--generators` processes of benchmarks/learner_process_gen.py connect to the learner's
endpoints with the real ZMQ transport (pipeline.net.transport.zmq), answer every WorkItem with
valid rollouts and acknowledge every announced version.

The rollouts: the dispatched prompt and latent seeds; a response of L random token ids, L
drawn per (prompt id, sample index) evenly over [--min-tokens, --max-tokens] (256-4,096 at the
GPU shape, 2-6 at --tiny), every position at the model's full depth, a 0/1 reward (both in
every group); the prompts are `--prompts` jsonl rows of `--prompt-len` random ids (task.kind
jsonl). The behaviour log-probs are honest: models.reference.replay of the weights the claim
is computed with (the learner checks every claim before its update, rule logp_mismatch of
pipeline/core/validation.py, and refuses liars; no config key turns that check off).
`--claims`:

- ``every`` (the --tiny default): the generator loads each announced version (RUN_DIR/weights/vN)
  and replays with it, as a real generator would (fp32 on both sides: bound 1e-3 nats).
- ``first`` (the GPU default): before the learner starts, this process replays every (prompt,
  sample) once with the starting weights, on the device, at the latent seeds the learner will
  dispatch (contract 1: models.noise.derive_latent_seed of the run seed), into RUN_DIR/claims.npz,
  and frees the model; the generators answer from that file, so the learner has the GPU to
  itself and never waits for generation (a miss is replayed on the spot and logged). Later
  versions are acknowledged without being loaded: the claims are the starting weights'
  log-probs, which the learner measures against its current ones (`logprob_mismatch_max`,
  `logprob_mismatch_fresh_max`, nats; the bf16 bound is 5 at staleness 0, +10 per version of
  staleness; at lr 1e-6 the drift is far below it). Replaying every version at this shape would
  put a forward of every response (about 2/3 of a step's FLOPs) on the learner's GPU each step.

The claims are replayed in `--claims-dtype` (fp32 by default, TF32 matmuls on CUDA: the exact
values up to rounding, against which the bf16 learner's own error is measured; bf16 is what a
GPU generator may run). A refused rollout (RUN_DIR/quarantine.jsonl) ends the run at once, its
reason in the JSON's `error`.

Timed window: the steps after `--warmup` (2 on the GPU: allocator and first steps; 1 at --tiny)
up to `--warmup + --steps`, from the metrics rows (pipeline/core/timeline.py `time/*`,
`elapsed_s`). With `--kill` (the GPU default) the learner is stopped (SIGKILL, by pid) once the
last timed row is written: its final checkpoint at Huginn-0125 (params + fp32 Adam, ~50 GB) is
not measured and would not fit the device host's disk beside the published versions.

JSON keys: `effective_tokens_per_s` (real tokens: each trained row's prompt + response - 1
positions, no padding, over the window's wall time), `mfu` (trainer_gpu.flop_counts per row at
its own length, head at its response positions; 989e12 bf16 peak), `busy_fraction` (sum of
`time/train` / window wall), `versions_per_step`, `publish_s` (mean seconds per stage,
`time/publish*`: snapshot and room_wait on the critical path; blob, digest, write, total, lag
beside it; announce on the coordinator), `publish_bytes` and `digest_gb_s` (blob bytes /
digest seconds), `intake_rollouts_per_s` (rollouts trained per wall second) and
`intake_capacity_rollouts_per_s` (rollouts per second the coordinator spent in intake),
`peak_mem_gib` (the learner's CUDA peak, metrics `mem/peak_gib`; null on CPU),
`peak_rss_gib` (the learner process's peak resident memory), `losses`, `grad_norms`, `health`
(benchmarks/health.py), `logprob_mismatch_max`, `refused_total`, `meets_busy_target`
(busy_fraction >= 0.95 with one version per step: the learner's target).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.health import health
from benchmarks.learner_process_gen import precompute
from benchmarks.trainer_gpu import PEAK_BF16, SHAPES, flop_counts, init_state, model_config

REPO = Path(__file__).resolve().parents[1]
GEN = Path(__file__).resolve().parent / "learner_process_gen.py"  # a simulated generator
RUN_SEED = 0  # the run's seed (latent seeds: models.noise.derive_latent_seed)
GPU = dict(shape="huginn_0125", prompts=8, prompts_per_step=2, n=2, prompt_len=128,
           min_tokens=256, max_tokens=4096, micro=1, generators=1, claims="first", kill=True,
           steps=12, warmup=2)  # fmt: skip
TINY = dict(shape="tiny", prompts=2, prompts_per_step=1, n=2, prompt_len=4, min_tokens=2,
            max_tokens=6, micro=0, generators=1, claims="every", kill=False, steps=2, warmup=1)  # fmt: skip


# --- the benchmark -------------------------------------------------------------------------------


def write_model(s: dict[str, Any], out: Path, dev: Any, precision: str) -> int:
    """The shape's checkpoint (trainer_gpu.init_state: Huginn's init, drawn on ``dev``) in the
    HF layout at ``out``; returns its parameter count."""
    import torch

    from models.checkpoint import save_checkpoint
    from models.huginn import HuginnForCausalLM
    from models.ties import tied_from_module

    c = model_config(s)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    state = init_state(c, dev, dtype)
    with torch.device("meta"):
        tied = tied_from_module(HuginnForCausalLM(c))
    cfg = {**c.to_hf_dict(), "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "torch_dtype": "bfloat16" if precision == "bf16" else "float32"}  # fmt: skip
    save_checkpoint(state, cfg, out, tied=tied)
    params = sum(t.numel() for k, t in state.items() if k != "freqs_cis")
    return params


def poll_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM, bytes), 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a row being written
        if "step" in r:
            rows[int(r["step"])] = r
    return [rows[k] for k in sorted(rows)]


def trained_rows(run_dir: Path, steps: range) -> list[list[Any]]:
    """The rollouts each step in ``steps`` trained (RUN_DIR/steps.jsonl + the recorded stream)."""
    from pipeline.core.recorder import read_rollouts, read_steps

    by_step = {s.step: s for s in read_steps(run_dir / "steps.jsonl")}
    wanted = {rid for k in steps for rid in by_step[k].rollout_ids}
    rolls = {
        r.rollout_id: r for _, r in read_rollouts(run_dir / "stream") if r.rollout_id in wanted
    }
    return [[rolls[rid] for rid in by_step[k].rollout_ids] for k in steps]


def row_flops(s: dict[str, Any], k: int, prompt: int, response: int) -> float:
    """FLOPs of one trained row (trainer_gpu.flop_counts at the row's own length: prompt +
    response - 1 positions, the head at its ``response`` positions)."""
    seq = prompt + response - 1
    fc = flop_counts({**s, "seq": seq}, k)
    body = fc["flops_per_token_head_every_position"] - 6 * s["vocab"] * s["hidden"]
    return float(seq * body + 6 * s["vocab"] * s["hidden"] * response)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke test)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=("huginn_0125", "huginn_1b", "tiny"), default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps before the timed ones (default 2; 1 at --tiny)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=None, help="distinct prompts (task rows)")
    ap.add_argument("--prompts-per-step", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--min-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--micro", type=int, default=None, help="learner.micro_batch_size")
    ap.add_argument("--generators", type=int, default=None)
    ap.add_argument("--claims", choices=("every", "first"), default=None)
    ap.add_argument("--claims-dtype", choices=("bf16", "fp32"), default="fp32",
                    help="the claims' replay dtype (fp32: TF32 matmuls on CUDA)")  # fmt: skip
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                    help="default bf16 on cuda, fp32 on cpu")  # fmt: skip
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--lr", type=float, default=None, help="default: the shape's realistic lr")
    ap.add_argument("--kill", action=argparse.BooleanOptionalAction, default=None,
                    help="SIGKILL the learner's process group after the last timed row (default: on cuda)")  # fmt: skip
    ap.add_argument("--run-dir", default=None,
                    help="kept afterwards (default: a new temporary directory, removed)")  # fmt: skip
    ap.add_argument("--logs", default=None, metavar="DIR",
                    help="copy the learner's and generators' logs and metrics.jsonl here")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config keys")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    defaults = TINY if a.tiny else GPU
    for key, value in defaults.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # a `timeout` around this process: stop the learner and generators it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    temp = a.run_dir is None
    if temp:
        a.run_dir = tempfile.mkdtemp(prefix="looprl-learnerproc-")
    try:
        result = run(a)
    finally:
        if a.logs:
            keep_logs(Path(a.run_dir), Path(a.logs), a.label)
        if temp:
            shutil.rmtree(a.run_dir, ignore_errors=True)  # the model and versions: GBs
    print(json.dumps(result), flush=True)
    if not result.get("ok"):
        sys.exit(1)


def keep_logs(run_dir: Path, logs: Path, label: str) -> None:
    """Into ``logs``: the metrics rows, and one file with the last 256 KiB of each log (the
    learner's terminal and log file, each generator's): two files, as the GPU host's $OUT
    brings few back."""
    logs.mkdir(parents=True, exist_ok=True)
    pre = f"{label}_" if label else ""
    if (run_dir / "run" / "metrics.jsonl").is_file():
        shutil.copyfile(run_dir / "run" / "metrics.jsonl", logs / f"{pre}learnerproc_metrics.jsonl")
    names = ["learner.out", "learner.err", "run/logs/learner.log",
             *sorted(p.name for p in run_dir.glob("gen*.err"))]  # fmt: skip
    with open(logs / f"{pre}learnerproc_logs.txt", "w") as f:
        for name in names:
            src = run_dir / name
            if src.is_file():
                data = src.read_bytes()[-(256 << 10) :]
                f.write(f"===== {name} ({src.stat().st_size} bytes, the last {len(data)})\n")
                f.write(data.decode("utf-8", "replace") + "\n")


def run(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    s = dict(SHAPES[a.shape])
    s["seq"] = a.prompt_len + a.max_tokens
    for flag, ok, want in (
        ("--prompts", a.prompts >= 1 and a.prompts % a.prompts_per_step == 0,
         f"a positive multiple of --prompts-per-step ({a.prompts_per_step})"),
        ("--min-tokens", 1 <= a.min_tokens <= a.max_tokens, f"in 1..--max-tokens ({a.max_tokens})"),
        ("--steps", a.steps >= 1, ">= 1"), ("--n", a.n >= 2, ">= 2 (a group to compare)"),
        ("--warmup", a.warmup is None or a.warmup >= 1, ">= 1 (the window starts after a row)"),
    ):  # fmt: skip
        if not ok:
            raise SystemExit(f"{flag} {getattr(a, flag[2:].replace('-', '_'))}: expected {want}")
    warmup = a.warmup if a.warmup is not None else a.prompts // a.prompts_per_step
    total = warmup + a.steps
    run_dir = Path(a.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.timeout  # the whole run, model and claims included
    dev = torch.device("cuda" if a.device == "cuda" else "cpu")
    t0 = time.perf_counter()
    params = write_model(s, run_dir / "model", dev, a.precision)
    model_s = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rng = np.random.default_rng(0)
    prompts = {f"p{p}": rng.integers(3, s["vocab"], size=a.prompt_len).tolist()
               for p in range(a.prompts)}  # fmt: skip
    with (run_dir / "prompts.jsonl").open("w") as f:
        for pid, ids in prompts.items():
            f.write(json.dumps({"prompt_id": pid, "prompt_tokens": ids}) + "\n")
    base = dict(init=str(run_dir / "model"), device=str(dev), claims_dtype=a.claims_dtype,
                claims=a.claims, prompts=a.prompts, n=a.n, min_tokens=a.min_tokens,
                max_tokens=a.max_tokens, peer_timeout_s=300.0, cache="")  # fmt: skip
    claims_s = 0.0
    if a.claims == "first":  # before the learner: the GPU is its own during the run
        base["cache"] = str(run_dir / "claims.npz")
        claims_s = precompute(base, prompts, RUN_SEED, Path(base["cache"]))
    lr = a.lr if a.lr is not None else s["lr"]
    learn = run_dir / "run"
    overrides = [
        "backend=megatron", f"run_dir={learn}", f"model.path={run_dir / 'model'}",
        # --kill: steps past the window, so no final checkpoint has begun when it is killed
        "task.kind=jsonl", f"task.path={run_dir / 'prompts.jsonl'}",
        f"steps={total + 2 if a.kill else total}",
        f"seed={RUN_SEED}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.n={a.n}", f"rollout.prompts_per_step={a.prompts_per_step}",
        f"rollout.max_tokens={a.max_tokens}", f"learner.precision={a.precision}",
        f"learner.backprop_depth={s['backprop_depth']}", f"learner.micro_batch_size={a.micro}",
        f"learner.compile={a.compile}", f"optimizer.lr={lr}", "publish.every=1",
        "checkpoint.every=0", "metrics.plot=false", "metrics.tensorboard=false",
        "metrics.progress=false", "max_wait_s=600", "transport.peer_timeout_s=300", *a.set,
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}  # (the host's wheels)
    out, err = open(run_dir / "learner.out", "w"), open(run_dir / "learner.err", "w")
    cmd = [sys.executable, "-m", "pipeline.cli", "learner", *overrides]
    t_start = time.perf_counter()
    # its own process group: killing it takes the children it forked too (a Manager of
    # megatron's checkpoint writer outlived a SIGKILL of the learner alone)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
    gens: list[subprocess.Popen[bytes]] = []
    rss, rows, killed, refused = 0, [], False, ""
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            eps_file = learn / "endpoints.json"
            if not gens and eps_file.is_file():
                eps = json.loads(eps_file.read_text())
                for g in range(a.generators):
                    spec = dict(base, id=f"sim{g}", control=eps["control"],
                                weights=eps["weights"])  # fmt: skip
                    log = open(run_dir / f"gen{g}.err", "w")
                    gens.append(subprocess.Popen(
                        [sys.executable, str(GEN), json.dumps(spec)], cwd=REPO, env=env, stdout=log, stderr=log))  # fmt: skip
            rss = max(rss, poll_rss(proc.pid))
            rows = read_rows(learn / "metrics.jsonl")
            if a.kill and len(rows) >= total:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this process made for it
                killed = True
                break
            dead = [gp for gp in gens if gp.poll() is not None]
            if dead:
                break  # a generator failed: its log is in the result
            quarantine = learn / "quarantine.jsonl"
            if quarantine.is_file() and quarantine.stat().st_size:
                refused = quarantine.read_text().splitlines()[0]
                break  # the learner refused a simulated rollout: not a valid run
            time.sleep(0.2)
    finally:
        if proc.poll() is None and not killed:  # (--kill: never its final checkpoint)
            if a.kill or time.monotonic() >= deadline:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        if killed or code != 0:  # what it forked may still run (SIGKILL reaches no child)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for gp in gens:  # each by its pid
            if gp.poll() is None:
                gp.terminate()
            try:
                gp.wait(timeout=30)
            except subprocess.TimeoutExpired:
                gp.kill()
                gp.wait()
        out.close()
        err.close()
    wall_total = time.perf_counter() - t_start
    rows = read_rows(learn / "metrics.jsonl")
    res: dict[str, Any] = {
        "bench": "learner_process", "label": a.label, "ok": False,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "shape": {**s, "params": params}, "precision": a.precision, "compile": a.compile,
        "lr": lr, "micro": a.micro, "claims": a.claims, "claims_dtype": a.claims_dtype, "generators": a.generators,
        "prompts": a.prompts, "rollouts_per_step": a.prompts_per_step * a.n,
        "response_tokens": [a.min_tokens, a.max_tokens], "prompt_len": a.prompt_len,
        "warmup_steps": warmup, "timed_steps": a.steps, "steps_done": len(rows),
        "learner_exit": code, "learner_killed": killed, "model_write_s": round(model_s, 1),
        "claims_precompute_s": round(claims_s, 1),
        "wall_total_s": round(wall_total, 1), "run_dir": str(run_dir), "command": " ".join(sys.argv),
    }  # fmt: skip
    if refused:
        res["error"] = f"the learner refused a simulated rollout: {refused}"
        return res
    if len(rows) < total:
        tail = (run_dir / "learner.err").read_text()[-3000:]
        for g in range(len(gens)):
            tail += f"\n--- gen{g}\n" + (run_dir / f"gen{g}.err").read_text()[-1500:]
        res["error"] = f"{len(rows)} of {total} steps done"
        res["log_tail"] = tail
        return res
    res.update(measure(s, learn, rows, warmup, total))
    res["peak_rss_gib"] = round(rss / 2**30, 2)
    res["ok"] = True
    return res


def measure(s: dict[str, Any], learn: Path, rows: list[dict[str, Any]], warmup: int,
            total: int) -> dict[str, Any]:  # fmt: skip
    """The JSON's figures from the metrics rows of steps warmup+1..total and the stream."""
    timed = [r for r in rows if warmup < int(r["step"]) <= total]
    start = next((r for r in rows if int(r["step"]) == warmup), None)
    t_begin = (
        float(start["elapsed_s"])
        if start
        else float(timed[0]["elapsed_s"]) - float(timed[0]["step_s"])
    )
    wall = float(timed[-1]["elapsed_s"]) - t_begin
    train = sum(float(r["time/train"]) for r in timed)
    k = min(s["backprop_depth"], s["recurrence"]) or s["recurrence"]
    batches = trained_rows(learn, range(warmup + 1, total + 1))
    real = flops = 0.0
    rollouts = 0
    for batch in batches:
        for r in batch:
            p, n = int(r.prompt_tokens.shape[0]), int(r.tokens.shape[0])
            real += p + n - 1
            flops += row_flops(s, k, p, n)
            rollouts += 1
    stages: dict[str, list[float]] = {}
    for r in timed:
        for key, v in r.items():
            if key.startswith("time/publish"):
                stages.setdefault(key.removeprefix("time/publish").lstrip("_") or "total",
                                  []).append(float(v))  # fmt: skip
    publish = {k2: round(statistics.fmean(v), 4) for k2, v in sorted(stages.items())}
    man = json.loads((sorted((learn / "weights").glob("v*/manifest.json"))[-1]).read_text())
    nbytes = sum(int(t["nbytes"]) for t in man["tensors"])
    intake = sum(float(r.get("time/intake", 0.0)) for r in timed)
    losses = [float(r["train/loss"]) for r in rows]
    norms = [float(r["train/grad_norm"]) for r in rows]
    versions = int(timed[-1]["version"]) - (int(start["version"]) if start else 0)

    def finite(key: str) -> list[float]:
        vals = [r.get(key) for r in rows]
        return [float(v) for v in vals if v is not None and math.isfinite(float(v))]

    mism, fresh = finite("logprob_mismatch_all"), finite("logprob_mismatch")
    peak = [float(r["mem/peak_gib"]) for r in rows if "mem/peak_gib" in r]
    busy = train / wall if wall > 0 else 0.0
    digest = publish.get("digest")
    return {
        "window_wall_s": round(wall, 6),
        "step_s_median": round(statistics.median(float(r["step_s"]) for r in timed), 3),
        "train_s_median": round(statistics.median(float(r["time/train"]) for r in timed), 3),
        "real_tokens": int(real),
        "effective_tokens_per_s": round(real / wall, 1),
        "flops_formula": "trainer_gpu.flop_counts per row at its own length (prompt + "
        "response - 1 positions), the head at its response positions",
        "mfu": round(flops / wall / PEAK_BF16, 4),
        "busy_fraction": round(busy, 4),
        "versions_per_step": round(versions / len(timed), 3),
        "publish_s": publish,
        "publish_bytes": nbytes,
        "digest_gb_s": round(nbytes / digest / 1e9, 3) if digest else None,
        "intake_rollouts_per_s": round(rollouts / wall, 3),
        "intake_capacity_rollouts_per_s": round(rollouts / intake, 1) if intake > 0 else None,
        "dispatch_wait_s": round(sum(float(r.get("time/dispatch_wait", 0.0)) for r in timed), 3),
        "peak_mem_gib": round(max(peak), 2) if peak else None,
        "losses": [round(x, 6) for x in losses],
        "grad_norms": [float(f"{g:.4g}") for g in norms],
        "health": health(losses, norms),
        "logprob_mismatch_max": round(max(mism), 6) if mism else None,
        "logprob_mismatch_fresh_max": round(max(fresh), 6) if fresh else None,
        "refused_total": int(rows[-1].get("refused_total", 0)),
        "staleness_max": max(int(r["staleness_max"]) for r in timed),
        "meets_busy_target": busy >= 0.95 and versions == len(timed),
    }


if __name__ == "__main__":
    main()
