"""``looprl run``: a whole run on this host: the learner here, N generator processes beside it.

    looprl run                                   # the quickstart (configs/quickstart.yaml)
    looprl run --config configs/ppo.yaml steps=20 generators.count=1

The learner runs in this process (pipeline.commands.learner_main.run_learner); once its endpoints are
bound, ``generators.count`` processes ``python -m pipeline.cli generator --learner ...`` start
(logs in RUN_DIR/logs/gen<i>.log, torch threads = ``generators.threads``), or with
``generators.placement=thread`` as many threads of this process
(pipeline.commands.generator_threads). At the end, on
Ctrl-C or SIGTERM, each generator is stopped by its pid (SIGTERM, then SIGKILL after 20 s),
and a summary prints the mean reward of the first and last 5 steps. When every generator has
exited (a bad setting, weights they cannot load, a crash), the run stops at the next turn and
fails (exit 1) with one line: the exit codes and the last error line of a generator's log. The terminal shows
looprl's warnings and errors and the progress bar; third-party logs and warnings go to
RUN_DIR/logs/learner.log (``-v`` shows them too; pipeline.commands.console).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from models.errors import ConfigError
from pipeline.backends.trainer_api import with_learner_threads
from pipeline.commands import console, mps
from pipeline.commands.console import generators_exited
from pipeline.commands.generator_flags import config_argv, generator_config
from pipeline.commands.generator_threads import GeneratorThreads
from pipeline.commands.learner_main import add_verbose, log_file, run_learner
from pipeline.commands.learner_stops import LearnerStopped
from pipeline.config import device as device_defaults
from pipeline.config.run import RunConfig, load_config

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run learner + generators on this host (no arguments: the quickstart)",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--config", metavar="FILE", help="run config YAML (default: the quickstart)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")

    add_verbose(p)
    p.set_defaults(func=run)
    return p


def generator_command(cfg: RunConfig, i: int, control: str, weights: str, model: Path) -> list[str]:
    """The command line of generator `i` (gen<i>) of this run: its settings derived from the
    config class (pipeline.commands.generator_flags), then generators.extra_args verbatim."""

    gen = generator_config(cfg, control, weights, model, index=i)
    return [sys.executable, "-m", "pipeline.cli", "generator", *config_argv(gen),
            *cfg.generators.extra_args]  # fmt: skip


class GeneratorsExited(RuntimeError):
    """Every generator of the run exited before the run finished."""


class Generators:
    """The generator processes of one run; stopped by pid only."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = Path(cfg.run_dir) / "logs"
        self.exited = False
        """Every generator exited while the run went on (``all_dead`` said so)."""

    def start(self, control: str, weights: str, model: Path) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        threads = str(self.cfg.generators.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                              os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        if self.cfg.generators.mps is True:
            env = mps.generator_env(env, self.cfg.generators.mps_percent)
        for i in range(self.cfg.generators.count):
            cmd = generator_command(self.cfg, i, control, weights, model)
            out = open(self.logs / f"gen{i}.log", "ab")  # noqa: SIM115
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            out.close()
            log.info("generator gen%d: pid %d", i, self.procs[-1].pid)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_dead(self) -> bool:
        """Every generator exited (a bad setting, a crash): the run cannot progress."""
        dead = bool(self.procs) and all(p.poll() is not None for p in self.procs)
        if dead and not self.exited:
            self.exited = True
            log.info("%s: stopping the run", self.exit_line())  # run() prints it as the error
        return dead

    def exit_line(self, steps: int | None = None) -> str:
        """One line: each generator's exit code and the first one's last error line."""
        return generators_exited([(f"gen{i}", p.returncode) for i, p in enumerate(self.procs)],
                                 self.logs, steps)  # fmt: skip

    def signal_stop(self) -> None:
        """SIGTERM to every generator still running (they hand back their work and exit)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.signal_stop()
        end = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("generator pid %d did not stop; SIGKILL", p.pid)
                p.kill()
                p.wait()


def run_local(cfg: RunConfig) -> dict[str, Any]:
    """Learner here + generators as processes; returns the learner's summary. The learner's
    ``learner.threads`` auto leaves the generators' threads (count x threads) their cores."""

    if cfg.generators.count and cfg.min_generators > cfg.generators.count:
        raise ConfigError(f"min_generators={cfg.min_generators}: more than the "
                          f"generators.count={cfg.generators.count} this run starts (the "
                          "first step would never come)")  # fmt: skip
    threads = cfg.generators.placement == "thread"  # then torch's threads are shared
    local = 0 if threads else cfg.generators.count * cfg.generators.threads
    cfg = with_learner_threads(cfg, local_generator_threads=local)
    gens = GeneratorThreads(cfg) if threads else Generators(cfg)
    t0 = time.time()
    try:
        # the generators are told to stop when training ends: their shutdown overlaps the
        # learner's final checkpoint and plot
        summary = run_learner(cfg, on_bound=gens.start, stop=gens.all_dead,
                              on_trained=gens.signal_stop)  # fmt: skip
    finally:
        gens.stop()
    summary["wall_s"] = time.time() - t0
    if gens.exited:  # the learner stopped because no generator is left to serve it
        raise GeneratorsExited(gens.exit_line(int(summary.get("steps") or 0)))
    return summary


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"looprl run: error: {e}", file=sys.stderr)
        return 2

    if cfg.generators.mps is True:  # before anything is printed: this may re-execute the run
        explicit = not any(c.startswith("generators.mps=") for c in cfg.device_choices)
        try:
            if getattr(args, "own_process", False):
                mps.enter(Path(cfg.run_dir), cfg.generators.learner_mps_percent, explicit)
            elif explicit:  # main([...]) from Python: the caller's process is not replaced
                raise ConfigError("run config generators.mps=true: needs `looprl run` as a "
                                  "process of its own (it re-executes itself under the daemon)")  # fmt: skip
            else:
                log.warning("generators.mps auto: looprl run inside another program; no MPS")
        except ConfigError as e:
            print(f"looprl run: error: {e}", file=sys.stderr)
            return 2
    verbose = console.verbose_from_env(getattr(args, "verbose", False))
    path = console.setup(log_file(cfg), verbose=verbose, level=logging.WARNING)
    if not verbose:
        print(f"logs: {path} (third-party warnings too; -v shows them here)", file=sys.stderr)
    device_defaults.report(cfg.device_choices, log)  # the auto keys chosen for this host
    if mps.ours() is not None:
        log.info(
            "MPS daemon pid %s (pipe %s) started by this run", mps.ours(), os.environ[mps.PIPE]
        )
    try:
        s = run_local(cfg)
    except LearnerStopped as e:  # no generators, a full disk: exit 1, as `looprl learner`
        print(f"looprl run: error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"looprl run: error: {e}", file=sys.stderr)
        return 2
    except GeneratorsExited as e:
        print(f"looprl run: error: {e}", file=sys.stderr)
        return 1
    finally:
        mps.release()  # the run's own daemon, if it started one: quits once this process exits
    print(
        f"\nrun {cfg.run_dir}: {s.get('steps', 0)} steps in {s['wall_s']:.0f} s; mean reward "
        f"first 5 steps {s.get('reward_first', float('nan')):.3f} -> last 5 steps "
        f"{s.get('reward_last', float('nan')):.3f}; max staleness {s.get('staleness_max')}"
    )
    print(
        f"metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}; plot: {s.get('plot') or 'none (no matplotlib)'}"
    )
    (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    return 0
