"""Per-loop credit on tasks where depth should matter: held-out accuracy of `last` against
uniform, progressive, exit_pdf (with and without the gate's gradient) and learned
(objective.loop_weighting), each task from one warm start, at equal samples; 95% intervals
over seeds and, on the last line, the verdict.

    python benchmarks/loop_credit.py --quick             # the CPU smoke: ~25 s
    python benchmarks/loop_credit.py --seeds 5           # CPU: tiny Ouro, 6 arms x 2 tasks
    python benchmarks/loop_credit.py --task mix --arms last,uniform --seeds 5 --steps 30

Tasks (built here, no downloads; ``--task``, comma-separated, default ``vars,mix``; each its
own data, warm start and runs): ``mix``, the mixed-depth task (generator.depth_mix: half the
questions copying, whose answer is the prompt's one digit, half variable tracking through
``--chain`` assignments; its figures also by class, "accuracy@d/hops=h"); ``vars``, variable tracking: two
pointer chains of ``--chain`` assignments from two different digits, shuffled, the query
names the end of the first ("y=x,b=4,x=7,c=b,z=y?z" -> "7"): each hop one more lookup, the
kind of multi-step latent computation more core iterations should help with. Others, tried
(docs/PERFORMANCE.md): ``sum`` (the last digit of ``--chain`` + 1 digits' sum), ``add``
(two ``--chain``-digit numbers, the sum least significant digit first), ``cmp`` ("37<45=" ->
"1"), ``parity``. Rows are a pure function of (--data-seed, split, row); test questions
never occur in train. Reward: the built-in ``exact_match`` (generator.rewards) on the decoded
completion; accuracy = greedy exact match on the test split.

Order: a fresh ``--family``/``--size`` checkpoint -> ONE supervised warm start on the train
answers (``sft`` below: pipeline.commands.warm_start's recipe on the plain-text rendering,
reference forward at full depth, ``--warm-steps`` AdamW steps of ``--warm-batch`` rows, the
fresh model's input embedding first scaled to ``--embed-std`` (default 1.0; the product's
warm_start.embed_std: pipeline.commands.warm_start.rescale_embedding); the script renders
the rows itself: the dataset task's loader took minutes per 2,000 rows on the loaded host)
-> with ``--gate-warm-steps N`` (default 0: none), the exit gate trained as Ouro trains it
(`gate_warm` in benchmarks/loop_credit_gate.py: the product's warm_start.gate_steps stage,
pipeline/commands/exit_stages.py; Ouro families only), on the per-loop readouts of the train answers
(`loop_losses`: loop k = the depth-k forward): ``--gate-objective adaptive`` (default) is
Ouro's stage II, the gate alone taught whether the next loop still lowers the token's loss
(`gate_loss_adaptive`, ``--gate-slope`` k = 50, ``--gate-margin`` gamma = 0.005, the
paper's), the model unchanged; ``entropy`` is stage I, every parameter on the exit
distribution's expected per-loop loss minus ``--gate-beta`` times its entropy
(`gate_loss_entropy`); AdamW at ``--gate-lr`` on ``--warm-batch`` rows a step
-> for every arm and every seed in 0..seeds-1: a
backend=reference trainer (pipeline.backends.reference_trainer: the learner's TorchPolicy and
LearnerStep, the same code `looprl run` trains with) from the warm start, ``--steps`` GRPO
steps of ``--prompts`` prompts x ``--n`` samples drawn by models.reference.generate (the
numerical spec the generators' vLLM plugin matches) under the run's exit policy
(``--exit-policy``, default full depth), the arm's loop_weighting the only difference; the
same prompts and latent seeds in every arm for a given seed -> greedy accuracy on the test
split at each fixed depth of ``--depths`` (FixedDepth(d), as eval.depths) and under the run's
policy, and the mean exit depth of its tokens.

Output, two JSON lines. First: {"tasks": {task: {"arms": {arm: {"accuracy": mean,
"accuracy_std", "accuracy_seeds": [...], "accuracy_ci95": [low, high], "mean_depth",
"accuracy@d": mean, "accuracy@d_std", ...}}, "warm_start": {the warm start's accuracy at each
depth; with --gate-warm-steps also "gate": {"before", "after": the gate's greedy test accuracy
and token-mean exit depth under SampledGate() and OuroGate(0.5), its mean exit distribution
p(t) and the mean cross-entropy after each loop on the test answers; "objective", "steps",
"loss_first", "loss_last", "s"}}}}, settings, "samples_per_arm_seed", "wall_s", "load_1m": [at
start, at end]}. Spread = the sample standard deviation over seeds; accuracy_ci95 = the 95%
t-interval of the mean over seeds. Last: the verdict (benchmarks/loop_credit_stats.py): every
arm against `last` on every task, paired by seed (a seed fixes the RL prompts and latent seeds
of every arm), the mean difference and its 95% t-interval; {"verdict": "ARM ahead of last on
TASK: +d (95% CI lo..hi, n seeds)" or "no arm ahead of last (best: ...)", "ahead": [[task,
arm], ...], "comparisons": [...], "samples_per_arm_seed"}.

The GPU mode, ``--device cuda`` (`PARTS=loop_credit_gpu bash
scripts/gpu_check.sh` holds its command: Ouro ``--size small``, 13M parameters): the warm
start, the generation copy and the evaluation on the GPU, every arm trained by the megatron
learner there (backend=megatron), ``task.max_prompt_tokens`` set to the longest prompt so
the learner's automatic micro-batch holds a whole step; ``--jobs`` processes share the GPU.
Each arm's ``collapsed``: its seeds under half the warm start's held-out accuracy.

Arms: any of last (required: the base), uniform, progressive, exit_pdf (Ouro's exit gate
only), exit_pdf_grad (exit_pdf with objective.exit_pdf_gradient: the gate trained through the
weights), learned, or ``name:key=value;key=value``: run-config overrides for that arm. An arm's
rollout.exit_policy replaces --exit-policy for its rollouts and its evaluation, e.g. the
sampled exit with a compute cost::

    --arms 'last,sampled_cost:rollout.exit_policy={kind: sampled_gate};objective.exit_coef=1.0;objective.depth_cost=0.2;objective.exit_entropy_coef=0.01'

(its mean_depth: the tokens' mean exit loop under the sampled exit, greedy tokens; the
depth-cost goal: 30% less depth than full at no more than 1 point of accuracy). Measured
(docs/PERFORMANCE.md): from an untrained gate, and with GRPO's std-normalised advantages
even from a trained one, the cost drives the exit to loop 1; with ``--gate-warm-steps 600``
and ``objective.normalize_std=false`` the cost arms kept accuracy at 30-45% less depth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.loop_credit_gate import check_gate_args, gate_report, gate_warm  # noqa: E402
from benchmarks.loop_credit_stats import t_interval, verdict  # noqa: E402
from benchmarks.loop_credit_tasks import TASK_NAMES, Task, eval_all, write_data  # noqa: E402
from models.checkpoint import load_model, read_config, save_checkpoint, state_dict_for_save  # noqa: E402
from models.errors import ConfigError  # noqa: E402
from models.exits import ExitPolicy, policy_from_dict  # noqa: E402
from models.noise import derive_latent_seed  # noqa: E402
from models.random_init import init_checkpoint  # noqa: E402
from models.reference import SamplingParams, generate  # noqa: E402
from models.ties import tied_from_module  # noqa: E402
from pipeline.commands.warm_start import rescale_embedding, row_picker, sft_steps  # noqa: E402
from pipeline.config.run import RunConfig, load_config  # noqa: E402
from proto.records import Rollout  # noqa: E402


def sft(model: Any, task: Task, steps: int, lr: float, batch: int, seed: int) -> dict[str, Any]:
    """The warm start: pipeline.commands.warm_start's own loop (sft_steps) on random batches
    of the training prompts and their targets (its row_picker, warm_start.rows=random)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    examples = [(p.tokens, task.target(p)) for p in task.train]
    losses = sft_steps(model, row_picker(examples, batch, "random", rng), steps, lr, 0, rng)
    return {"steps": steps, "loss_first": losses[0], "loss_last": losses[-1],
            "s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def rl_arm(cfg: RunConfig, warm: Path, task: Task, seed: int, args: argparse.Namespace,
           policy: ExitPolicy | None) -> dict[str, float]:  # fmt: skip
    """``args.steps`` GRPO steps from ``warm`` with ``cfg`` (the arm's), then eval_all. An arm
    that sets rollout.exit_policy generates (and evaluates) under it instead of ``policy``;
    a sampled exit's rollouts carry their exit log-probs (objective.exit_coef trains them).
    An arm with ``backend=megatron`` trains with the megatron learner (the `looprl run` one) and
    generates with a reference copy of its weights on ``args.device``, given the learner's HF
    state (the gather a publication writes) after every step (the reference backend's model is
    the one it trains; CPU only)."""
    from pipeline.backends.reference_trainer import ReferenceTrainer

    if args.device != "cpu" and cfg.backend != "megatron":
        raise SystemExit(
            f"--device {args.device}: every arm trains with backend=megatron there (the "
            f"reference backend runs on the CPU); an arm set backend={cfg.backend}"
        )
    policy = cfg.rollout.parsed_policy if cfg.rollout.exit_policy else policy
    dev = torch.device(args.device)
    if cfg.backend == "megatron":
        from learner.publish import looped_exporter
        from pipeline.backends.megatron_adapter import MegatronTrainer

        trainer: Any = MegatronTrainer(cfg, warm)
        model = load_model(warm)[1].to(dev)
    else:
        trainer = ReferenceTrainer(cfg, warm)
        model = trainer.model
    rng = random.Random(seed)
    t0 = time.time()
    t_gen = t_step = 0.0
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_tokens,
                        stop_token_ids=task.stops)  # fmt: skip
    for step in range(args.steps):
        batch = rng.sample(task.train, args.prompts)
        prompts = [p for p in batch for _ in range(args.n)]
        seeds = [derive_latent_seed(seed, f"{p.prompt_id}@{step}", j)
                 for p in batch for j in range(args.n)]  # fmt: skip
        model.eval()
        t1 = time.time()
        with torch.no_grad():
            gens = generate(model, [p.tokens for p in prompts], seeds, sp, policy, cfg.numerics)
        t_gen += time.time() - t1
        model.train()
        rollouts = []
        for i, (p, g) in enumerate(zip(prompts, gens)):
            toks = [int(t) for t in g.tokens]
            rollouts.append(Rollout(
                rollout_id=f"s{step}-{p.prompt_id}/{i % args.n}", work_id=f"s{step}-{p.prompt_id}",
                prompt_id=p.prompt_id, sample_index=i % args.n, generator_id="bench",
                latent_seed=int(g.latent_seed), prompt_tokens=np.asarray(p.tokens, np.int32),
                tokens=np.asarray(toks, np.int32),
                logprobs=np.asarray(g.logprobs.float().numpy(), np.float32),
                exit_depths=np.asarray(g.exit_depths, np.uint8), weight_version=step,
                reward=task.score(toks, dict(p.task)), full_depth=g.full_depth,
                exit_logprobs=None if g.exit_logprobs is None else g.exit_logprobs.numpy(),
            ))  # fmt: skip
        t1 = time.time()
        trainer.step(rollouts, [False] * len(rollouts))
        t_step += time.time() - t1
        if cfg.backend == "megatron":  # the generator's copy takes the new version
            # the HF state a publication writes (learner.publish's exporter: the same gather),
            # copied in memory instead of through a safetensors file
            with torch.no_grad():
                model.load_state_dict(looped_exporter(trainer.trainer.policy_model)[0])
    t_rl = time.time()
    out = eval_all(model, task, policy, args.depths, args.max_tokens, cfg.numerics)
    trainer.close()
    print(f"#   rl {t_rl - t0:.1f} s ({args.steps} steps: generation {t_gen:.1f} s, learner "
          f"steps {t_step:.1f} s), eval {time.time() - t_rl:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return out


def widen(hidden: int) -> dict[str, int] | None:
    """HF config overrides for --hidden: that width, heads of 32, MLP 2x (None: the preset)."""
    if not hidden:
        return None
    if hidden % 32:
        raise SystemExit(f"--hidden must be a multiple of 32 (head_dim 32); got {hidden}")
    heads = hidden // 32
    return {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads, "head_dim": 32}  # fmt: skip


def _job(job: tuple[list[str], int, str, str]) -> dict[str, float]:
    """--jobs: one (arm, seed) in a worker process: (run-config overrides, seed, work
    directory holding data/, init/ and warm/, the arguments as JSON) -> rl_arm's result."""
    overrides, seed, root, spec = job
    args = argparse.Namespace(**json.loads(spec))
    torch.set_num_threads(args.threads)
    task = Task(Path(root) / "data", Path(root) / "init")
    policy = policy_from_dict(json.loads(args.exit_policy)) if args.exit_policy else None
    return rl_arm(load_config(None, overrides), Path(root) / "warm", task, seed, args, policy)


def parse_arm(spec: str) -> tuple[str, list[str]]:
    """ "name" (a loop weighting) or "name:key=value;key=value" -> (name, run-config
    overrides)."""
    name, _, rest = spec.partition(":")
    extra = [kv for kv in rest.split(";") if kv] if rest else []
    if not rest:
        extra = (["objective.loop_weighting=exit_pdf", "objective.exit_pdf_gradient=true"]
                 if name == "exit_pdf_grad" else [f"objective.loop_weighting={name}"])  # fmt: skip
    return name, extra


def summarise(runs: list[dict[str, float]], warm_accuracy: float) -> dict[str, Any]:
    """Mean over seeds of each figure, the spread of the accuracies (sample standard deviation),
    the 95% t-interval of the mean accuracy over seeds (``accuracy_ci95``), and ``collapsed``:
    the seeds whose held-out accuracy fell below half the warm start's (a run that was finite
    but not healthy)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        out[key] = statistics.fmean(vals)
        if key.startswith("accuracy"):
            out[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    out["accuracy_seeds"] = [r["accuracy"] for r in runs]
    out["accuracy_ci95"] = list(t_interval(out["accuracy_seeds"])[1:])
    out["collapsed"] = sum(r["accuracy"] < 0.5 * warm_accuracy for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--arms",
        default="last,uniform,progressive,exit_pdf,exit_pdf_grad,learned",
        help="comma-separated loop weightings (exit_pdf_grad: exit_pdf with the gate's "
        "gradient), or name:key=value;key=value overrides",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--family", default="ouro")
    p.add_argument("--size", default="tiny")
    p.add_argument(
        "--task",
        default="vars,mix",
        help=f"comma-separated tasks, each its own warm start and arms ({', '.join(TASK_NAMES)})",
    )
    p.add_argument(
        "--chain", type=int, default=2, help="additions (sum) / hops (vars; mix's tracking class)"
    )
    p.add_argument("--hidden", type=int, default=0, help="hidden size over the preset's (0: keep)")
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--warm-steps", type=int, default=400)
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--warm-batch", type=int, default=32, help="rows per warm-start step")
    p.add_argument("--embed-std", type=float, default=1.0, help="input embedding std (0: keep)")
    p.add_argument(
        "--gate-warm-steps",
        type=int,
        default=0,
        help="exit-gate warm-start steps after the SFT warm start (0: none)",
    )
    p.add_argument(
        "--gate-objective",
        default="adaptive",
        choices=("adaptive", "entropy"),
        help="adaptive: Ouro stage II, the gate alone; entropy: Ouro stage I, all",
    )
    p.add_argument("--gate-lr", type=float, default=1e-2, help="gate warm-start learning rate")
    p.add_argument("--gate-beta", type=float, default=0.05, help="entropy: the entropy weight")
    p.add_argument("--gate-slope", type=float, default=50.0, help="adaptive: k of w_t")
    p.add_argument("--gate-margin", type=float, default=0.005, help="adaptive: gamma of w_t")
    p.add_argument("--steps", type=int, default=20, help="RL steps per arm and seed")
    p.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="RL learning rate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--depths", default="1,2,4,8", help="fixed eval depths")
    p.add_argument("--exit-policy", default="", help="rollout exit policy JSON; '': full depth")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared host, 2 spinning threads ran 12x slower)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="processes for the (arm, seed) runs after the warm start",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: the GPU mode (warm start, generation and evaluation on the GPU; "
        "arms train with the megatron learner there: backend=megatron)",
    )
    p.add_argument("--out", default="", help="work directory (default: a temporary one)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the CPU smoke: arms last,exit_pdf_grad, 2 seeds, 2 RL steps of 4 x 4, 300 train "
        "/ 24 test rows, 120 warm-start steps (over the other flags)",
    )
    args = p.parse_args(argv)
    args.depths = [int(x) for x in args.depths.split(",") if x]
    if args.device not in ("cpu", "cuda") or (
        args.device == "cuda" and not torch.cuda.is_available()
    ):
        raise SystemExit(f"--device must be cpu, or cuda on a host with a GPU; got {args.device!r}")
    if args.quick:  # the CPU smoke (tests/learner/test_loop_credit_bench.py): every piece, tiny
        args.arms, args.seeds, args.steps, args.prompts, args.n = "last,exit_pdf_grad", 2, 2, 4, 4
        args.train, args.test, args.warm_steps, args.depths = 300, 24, 120, [1, 4]
    args.tasks = [t for t in args.task.split(",") if t]
    bad = [t for t in args.tasks if t not in TASK_NAMES]
    if bad or not args.tasks:
        raise SystemExit(
            f"--task: comma-separated names of {', '.join(TASK_NAMES)}; got {args.task!r}"
        )
    check_gate_args(args)
    torch.set_num_threads(args.threads)
    t0, load0 = time.time(), os.getloadavg()[0]
    policy = policy_from_dict(json.loads(args.exit_policy)) if args.exit_policy else None
    arms = [parse_arm(a) for a in args.arms.split(",") if a]
    if "last" not in [name for name, _ in arms]:
        raise SystemExit("--arms: needs the arm 'last' (every arm is compared with it)")
    tasks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.tasks:
            tasks[name] = run_task(name, Path(args.out or tmp) / name, args, arms, policy)
    seeds = {
        t: {a: r["accuracy_seeds"] for a, r in res["arms"].items()} for t, res in tasks.items()
    }
    print(json.dumps({
        "tasks": tasks, "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "samples_per_arm_seed": args.steps * args.prompts * args.n,
        "wall_s": round(time.time() - t0, 1), "load_1m": [load0, os.getloadavg()[0]],
    }))  # fmt: skip
    print(json.dumps(verdict(seeds) | {"samples_per_arm_seed": args.steps * args.prompts * args.n}))
    return 0


def run_task(name: str, root: Path, args: argparse.Namespace, arms: list[tuple[str, list[str]]],
             policy: ExitPolicy | None) -> dict[str, Any]:  # fmt: skip
    """One task under ``root``: its data, the warm start (and the gate's), then every (arm,
    seed); {"arms": {arm: summarise(...)}, "warm_start": its evaluation}."""
    write_data(root / "data", args.train, args.test, name, args.chain, args.data_seed)
    base = init_checkpoint(args.family, args.size, root / "init", overrides=widen(args.hidden))
    common = [f"task.path={root / 'data'}", "task.kind=dataset", "task.reward=exact_match",
              f"rollout.max_tokens={args.max_tokens}", f"rollout.n={args.n}",
              f"rollout.prompts_per_step={args.prompts}", "objective.kind=grpo",
              f"optimizer.lr={args.lr}", f"run_dir={root / 'run'}",
              f"backend={'megatron' if args.device == 'cuda' else 'reference'}"]  # fmt: skip
    if args.exit_policy:
        common.append(f"rollout.exit_policy={args.exit_policy}")
    task = Task(root / "data", Path(base))
    if args.device == "cuda":  # the learner's automatic micro-batch holds the whole step
        # (a dataset task's prompt bound is unknown to it: 8-row micro-batches otherwise,
        # 32 forward/backward calls a step, ~8 s on the H200; CPU runs keep the old rule)
        longest = max(len(p.tokens) for p in task.train + task.test)
        common.append(f"task.max_prompt_tokens={longest}")
    cfg0 = load_config(None, common)
    warm_model = load_model(Path(base))[1]
    if args.embed_std:  # the product's warm_start.embed_std
        try:
            rescale_embedding(warm_model, args.embed_std)
        except ConfigError as e:
            raise SystemExit(f"--embed-std: {e}; pass --embed-std 0 to keep it") from None
    warm_model.to(args.device)
    ws = sft(warm_model, task, args.warm_steps, args.warm_lr, args.warm_batch, args.data_seed)
    print(f"# {name} sft: {ws}", file=sys.stderr, flush=True)
    gate: dict[str, Any] = {}
    if args.gate_warm_steps:
        gate["before"] = gate_report(warm_model, task, args, cfg0.numerics)
        gate |= gate_warm(warm_model, task, args, cfg0.numerics)
        gate["after"] = gate_report(warm_model, task, args, cfg0.numerics)
    warm = root / "warm"
    warm_model.cpu()  # (ties kept: the module moves, not copies of its tensors)
    save_checkpoint(state_dict_for_save(warm_model), read_config(Path(base)), warm,
                    tied=tied_from_module(warm_model),
                    extra_files={f.name: f for f in Path(base).iterdir()
                                 if f.is_file() and f.name != "config.json"
                                 and ".safetensors" not in f.name})  # fmt: skip
    warm_model.to(args.device)
    warm_eval: dict[str, Any] = eval_all(
        warm_model, task, policy, args.depths, args.max_tokens, cfg0.numerics
    )
    warm_eval |= {"loss_first": ws["loss_first"], "loss_last": ws["loss_last"], "s": ws["s"]}
    if gate:
        warm_eval["gate"] = gate
    print(f"# {name} warm start: {warm_eval}", file=sys.stderr, flush=True)
    jobs = [(arm, seed, [*common, *extra, f"seed={seed}", f"run_dir={root}/run-{i}"])
            for i, (arm, extra) in enumerate(arms) for seed in range(args.seeds)]  # fmt: skip
    if args.jobs > 1:  # each (arm, seed) in a spawned process: the same bits, in parallel
        import multiprocessing as mp

        spec = json.dumps(vars(args))
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            results = []  # in order, each reported as it is done (a cut-off run keeps them)
            for job, res in zip(jobs, pool.imap(_job, [(ov, s, str(root), spec)
                                                      for _, s, ov in jobs])):  # fmt: skip
                print(f"# done {name} {job[0]} seed {job[1]}: {res}", file=sys.stderr, flush=True)
                results.append(res)
    else:
        results = [rl_arm(load_config(None, ov), warm, task, seed, args, policy)
                   for _, seed, ov in jobs]  # fmt: skip
    for (arm, seed, _), res in zip(jobs, results):
        print(f"# {name} {arm} seed {seed}: {res}", file=sys.stderr, flush=True)
    out_arms = {arm: summarise([r for (n, _, _), r in zip(jobs, results) if n == arm],
                               warm_eval["accuracy"]) for arm, _ in arms}  # fmt: skip
    return {"arms": out_arms, "warm_start": warm_eval}


if __name__ == "__main__":
    sys.exit(main())
