"""``looprl learner``: the learner process (rank 0 hosts the coordinator).

    looprl learner [--config FILE] [--resume RUN_DIR] [key=value ...]
    torchrun --nproc-per-node 2 -m pipeline.cli learner --config configs/grpo.yaml tp=2

Order: load the config (defaults < FILE < overrides; on --resume the run's own config.yaml
replaces the defaults) -> the initial checkpoint (``model.path``, or a fresh family/size in
RUN_DIR/init) -> the trainer (megatron: learner.parallel.init_distributed first) -> bind
the endpoints and print how generators connect -> on --resume restore the latest
checkpoint (pipeline.core.resume) -> the coordinator loop with a progress bar, metrics and
checkpoints every ``checkpoint.every`` steps -> a final checkpoint, the plot, a summary.
SIGTERM / SIGINT stop after the current turn (final checkpoint included). ``--resume`` of a
run that already did its ``steps`` says so and leaves it (summary.json included) as it was.
The terminal shows looprl's own lines and the progress bar; third-party logging and
warnings (megatron, torch) go to RUN_DIR/logs/learner.log (``-v`` shows them here too,
pipeline.commands.console). Exit codes: 0 done, 1 the run failed, 2 bad settings (a busy port, a bad
model directory, ...). A run that stops because the user must act ends in one line and
exit 1 (pipeline.commands.learner_stops): no training step for max_wait_s (the endpoint to
start generators on), or a full disk (the path, what was kept, ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq
from omegaconf import OmegaConf
from tqdm import tqdm

from models.checkpoint import load_config as load_model_config
from models.errors import ConfigError
from models.random_init import init_checkpoint
from pipeline.backends.ranks import Leader, follow
from pipeline.backends.trainer_api import build_trainer, with_learner_threads
from pipeline.commands import console
from pipeline.commands.evaluation import eval_prompts
from pipeline.commands.generator_flags import config_argv, generator_config
from pipeline.commands.learner_stops import LearnerStalled, LearnerStopped, disk_full
from pipeline.commands.warm_start import warm_start_chain
from pipeline.config import device as device_defaults
from pipeline.config.run import (
    RunConfig,
    check_sections,
    load_config,
    parse_overrides_line,
    read_yaml,
    to_dict,
    to_yaml,
)
from pipeline.core import resume as resume_mod
from pipeline.core import tasks
from pipeline.core.coordinator import Coordinator
from pipeline.core.coordinator_errors import CoordinatorError
from pipeline.core.efficiency import Efficiency
from pipeline.core.eval_rounds import (
    EvalRounds,
    check_depths,
    environment_rescorer,
    reward_rescorer,
)
from pipeline.core.metrics import MetricsWriter, read_metrics, summary
from pipeline.core.profiling import StepProfiler
from pipeline.core.tasks import load_prompts as load
from pipeline.core.validation import ModelLimits
from pipeline.net.security import ServerCurve
from pipeline.net.transport.zmq import ZmqLearnerEndpoint

log = logging.getLogger(__name__)
OnBound = Callable[[str, str, Path], None]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "learner",
        help="run the learner (coordinator on rank 0); generators connect to it",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument(
        "--config", metavar="FILE", help="run config YAML (pipeline.config.run.RunConfig)"
    )
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    add_verbose(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.set_defaults(func=run)
    return p


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show third-party logs and warnings (megatron, torch) here, not "
                        "only in RUN_DIR/logs/learner.log (env: LOOPRL_VERBOSE=1)")  # fmt: skip


def resolve_config(config: str | None, resume: str | None, overrides: list[str]) -> RunConfig:
    """Config for a new run, or for ``--resume RUN_DIR`` (its config.yaml, then FILE, then
    overrides; run_dir forced to RUN_DIR)."""
    if resume is None:
        return load_config(config, overrides)
    saved = Path(resume) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {resume}: {saved} not found (not a run directory)")

    base = read_yaml(saved)
    extra = read_yaml(config) if config else {}
    check_sections(extra, str(config))
    given = parse_overrides_line(overrides)
    check_sections(given, "overrides")
    merged = OmegaConf.merge(base, extra, given, {"run_dir": resume})
    return load_config(None, OmegaConf.to_container(merged))  # type: ignore[arg-type]


def model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """The starting checkpoint: ``model.path``, or RUN_DIR/init (created once); with
    ``warm_start.segments``, RUN_DIR/init is the warm-started one (from model.path or a fresh
    checkpoint), written once before the first step."""

    if cfg.model.path and not cfg.warm_start.segments:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path {p}: no config.json there (not an HF checkpoint)")
        try:
            load_model_config(p)  # names the file and the missing or bad field
        except ValueError as e:
            raise ConfigError(f"model.path: {e}") from None
        return p
    p = run_dir / "init"
    if (p / "config.json").is_file():
        return p  # created (and warm-started) by an earlier start of this run

    if not cfg.warm_start.segments:
        init_checkpoint(cfg.model.family, cfg.model.size, p, seed=cfg.model.init_seed)
        return p

    src = Path(cfg.model.path) if cfg.model.path else run_dir / ".init-fresh"
    if not cfg.model.path:
        init_checkpoint(cfg.model.family, cfg.model.size, src, seed=cfg.model.init_seed)
    warm_start_chain(cfg, src, p)  # writes RUN_DIR/init last, atomically
    if not cfg.model.path:
        shutil.rmtree(src, ignore_errors=True)
    return p


def with_embeddings_choice(cfg: RunConfig) -> RunConfig:
    """learner.lora.train_embeddings auto chosen for this run (learner.config.LoraConfig): true
    when it initializes its model itself (model.path empty), false for a given checkpoint."""
    lora = cfg.learner.lora
    if isinstance(lora.train_embeddings, bool) or not lora.on:  # (no adapters: nothing to choose)
        return cfg
    fresh = not cfg.model.path
    log.info("learner.lora.train_embeddings=%s: %s", str(fresh).lower(),
             "the run initializes its model (a random embedding)" if fresh
             else "a given checkpoint (model.path)")  # fmt: skip
    return replace(cfg, learner=replace(cfg.learner, lora=replace(lora, train_embeddings=fresh)))


def load_prompts(cfg: RunConfig, model: Path) -> Any:
    """The run's PromptSource (pipeline.core.tasks: synthetic, jsonl or dataset)."""

    return load(cfg, model)


def _free_pair(host: str) -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError(f"no free pair of ports on {host}")


def bind_endpoint(cfg: RunConfig, port: int = 0) -> Any:
    """Bind control (port) and weights (port + 1); port: endpoints.port, else the given
    one (a resumed run's own, so its generators find it again), else a free pair."""

    e = cfg.endpoints
    security = None
    if e.keys:
        security = ServerCurve.from_dir(e.keys, curve_on_loopback=e.curve_on_loopback)
    tc = cfg.transport

    port = e.port or port or _free_pair(e.host)
    ctrl, wts = f"tcp://{e.host}:{port}", f"tcp://{e.host}:{port + 1}"
    try:
        return ZmqLearnerEndpoint(tc, control=ctrl, weights=wts, security=security,
                                  insecure=e.insecure)  # fmt: skip
    except zmq.ZMQError as err:
        raise ConfigError(
            f"cannot bind the learner's endpoints {ctrl} (control) and {wts} (weights): "
            f"{err.strerror}; is another learner or process using the port? (endpoints.port="
            f"{e.port}: pick a free pair, or 0 for any)"
        ) from None


def connect_host(host: str) -> tuple[str, str]:
    """The address generators should connect to when the learner binds ``host``, and why
    (empty: ``host`` itself). A wildcard (0.0.0.0, *, ::) is not an address: use the host
    name when it resolves to a non-loopback address, else the first non-loopback address."""
    if host not in ("0.0.0.0", "*", "::", "[::]"):
        return host, ""
    name = socket.gethostname()
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        addrs = set()
    if any(not a.startswith("127.") for a in addrs):
        return name, f"{host} is every interface; {name} is this host's name"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect(("10.255.255.255", 1))  # no packet is sent: only a route lookup
            ip = str(u.getsockname()[0])
    except OSError:
        ip = ""
    if ip and not ip.startswith("127."):
        return ip, f"{host} is every interface; {ip} is this host's first non-loopback address"
    return name, f"{host} is every interface; {name} may resolve to loopback only elsewhere"


def generator_hint(cfg: RunConfig, ctrl: str, wts: str, model: Path) -> str:
    """The ``looprl generator`` command printed for users (reachable address, keys)."""
    cmd, why = generator_command(cfg, ctrl, wts, model)
    out = f"learner: generators connect with\n  {cmd}"
    return out + (f"\n  ({why})" if why else "")


def stalled_line(cfg: RunConfig, ctrl: str, wts: str, model: Path, gens: list[str],
                 detail: str) -> str:  # fmt: skip
    """The one line a learner that timed out waiting for generators ends with."""
    cmd, _ = generator_command(cfg, ctrl, wts, model)
    head = f"no training step for {cfg.max_wait_s:g}s (max_wait_s)"
    if not gens:
        return (f"{head}: no generator connected to {ctrl}; start generators on that endpoint: "
                f"`{cmd}` (or raise max_wait_s)")  # fmt: skip
    return (f"{head}: generators {', '.join(gens)} are connected to {ctrl} but no complete "
            f"group was trained ({detail}); see {log_file(cfg)} (or raise max_wait_s)")  # fmt: skip


def generator_command(cfg: RunConfig, ctrl: str, wts: str, model: Path) -> tuple[str, str]:
    """The ``looprl generator`` command line for this learner (the run's generator settings,
    pipeline.commands.generator_flags), and why its address was changed from the bind address
    ("" if it was not)."""
    host = cfg.endpoints.host
    there, why = connect_host(host)
    if why:
        ctrl, wts = (ep.replace(f"//{host}:", f"//{there}:", 1) for ep in (ctrl, wts))
    gen = generator_config(cfg, ctrl, wts, model)
    return shlex.join(["looprl", "generator", *config_argv(gen)]), why


def run_learner(cfg: RunConfig, *, resume: bool = False, on_bound: OnBound | None = None,
                stop: Callable[[], bool] | None = None,
                on_trained: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole learner (see the module docstring); returns the summary. ``on_trained``:
    called once the coordinator loop has ended, before the final checkpoint and the plot
    (`looprl run` stops its generators there, so their shutdown overlaps the learner's)."""

    run_dir = Path(cfg.run_dir)
    if os.environ.get("RANK", "0") != "0":  # torchrun: ranks > 0 repeat rank 0's trainer calls
        return _follower(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = with_learner_threads(cfg)  # auto -> a number (`looprl run` resolved it already)
    cfg = with_embeddings_choice(cfg)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    model = model_dir(cfg, run_dir)
    cfg = tasks.with_task_stops(cfg, model)  # dataset: stop at the checkpoint's EOS ids
    prompts = load_prompts(cfg, model)
    tasks.check_data(run_dir, prompts, resume=resume)  # the data a resumed run continues on
    old_port = 0
    if resume and (run_dir / "endpoints.json").is_file():  # generators reconnect by themselves
        old = json.loads((run_dir / "endpoints.json").read_text())["control"]
        old_port = int(old.rpartition(":")[2])
    endpoint = bind_endpoint(cfg, old_port)
    ctrl, wts = endpoint.endpoints["control"], endpoint.endpoints["weights"]
    (run_dir / "endpoints.json").write_text(json.dumps({"control": ctrl, "weights": wts}))
    announced = False
    if not resume:  # generators start (imports, engine) while the trainer is built: their
        # Hellos wait in the endpoint's queue; a resume starts them once it is known to go on
        print(generator_hint(cfg, ctrl, wts, model), flush=True)
        if on_bound is not None:
            on_bound(ctrl, wts, model)
        announced = True
    try:
        trainer: Any = build_trainer(cfg.backend, cfg, model)
    except BaseException:
        endpoint.close()
        raise
    if getattr(trainer, "world_size", 1) > 1:
        trainer = Leader(trainer)
    metrics = MetricsWriter(run_dir, tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb,
                            wandb_project=cfg.metrics.wandb_project, config=to_dict(cfg))  # fmt: skip
    bar = _progress(cfg)
    profiler = StepProfiler(cfg.metrics.profile_steps, run_dir / "profile")
    rows: dict[int, dict[str, Any]] = {}  # logged rows, by step (eval results join them)
    pending_eval: dict[int, dict[str, Any]] = {}

    def on_eval(step: int, ev: dict[str, Any]) -> None:
        """An eval round finished (on the generators): into its step's row (round 0: step 1)."""
        target = max(step, 1)
        if target in rows:
            rows[target].update(ev)
            metrics.log(rows[target])  # the later copy of a step's row wins (read_metrics)
        else:
            pending_eval[target] = ev

    def on_step(m: dict[str, Any]) -> None:
        m.update(pending_eval.pop(int(m["step"]), {}))
        rows[int(m["step"])] = m
        metrics.log(m)
        profiler.observe(int(m["step"]))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", stale=m["staleness_max"],
                            v=m["version"])  # fmt: skip

    limits = ModelLimits.from_checkpoint(model, cfg.rollout.parsed_policy)  # depths: the policy's
    evals = None
    if cfg.eval.every:  # evaluation rounds on the generators, outside the training stream
        e = cfg.eval
        mc = load_model_config(model)
        check_depths(e.depths, int(mc.max_depth), looped=mc.family != "llama")
        t, r = cfg.task, cfg.rollout
        rescore = (  # generators' scores not believed
            environment_rescorer(t.environment, model, template=t.template,
                                 max_turns=r.max_turns, max_env_tokens=r.max_env_tokens,
                                 timeout_s=cfg.generators.reward_timeout_s)
            if t.environment else reward_rescorer(t.reward, model)
        )  # fmt: skip
        evals = EvalRounds(
            eval_prompts(cfg, model, e.split, e.limit), n=e.n, temperature=e.temperature,
            max_tokens=cfg.rollout.max_tokens, stop_token_ids=cfg.rollout.stop_token_ids,
            run_seed=cfg.seed, stop=cfg.rollout.stop, every=e.every,
            last_step=tasks.planned_steps(cfg, prompts), on_result=on_eval,
            rescore=rescore,
            depths=e.depths,
        )  # fmt: skip
    efficiency = Efficiency.for_run(model, backprop_depth=cfg.learner.backprop_depth,
                                    ranks=getattr(trainer, "world_size", 1),
                                    policy=cfg.rollout.parsed_policy)  # fmt: skip
    coord = Coordinator(cfg, endpoint=endpoint, trainer=trainer, prompts=prompts,
                        run_dir=run_dir, limits=limits, on_step=on_step, background=True,
                        evals=evals, efficiency=efficiency)  # fmt: skip
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        log.warning("learner: %s, stopping after this turn", signal.Signals(signum).name)
        stopping["flag"] = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    finished: dict[str, Any] | None = None
    failing = False
    try:
        if resume:
            ckpt = resume_mod.latest_checkpoint(coord)
            if ckpt is None:
                raise ConfigError(f"--resume {run_dir}: no checkpoint there")
            resume_mod.restore(coord, ckpt)
            resume_mod.rewind_metrics(metrics.path, coord.step)  # one row per step
            finished = _already_finished(run_dir, coord.step, tasks.planned_steps(cfg, prompts))
            if bar is not None:
                bar.update(coord.step)
        if finished is None and not announced:
            print(generator_hint(cfg, ctrl, wts, model), flush=True)
            if on_bound is not None:
                on_bound(ctrl, wts, model)
        if finished is None:
            keep = cfg.checkpoint.keep
            if coord.evals is not None:  # the starting weights' accuracy (reported with step 1)
                coord.evals.start(coord.step, coord.version)
            profiler.observe(coord.step)  # (a window opening with the next step)
            try:
                coord.run(tasks.planned_steps(cfg, prompts), checkpoint=lambda: resume_mod.save(coord, keep),
                          stop=lambda: stopping["flag"] or (stop is not None and stop()))  # fmt: skip
            except CoordinatorError as err:
                if not str(err).startswith("no training step"):
                    raise
                detail = str(err).partition("(max_wait_s): ")[2]
                raise LearnerStalled(stalled_line(cfg, ctrl, wts, model,
                                                  sorted(coord.dispatcher.generators()), detail)
                                     ) from None  # fmt: skip
            if on_trained is not None:
                on_trained()
            if cfg.checkpoint.final:
                resume_mod.save(coord, keep)
    except BaseException as err:
        failing = True
        full = disk_full(run_dir, err, trainer) if isinstance(err, Exception) else None
        if full is not None:
            raise full from None
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if bar is not None:
            bar.close()
        _closing(failing, "the profiler", profiler.close)
        counts = coord.counts()
        # stopping on an error: a failing close (the full disk again) must not replace it
        _closing(failing, "the coordinator", coord.close)
        _closing(failing, "the endpoints", endpoint.close)
        _closing(failing, "the trainer", trainer.close)
        plot = _closing(failing, "metrics", lambda: metrics.close(
            plot=cfg.metrics.plot and finished is None and not failing))  # fmt: skip
    if finished is not None:
        return finished
    out: dict[str, Any] = {**summary(read_metrics(metrics.path)), "final_version": coord.version,
                           "final_digest": coord.last_digest, "plot": str(plot) if plot else None,
                           "counts": counts}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def _closing(failing: bool, what: str, close: Callable[[], Any]) -> Any:
    """``close()``; while stopping on an error, a failure of it is logged, not raised."""
    if not failing:
        return close()
    try:
        return close()
    except Exception as e:  # noqa: BLE001 (the error being raised is the one to report)
        log.warning("learner: closing %s failed too while stopping: %s", what, e)
        return None


def _already_finished(run_dir: Path, step: int, steps: int) -> dict[str, Any] | None:
    """The run's summary when its checkpoint is at ``steps`` already (nothing to do): then
    summary.json is left as it was (a resumed coordinator's counts start from zero)."""
    if step < steps:
        return None
    path = run_dir / "summary.json"
    try:
        done: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        done = {}
    print(f"learner: {run_dir} already finished (step {step} of steps={steps}); nothing to "
          f"do, {path.name} left as it was (raise steps=N to train further)", flush=True)  # fmt: skip
    return {**done, "already_finished": True}


def _follower(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """A learner rank > 0: build the same trainer, then follow rank 0 (pipeline.backends.ranks)."""

    if cfg.backend == "reference":
        raise ConfigError("backend=reference runs one learner process; use megatron with torchrun")
    model = Path(cfg.model.path) if cfg.model.path else run_dir / "init"
    for _ in range(600):  # rank 0 writes a fresh checkpoint first
        if (model / "config.json").is_file():
            break
        time.sleep(0.1)
    cfg = with_learner_threads(cfg)  # as rank 0 resolves it (`looprl learner`: no generators)
    trainer = build_trainer("megatron", cfg, model)
    return {"followed_steps": follow(trainer)}


def _progress(cfg: RunConfig) -> Any:
    if not cfg.metrics.progress:
        return None

    return tqdm(total=cfg.steps, desc="steps", unit="step", file=sys.stderr)


def log_file(cfg: RunConfig, name: str = "learner") -> Path:
    """RUN_DIR/logs/learner.log (rank r > 0 of torchrun: learner-rank<r>.log)."""
    rank = os.environ.get("RANK", "0")
    return Path(cfg.run_dir) / "logs" / (f"{name}.log" if rank == "0" else f"{name}-rank{rank}.log")


def run(args: argparse.Namespace) -> int:

    try:
        cfg = resolve_config(args.config, args.resume, list(args.overrides))
    except ConfigError as e:
        print(f"looprl learner: error: {_one_line(e)}", file=sys.stderr)
        return 2
    verbose = console.verbose_from_env(getattr(args, "verbose", False))
    path = console.setup(log_file(cfg), verbose=verbose)
    if not verbose:
        log.info("third-party logs and warnings go to %s (-v shows them here)", path)
    device_defaults.report(cfg.device_choices, log)  # the auto keys chosen for this host
    try:
        s = run_learner(cfg, resume=args.resume is not None)
    except LearnerStopped as e:  # no generators, a full disk: the one line says what to do
        print(f"looprl learner: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"looprl learner: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(f"learner done: {json.dumps({k: v for k, v in s.items() if k != 'counts'})}")
    return 0


def _one_line(e: BaseException) -> str:
    """An error message as one line (a ConfigError from a library may carry newlines)."""
    return " ".join(str(e).split())
