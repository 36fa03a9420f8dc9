"""Does a learned exit pay over a whole run? `looprl run` on the mixed-depth task
(configs/depth_mix.yaml) at the fixed full depth against the same run with a sampled, trained
exit and a depth cost: throughput and held-out accuracy, 95% intervals over seeds, and on the
last line the verdict.

    python benchmarks/exit_pays.py --seeds 3          # CPU: tiny Ouro, 2 arms x 3 seeds
    python benchmarks/exit_pays.py --smoke            # the CPU smoke: 1 seed, 3 steps, ~1 min
    python benchmarks/exit_pays.py --device cuda --budget-s 550   # GPU: Ouro 400m, 5 seeds
    python benchmarks/exit_pays.py --task long --smoke  # the long completions (below), ~2-3 min
    python benchmarks/exit_pays.py --task pairs --smoke  # the same answered NAME=DIGIT

Order: ONE warm start for both arms, the product's (`looprl sft --config
configs/depth_mix.yaml --steps --warm-steps --gate-steps --gate-steps`: the config's
warm_start keys, embedding at std 1.0, random rows, then Ouro's stage I; docs/TASKS.md "Mixed
depth") -> for each seed in 0..seeds-1 and each arm, a real `looprl run --config
configs/depth_mix.yaml model.path=WARM warm_start.segments=[]` (its learner process, backend
reference, and one `looprl generator` process on the torch engine: models.engine.chunk's
depth-batched chunks on the CPU, one chunk per token whose deepest row sets its iterations;
with ``--depth-ticks K`` the exit arm's generator decodes by ticks instead, its exit policy
in kv last_exited, which the tick decode needs) of ``--steps`` GRPO steps of
``--prompts`` x ``--n`` samples (the same samples in both arms; a seed fixes the run's prompt
order and latent seeds) -> `looprl eval` (pipeline.commands.evaluation.evaluate) of the run's
last published weights on the test split under the arm's own exit policy, greedy, by ``hops``.

Arms: ``full``, the config as it is (every token at the full depth, 4 loops); ``exit``,
rollout.exit_policy={kind: sampled_gate} (each token's exit drawn from the gate), the exit
term objective.exit_coef=1.0 with objective.exit_entropy_coef=0.01, and the depth cost
objective.depth_cost=``--depth-cost`` (0.05) in the advantage (depth_cost_in=advantage:
docs/OBJECTIVES.md; the setting that kept accuracy in docs/PERFORMANCE.md "A sampled exit with
a depth cost").

Per run, from its metrics rows after the first step (the first waits on the generator's start)
and its stream: ``samples_per_s`` and ``tokens_per_s`` = the steps' rollouts and generated
tokens over the sum of their walls (``step_s``: the run's throughput, learner included);
``gen_samples_per_s`` = an engine batch's samples (generators.max_inflight prompts x n) over
its mean engine time (the rows' ``time/generation``: generation alone, batches taken as full); ``mean_depth`` = the trained rollouts' token-mean exit depth; ``loop_share`` and
``decode_loop_share`` = the position-loops those rollouts ran (prompt positions at the full
depth, each token's at its exit) over the same rows at the full depth, whole rows and the decode
alone (`loop_shares`: 1 / loop_share bounds what the exit can save of a step's compute); ``accuracy`` (the arm's
policy), ``accuracy/hops=h`` and ``accuracy@d`` (fixed depth d). Per arm: the mean over seeds,
the sample standard deviation (``_std``) and the 95% t-interval of the mean (``_ci95``).

The GPU mode, ``--device cuda`` (`PARTS=exit_pays_gpu bash scripts/gpu_check.sh` holds its
command; defaults `GPU`, each flag given wins): the same pipeline on one GPU at Ouro ``--size
400m`` (models.random_init: Ouro-1.4B's layer, hidden 2048, x 8 layers, 4 loops, 413 M
parameters; a decode step reads its bf16 weights once per loop, 3.3 GB at depth 4, against
~0.7 GB of K/V at 128 rows of 21 positions: weight-bound). The warm start trains there
(`looprl sft --device cuda`: fp32, TF32 matmuls; --warm-lr, --warm-batch, --gate-lr; stage I
as on the CPU) and is evaluated there (its "eval": accuracy at each fixed depth by hops, and
under the exit arm's sampled gate). Each run (`device_overrides`): the megatron learner in
bf16 on packed rows in both arms (learner.max_tokens_per_micro auto: the sampled exit's
forward packs since 2026-12-07; before, the exit arm alone trained on padded rows)
(uncompiled unless ``--compile``; the engine's blocks compiled unless
``--engine-eager``, a compile in every run's start), the torch engine in bf16 with the GPU's
auto batch (generators.max_inflight auto: a step's prompts x 2), two versions kept on disk
(each run's weights deleted after its evaluation), the task's longest prompt as
task.max_prompt_tokens and that + 2 as generators.max_model_len. The full arm decodes by the
engine's fixed-depth CUDA graph; the exit arm by ticks in a CUDA graph (``--depth-ticks`` 2,
kv last_exited: a row whose token exited goes on to its next token at the next tick instead
of waiting for the batch's deepest row; with kv full or ticks 0 every row runs to the deepest
row's depth, so nothing is saved). `looprl eval` runs on the GPU. ``--budget-s`` bounds the
call (a seed is started only if the slowest so far still fits); ``--warm DIR`` and
``--first-seed`` let a later call add seeds to an earlier one's warm start, and ``--merge
OUT1 OUT2 ...`` reads those calls' outputs into one summary and verdict (no run).

What this task leaves the exit to save: a completion is 2 tokens (the digit + EOS) after a
prompt of at most 18 that runs at the full depth; token 0 (the prompt's last position)
follows the exit policy in the prefill's chunk, whose iterations the deepest of its rows sets,
and token 1 is the one decoded by ticks, so a batch still takes as many ticks as its deepest
row's exit; the learner's forward runs every position to its row's full depth under kv full
(each learner backend batches by depth: from fea5725 the megatron one too, so under kv
last_exited an exited position costs it no more core FLOPs, but here a completion's 2 tokens
are a small part of a row). So
the exit can shorten only a small part of a step here (the verdict's generation-only ratio
isolates the engine's part); a saving needs completions of many tokens a row.

``--task long`` runs all of the above on configs/depth_mix_long.yaml instead (docs/TASKS.md
"Mixed depth, long completions"): a 48-token question with 16 queried names, a completion of
16 digits + EOS, half of a row's digits copies and half one pointer away, in a shuffled order,
so that 16 of its 17 tokens are decoded under the exit policy and their class changes token by
token. There "accuracy" is the held-out fraction of digits right (the reward's partial credit,
eval/reward_mean; "exact": all 16 right), by class through task.reward_args={score_hops: h}
(each class one more evaluation), so the verdict's accuracy difference is in digits. On the
CPU (ticks 0) a batch's decode step still runs its deepest row's loops, so an exit saves only
where the whole batch takes it; with ticks (``--depth-ticks``, the GPU mode's default 2) each
row moves on when its own token exits.

``--task pairs`` (configs/depth_mix_pairs.yaml, docs/TASKS.md "Mixed depth, answers in pairs"):
the long task's questions and digits, each digit written after its query's name
("F=3,I=9,...", 64 tokens with EOS), accuracy as in long. The long task's completion is 17 of
a row's 65 positions, so an exit that halves its depth leaves the step's compute at best
~1.14x smaller (`loop_shares`: the prompt runs at the full depth); here it is 64 of 112, 48 of
them names and format that one loop should answer.

Output, two JSON lines: {"arms": {arm: {figure: mean, figure_std, figure_ci95, figure_seeds}},
"warm_start": the warm start's stats, "settings", "seeds_run", "samples_per_run", "wall_s",
"load_1m", "device": the card};
last, the verdict: {"samples_per_s_ratio": exit / full paired by seed (mean, [95% CI]),
"gen_samples_per_s_ratio", "accuracy_diff": exit - full paired by seed (mean, [95% CI]),
"mean_depth": [full, exit], "seeds", "loop_share": the exit arm's [whole rows, decode],
"verdict": one sentence}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loop_credit_stats import t_interval  # noqa: E402
from pipeline.commands.evaluation import evaluate  # noqa: E402
from pipeline.config.run import load_config  # noqa: E402
from pipeline.core.metrics import read_metrics  # noqa: E402
from pipeline.core.recorder import read_rollouts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = {
    "mix": REPO / "configs" / "depth_mix.yaml",
    "long": REPO / "configs" / "depth_mix_long.yaml",
    "pairs": REPO / "configs" / "depth_mix_pairs.yaml",
}
"""``--task``'s run config: mix, the one-digit answers; long, 16 digits a completion; pairs,
the long task's questions answered in 16 NAME=DIGIT items."""
CONFIG = TASKS["mix"]
QUIET = ["metrics.progress=false", "metrics.plot=false", "metrics.tensorboard=false",
         "checkpoint.every=0", "checkpoint.final=false"]  # fmt: skip
DEPTHS = (1, 2, 3, 4)


def arm_overrides(arm: str, depth_cost: float, ticks: int) -> list[str]:
    """The run-config overrides of ``arm`` (full or exit) over the shared ones; ``ticks`` > 0:
    the exit arm's generator decodes by ticks (generators.depth_ticks, which needs the exit
    policy's kv last_exited). A depth cost of 0 is no cost, where the config refuses
    depth_cost_in=advantage: the exit term alone (benchmarks/exit_frontier.py's cost 0)."""
    if arm == "full":
        return []
    policy = "{kind: sampled_gate, kv: last_exited}" if ticks else "{kind: sampled_gate}"
    where = ["objective.depth_cost_in=advantage"] if depth_cost > 0 else []
    return [f"rollout.exit_policy={policy}", "objective.exit_coef=1.0",
            "objective.exit_entropy_coef=0.01", f"objective.depth_cost={depth_cost}",
            *where, f"generators.depth_ticks={ticks}"]  # fmt: skip


def _cli(args: list[str], log: Path, timeout_s: float, eager: bool = False) -> None:
    """``python -m pipeline.cli ARGS`` (the `looprl` entry point) with its stderr in ``log``;
    SystemExit with the log's tail when it fails. ``eager``: TORCHDYNAMO_DISABLE=1 in its
    environment (torch.compile a no-op in it and its children)."""
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}  # (the GPU host's wheels)
    if eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    with open(log, "w") as err:
        code = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                              stdout=err, stderr=subprocess.STDOUT, timeout=timeout_s).returncode  # fmt: skip
    if code:
        raise SystemExit(f"looprl {args[0]} failed ({code}):\n{log.read_text()[-3000:]}")


def warm_start(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The shared warm start into ``root``/warm (`looprl sft`); its stats line. With ``--warm
    DIR``, a copy of that checkpoint instead (a warm start of an earlier call)."""
    out = root / "warm"
    if args.warm:
        if Path(args.warm).resolve() != out.resolve():
            shutil.copytree(args.warm, out, dirs_exist_ok=True)
        return {"from": args.warm}
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in (("lr", args.warm_lr),
             ("batch", args.warm_batch)) if v is not None]  # fmt: skip
    if args.gate_lr is not None:
        extra.append(f"warm_start.gate_lr={args.gate_lr}")
    _cli(["sft", "--config", str(TASKS[args.task]), "--out", str(out), "--steps",
          str(args.warm_steps), "--gate-steps", str(args.gate_steps), "--device", args.device,
          f"model.size={args.size}", *extra], root / "warm.log", 1800)  # fmt: skip
    lines = [ln for ln in (root / "warm.log").read_text().splitlines() if ln.startswith("{")]
    stats = dict(json.loads(lines[-1]))
    if args.device != "cpu":  # the split the warm start leaves, and its gate's exit
        stats["eval"] = warm_eval(root, args)
    return stats


def warm_eval(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The warm start's held-out figures (`looprl eval` on ``args.device``, by hops): accuracy
    at each fixed depth, and under the exit arm's sampled gate its accuracy and mean depth
    (tasks long and pairs: `held_out`'s figures)."""
    over = arm_overrides("exit", args.depth_cost, args.depth_ticks) + ["generators.engine=torch"]
    if args.task != "mix":
        return held_out(args, over, root / "warm", root / "warm")
    ev = evaluate(load_config(CONFIG, over), root / "warm", depths=DEPTHS, by="hops",
                  limit=args.eval_limit, device=args.device)  # fmt: skip
    return {k.removeprefix("eval/"): float(v) for k, v in ev.items()
            if k.startswith("eval/") and ("accuracy" in k or "mean_depth" in k)}  # fmt: skip


def held_out(args: argparse.Namespace, overrides: list[str], weights: Path,
             tokenizer: Path) -> dict[str, float]:  # fmt: skip
    """`looprl eval` of ``weights`` on the test split of ``--task``'s config with
    ``overrides``, greedy, under the config's exit policy and at each fixed depth: "accuracy",
    "accuracy@d", "mean_depth" (the policy's), and the same by class ("accuracy/hops=h",
    "accuracy@d/hops=h"). Task mix: a question's accuracy, by its hops (`--by hops`). Task
    long: the fraction of digits right (eval/reward_mean, the reward's partial credit), by
    query class through task.reward_args={score_hops: h} (each class one more evaluation of
    every prompt), and "exact" (all 16 right)."""
    cfg = load_config(TASKS[args.task], overrides)
    by = "hops" if args.task == "mix" else ""
    ev = evaluate(cfg, weights, tokenizer=tokenizer, depths=DEPTHS, by=by,
                  limit=args.eval_limit, device=args.device)  # fmt: skip
    if args.task == "mix":
        hops = sorted({k.split("/")[1] for k in ev if k.startswith("eval/hops=")})
        out = {"accuracy": float(ev["eval/accuracy"]), "mean_depth": float(ev["eval/mean_depth"])}
        for key in ("accuracy", *(f"accuracy@{d}" for d in DEPTHS)):
            out[key] = float(ev[f"eval/{key}"])
            for h in hops:  # "hops=1": accuracy/hops=1, accuracy@d/hops=1
                out[f"{key}/{h}"] = float(ev[f"eval/{h}/{key}"])
        return out
    out = {"accuracy": float(ev["eval/reward_mean"]), "exact": float(ev["eval/accuracy"]),
           "mean_depth": float(ev["eval/mean_depth"])}  # fmt: skip
    out |= {f"accuracy@{d}": float(ev[f"eval/reward_mean@{d}"]) for d in DEPTHS}
    for h in query_classes(args):
        at = evaluate(load_config(TASKS[args.task], [*overrides,
                                                     f"task.reward_args={{score_hops: {h}}}"]),
                      weights, tokenizer=tokenizer, depths=DEPTHS, limit=args.eval_limit,
                      device=args.device)  # fmt: skip
        out[f"accuracy/hops={h}"] = float(at["eval/reward_mean"])
        out |= {f"accuracy@{d}/hops={h}": float(at[f"eval/reward_mean@{d}"]) for d in DEPTHS}
    return out


def query_classes(args: argparse.Namespace) -> list[str]:
    """The long task's query classes: the digits of its test rows' ``hops``."""
    data = REPO / load_config(TASKS[args.task]).task.path / "test.jsonl"
    return sorted({h for ln in data.read_text().splitlines() if ln for h in json.loads(ln)["hops"]})


def device_overrides(args: argparse.Namespace) -> list[str]:
    """Both arms' run-config overrides of ``--device``: on the CPU the reference learner; on
    CUDA the megatron learner in bf16 (compiled only with ``--compile``: a compile per run
    costs more than a short run), the torch engine in bf16 with the GPU's auto batch (a step's
    prompts x (max_staleness + 1)) and cache, two published versions kept on disk, the prompt
    bound the task's longest prompt (so the learner's automatic micro-batch holds a step) and
    the engine's cache rows that + rollout.max_tokens (the short task's 64 positions would
    read 3x the K/V a decode step needs); ``--lr`` on either."""
    lr = [f"optimizer.lr={args.lr}"] if args.lr is not None else []
    if args.device == "cpu":
        return ["backend=reference", *lr]
    config = TASKS[args.task]
    longest, completion = longest_prompt(config), load_config(config).rollout.max_tokens
    return ["backend=megatron", "learner.precision=bf16", f"learner.compile={str(args.compile).lower()}",
            "generators.dtype=bfloat16", "generators.max_inflight=auto", "publish.keep=2",
            f"task.max_prompt_tokens={longest}", f"generators.max_model_len={longest + completion}",
            *lr]  # fmt: skip


def longest_prompt(config: Path = CONFIG) -> int:
    """An upper bound of the rendered prompt tokens of ``config``'s task: its longest
    question's bytes (the byte-level tokenizer's most tokens) + BOS + 1."""
    data = REPO / load_config(config).task.path
    return 2 + max(len(json.loads(ln)["prompt"].encode()) for split in ("train", "test")
                   for ln in (data / f"{split}.jsonl").read_text().splitlines() if ln)  # fmt: skip


def one_run(root: Path, arm: str, seed: int, args: argparse.Namespace,
            name: str = "") -> dict[str, float]:  # fmt: skip
    """`looprl run` of ``arm`` with ``seed`` from the warm start, then its evaluation; its run
    directory and log ``root``/``name`` (default ARM-SEED; benchmarks/exit_frontier.py names
    each depth cost's)."""
    name = name or f"{arm}-{seed}"
    live = root / name
    shutil.rmtree(live, ignore_errors=True)  # (an earlier call's, killed: --out reused)
    common = [f"model.path={root / 'warm'}", "warm_start.segments=[]", "warm_start.embed_std=0",
              "warm_start.gate_steps=0", f"seed={seed}", f"steps={args.steps}",
              f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
              "generators.count=1", "generators.engine=torch", "eval.every=0",
              *device_overrides(args), *arm_overrides(arm, args.depth_cost, args.depth_ticks)]  # fmt: skip
    t0 = time.time()
    config = TASKS[args.task]
    _cli(["run", "--config", str(config), f"run_dir={live}", *QUIET, *common],
         root / f"{name}.log", 1800, eager=args.engine_eager)  # fmt: skip
    run_s = time.time() - t0
    rows = [r for r in read_metrics(live / "metrics.jsonl") if r["step"] > 1]
    wall = sum(r["step_s"] for r in rows)
    samples = sum(r["perf/samples_per_s"] * r["step_s"] for r in rows)
    batch_s = statistics.fmean(r.get("time/generation", 0.0) for r in rows)
    rollouts = [ro for _, ro in read_rollouts(live / "stream")]
    depths = [int(d) for ro in rollouts for d in ro.exit_depths]
    weights = max((live / "weights").glob("v*"), key=lambda p: int(p.name[1:]))
    cfg = load_config(config, [f"run_dir={live}", *common])
    held = cfg.generators.max_inflight  # prompts per engine batch (the config's 2)
    batch_rows = min(held if isinstance(held, int) else args.prompts, args.prompts) * args.n
    ev = held_out(args, [f"run_dir={live}", *common], weights, root / "warm")
    if args.device != "cpu":  # a 413 M model's versions: 0.8 GB each, the disk's 64 GB
        shutil.rmtree(live / "weights", ignore_errors=True)
    out = {"samples_per_s": samples / wall, "tokens_per_s": sum(r["tokens"] for r in rows) / wall,
           "gen_samples_per_s": batch_rows / batch_s if batch_s else 0.0,
           "mean_depth": statistics.fmean(depths), "eval_mean_depth": ev.pop("mean_depth"),
           **dict(zip(("loop_share", "decode_loop_share"), loop_shares(rollouts))),
           "run_s": run_s, **ev}  # fmt: skip
    print(f"# {arm} seed {seed}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def loop_shares(rollouts: list[Any]) -> tuple[float, float]:
    """The position-loops ``rollouts`` ran over those of the same rows at the full depth: a
    row's positions before token 0's at its full depth and each token's position at its exit
    depth (what the learner's depth-batched forward and the engine's prefill + decode run under
    kv last_exited), then the decode's alone (tokens 1.., the tick decode's). So 1 / share is
    the most a step's compute can shrink: prompts run at the full depth whatever the exit."""
    ran = full = dec = dec_full = 0
    for ro in rollouts:
        depth = int(ro.full_depth) or DEPTHS[-1]  # (0: a stream before the field)
        exits = [int(d) for d in ro.exit_depths]
        before = len(ro.prompt_tokens) - 1
        ran += before * depth + sum(exits)
        full += (before + len(exits)) * depth
        dec += sum(exits[1:])
        dec_full += max(len(exits) - 1, 0) * depth
    return (ran / full if full else 1.0), (dec / dec_full if dec_full else 1.0)


def summarise(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Mean, sample standard deviation, 95% t-interval and per-seed values of each figure
    (each figure every run has: --merge may join outputs from before a figure existed)."""
    out: dict[str, Any] = {}
    for key in [k for k in runs[0] if all(k in r for r in runs)]:
        vals = [r[key] for r in runs]
        out[key] = statistics.fmean(vals)
        out[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out[f"{key}_ci95"] = list(t_interval(vals)[1:])
        out[f"{key}_seeds"] = vals
    return out


def verdict(full: list[dict[str, float]], exit_: list[dict[str, float]]) -> dict[str, Any]:
    """exit against full, paired by seed: the samples/s ratio and the accuracy difference,
    each mean with its 95% t-interval, and one sentence."""
    ratio = [e["samples_per_s"] / f["samples_per_s"] for f, e in zip(full, exit_)]
    gen = [e["gen_samples_per_s"] / f["gen_samples_per_s"] for f, e in zip(full, exit_)
           if f["gen_samples_per_s"]]  # fmt: skip
    diff = [e["accuracy"] - f["accuracy"] for f, e in zip(full, exit_)]
    r, d = t_interval(ratio), t_interval(diff)
    g = t_interval(gen) if gen else (0.0, 0.0, 0.0)
    depth = [statistics.fmean(x["mean_depth"] for x in arm) for arm in (full, exit_)]
    n = len(ratio)
    out = {"samples_per_s_ratio": [r[0], [r[1], r[2]]],
           "gen_samples_per_s_ratio": [g[0], [g[1], g[2]]],
           "accuracy_diff": [d[0], [d[1], d[2]]], "mean_depth": depth, "seeds": n,
           "verdict": (f"exit vs full: samples/s x{r[0]:.3f} (95% CI {r[1]:.3f}..{r[2]:.3f}), "
                       f"generation-only x{g[0]:.3f} ({g[1]:.3f}..{g[2]:.3f}), accuracy "
                       f"{d[0]:+.3f} ({d[1]:+.3f}..{d[2]:+.3f}), mean exit depth "
                       f"{depth[1]:.2f} vs {depth[0]:.2f}, {n} seed(s)")}  # fmt: skip
    if all("loop_share" in x for x in exit_):  # (outputs before the field: no ceiling)
        share = [statistics.fmean(x[k] for x in exit_) for k in ("loop_share", "decode_loop_share")]
        out["loop_share"] = share
        out["verdict"] += (f"; its rollouts ran {share[0]:.3f} of the full depth's position-loops "
                           f"({share[1]:.3f} of the decode's): compute can shrink at most "
                           f"x{1 / share[0]:.2f}")  # fmt: skip
    return out


GPU = {"size": "400m", "steps": 12, "seeds": 5, "warm_lr": 3e-4, "warm_batch": 64,
       "gate_lr": 3e-4, "lr": 3e-5, "depth_ticks": 2}  # fmt: skip
"""The GPU mode's defaults (``--device cuda``; each flag given wins): the 413 M Ouro shape, runs
of 12 steps, 5 seeds, a warm start at a width-2048 model's rates (lr 3e-4, 64 rows a step, the
gate's stage at 3e-4), GRPO at 3e-5, the exit arm decoding by ticks (2 a CUDA graph replay:
docs/PERFORMANCE.md "The torch engine on the GPU"). Not tuned on a GPU: knobs, not findings."""
CPU = {"size": "tiny", "steps": 30, "seeds": 3, "warm_lr": 3e-3, "warm_batch": None,
       "gate_lr": None, "lr": None, "depth_ticks": 0}  # fmt: skip
"""The CPU defaults: the config's (tiny Ouro, its warm_start and optimizer rates; None: the
config's value) but the warm start's lr, 3e-3 with --warm-steps 600 / --gate-steps 200 (what
the figures in docs/PERFORMANCE.md were measured with; configs/depth_mix.yaml's own warm start
is 1,200 + 600 steps at 1e-3 since 2026-12-07), 30 steps, 3 seeds, one chunk per token."""


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Each run's shape: --steps, --prompts, --n, --lr (here and in
    benchmarks/exit_frontier.py)."""
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (30; GPU 12)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=None,
                   help="GRPO's optimizer.lr (default: the config's 1e-3; GPU 3e-5)")  # fmt: skip


def add_warm_arguments(p: argparse.ArgumentParser) -> None:
    """The device's, the warm start's, the exit arm's decode's, the evaluation's, the work
    directory's and the time budget's."""
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu, or cuda: the GPU mode (module doc; defaults GPU)")  # fmt: skip
    p.add_argument("--task", default="mix", choices=tuple(TASKS),
                   help="mix: configs/depth_mix.yaml (one digit a completion); long: "
                   "configs/depth_mix_long.yaml (16 digits, the class varying by token); pairs: "
                   "configs/depth_mix_pairs.yaml (the long questions, answered NAME=DIGIT: 64 "
                   "tokens, most of them one loop's)")  # fmt: skip
    p.add_argument("--size", default=None,
                   help="model.size of the warm start's fresh Ouro (tiny; GPU 400m)")  # fmt: skip
    p.add_argument("--warm-steps", type=int, default=600, help="warm-start SFT steps")
    p.add_argument("--gate-steps", type=int, default=200, help="warm-start stage-I steps")
    p.add_argument("--warm-lr", type=float, default=None,
                   help="warm-start SFT lr (default 3e-3; GPU 3e-4)")  # fmt: skip
    p.add_argument("--warm-batch", type=int, default=None,
                   help="warm-start rows a step (default: the config's 32; GPU 64)")  # fmt: skip
    p.add_argument("--gate-lr", type=float, default=None,
                   help="stage I's lr (default: the config's 3e-3; GPU 3e-4)")  # fmt: skip
    p.add_argument("--depth-ticks", type=int, default=None,
                   help="the exit arm's generators.depth_ticks, with kv last_exited (0: one "
                   "chunk per token, kv full; default 0, GPU 2)")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="GPU: the learner's blocks compiled (learner.compile; off by default)")  # fmt: skip
    p.add_argument("--engine-eager", action="store_true",
                   help="GPU: TORCHDYNAMO_DISABLE=1 for the runs (the engine's compiled blocks "
                   "eager inside its CUDA graphs: no compile in each run's start)")  # fmt: skip
    p.add_argument("--warm", default="", help="an earlier warm start's checkpoint (skip it)")
    p.add_argument("--eval-limit", type=int, default=0, help="first N test prompts (0: all)")
    p.add_argument("--out", default="", help="work directory (default: a temporary one)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first-seed .. first-seed + seeds - 1 (a later call's, --merge)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="seconds for the whole call: no seed is started that the slowest one "
                   "so far says will not end in time (0: no limit)")  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """The device's defaults into ``args`` (`GPU`, `CPU`: a flag given wins), --smoke's shape
    (1 seed, 3 steps of 4 x 4, 40 + 5 warm-start steps, 40 eval prompts; tasks long and pairs 16), then
    the checks of --seeds, --steps and --device."""
    for key, value in (GPU if args.device == "cuda" else CPU).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.smoke:
        args.seeds, args.steps, args.prompts, args.n = 1, 3, 4, 4
        args.warm_steps, args.gate_steps = 40, 5
        args.eval_limit = 40 if args.task == "mix" else 16  # long, pairs: 3 evaluations each
    if args.seeds < 1 or args.steps < 2:
        raise SystemExit("--seeds must be >= 1 and --steps >= 2 (the first step is not timed)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this host has no CUDA device")


def seeds_in_budget(args: argparse.Namespace, t0: float,
                    clock: Callable[[], float] = time.time) -> Iterator[int]:  # fmt: skip
    """The seeds to run, in order, each started only while ``--budget-s`` (from ``t0`` on
    ``clock``) still holds the slowest seed so far x 1.1 (every seed, without a budget); the
    seeds left out are said on stderr."""
    slowest, start = 0.0, clock()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        now = clock()
        if seed > args.first_seed:
            slowest = max(slowest, now - start)
        if args.budget_s and slowest and now - t0 + 1.1 * slowest > args.budget_s:
            print(f"# budget: {now - t0:.0f} s of {args.budget_s:g} used, a seed takes up to "
                  f"{slowest:.0f} s: seeds {seed}..{args.first_seed + args.seeds - 1} not run",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        start = now
        yield seed


SEED_LINE = re.compile(r"^# (full|exit) seed (\d+): (\{.*\})$")
"""`one_run`'s stderr line: its arm, seed and figures."""


def _seed_lines(text: str) -> tuple[dict[str, list[dict[str, float]]], list[int]]:
    """The runs of a call's stderr log (`one_run`'s lines): the seeds with both arms done, in
    order (a call cut off mid-seed leaves that seed's first arm alone: left out)."""
    done: dict[int, dict[str, dict[str, float]]] = {}
    for line in text.splitlines():
        if m := SEED_LINE.match(line.strip()):
            done.setdefault(int(m[2]), {})[m[1]] = json.loads(m[3])
    seeds = sorted(s for s, arms in done.items() if len(arms) == 2)
    return {arm: [done[s][arm] for s in seeds] for arm in ("full", "exit")}, seeds


def merge(paths: list[str]) -> tuple[dict[str, list[dict[str, float]]], list[int]]:
    """The per-seed runs of earlier calls' outputs, concatenated in file order, and their
    seeds. A file is a call's output (its first line `main`'s {"arms": ...}: every figure's
    per-seed values) or, for a call cut off before it printed (a device's time limit), its
    stderr log, whose per-run lines give the seeds both arms finished."""
    runs: dict[str, list[dict[str, float]]] = {"full": [], "exit": []}
    seeds: list[int] = []
    for path in paths:
        text = Path(path).read_text()
        first = text.strip().splitlines()[0] if text.strip() else ""
        if first.startswith("{"):
            res = json.loads(first)
            for arm, fig in res["arms"].items():
                keys = [k.removesuffix("_seeds") for k in fig if k.endswith("_seeds")]
                n = len(fig[f"{keys[0]}_seeds"])
                runs[arm] += [{k: fig[f"{k}_seeds"][i] for k in keys} for i in range(n)]
            seeds += res.get("seeds_run", [])
            continue
        got, got_seeds = _seed_lines(text)
        if not got_seeds:
            raise SystemExit(f"--merge: {path} is neither an output of this benchmark nor a "
                             "log with a seed both arms finished")  # fmt: skip
        for arm in runs:
            runs[arm] += got[arm]
        seeds += got_seeds
    if len(runs["full"]) != len(runs["exit"]) or not runs["full"]:
        raise SystemExit(f"--merge: {len(runs['full'])} full and {len(runs['exit'])} exit runs")
    return runs, seeds


@contextlib.contextmanager
def work_root(args: argparse.Namespace) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(the work directory, the warm start's stats): --out, else a temporary directory removed
    on exit, with the warm start in it (`warm_start`; its stats also on stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        ws = warm_start(root, args)
        print(f"# warm start: {json.dumps(ws)}", file=sys.stderr, flush=True)
        yield root, ws


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=None, help="seeds (3; GPU 5)")
    add_run_arguments(p)
    p.add_argument("--depth-cost", type=float, default=0.05, help="the exit arm's depth cost")
    add_warm_arguments(p)
    p.add_argument("--smoke", action="store_true",
                   help="1 seed, 3 steps of 4 x 4, 40 + 5 warm-start steps, 40 eval prompts "
                   "(--task long or pairs: 16)")  # fmt: skip
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE",
                   help="no run: the summary and the verdict of earlier calls' outputs together "
                   "(calls of other seeds, --first-seed), or their stderr logs (a call cut off: the "
                   "seeds both arms finished)")  # fmt: skip
    args = p.parse_args(argv)
    if args.merge:
        merged, seeds = merge(args.merge)
        print(json.dumps({"arms": {arm: summarise(r) for arm, r in merged.items()},
                          "merged": args.merge, "seeds_run": seeds}))  # fmt: skip
        print(json.dumps(verdict(merged["full"], merged["exit"])))
        return 0
    check_args(args)
    t0, load0 = time.time(), os.getloadavg()[0]
    done: list[int] = []
    with work_root(args) as (root, ws):
        runs: dict[str, list[dict[str, float]]] = {"full": [], "exit": []}
        for seed in seeds_in_budget(args, t0):  # interleaved: a load change hits both arms alike
            for arm in runs:
                runs[arm].append(one_run(root, arm, seed, args))
            done.append(seed)
    if not done:
        raise SystemExit(f"--budget-s {args.budget_s:g}: no seed fitted after the warm start")
    print(json.dumps({
        "arms": {arm: summarise(r) for arm, r in runs.items()}, "warm_start": ws,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "seeds_run": done,
        "samples_per_run": args.steps * args.prompts * args.n,
        "wall_s": round(time.time() - t0, 1), "load_1m": [load0, os.getloadavg()[0]],
        "device": device_name(args.device),
    }))  # fmt: skip
    print(json.dumps(verdict(runs["full"], runs["exit"])))
    return 0


def device_name(device: str) -> str:
    """The card's name on CUDA (the numbers' card), else "cpu"."""
    if device == "cpu":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(0))


if __name__ == "__main__":
    sys.exit(main())
