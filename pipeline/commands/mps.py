"""CUDA MPS for `looprl run`: the learner and its generator processes run kernels at once on one
GPU (``generators.mps``).

Without MPS the driver time-slices the card between processes: while the learner's kernels run
the generator's wait, so a step costs the sum of the two. Under an MPS daemon both processes are
clients of one server and their kernels share the SMs (the decode is bound by memory bandwidth,
training by arithmetic). A process joins MPS when it first initializes CUDA, and the learner's
process has by the time the run config is built (the auto keys read the card's free memory), so
``looprl run`` with ``generators.mps`` true and no daemon yet starts one of its own
(``nvidia-cuda-mps-control -f``, pipe directory a fresh /tmp/looprl-mps-*, its log in
RUN_DIR/logs/mps.log), checks that a CUDA process can join it (a host may forbid the MPS
server; ``joins``), and re-executes itself under it, same pid and arguments; the generator
processes inherit the pipe directory. ``generators.learner_mps_percent`` /
``generators.mps_percent`` set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for the learner / each
generator. At the end the run asks the daemon to quit; it exits once its last client (this
process) has. A daemon that already serves this process (the host's own, at
CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps) is used as it is and left running.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models.errors import ConfigError

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE = "CUDA_MPS_PIPE_DIRECTORY"
LOGS = "CUDA_MPS_LOG_DIRECTORY"
PERCENT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
OURS = "LOOPRL_MPS_DAEMON_PID"
"""Set in the re-executed run: the pid of the daemon this run started (its pipe: PIPE)."""
PROBE = "LOOPRL_MPS_PROBE"
"""A command (shell words) run under a new daemon to see a CUDA process join it; unset: this
Python initializing CUDA (tests put a stand-in for the stand-in daemon)."""
JOIN_TIMEOUT_S = 120.0


def serving() -> Path | None:
    """The pipe directory of an MPS daemon this process reaches (its ``control`` socket
    exists), or None."""
    pipe = Path(os.environ.get(PIPE) or "/tmp/nvidia-mps")
    return pipe if (pipe / "control").exists() else None


def ours() -> int | None:
    """The pid of the daemon this run started (in the re-executed process), or None."""
    pid = os.environ.get(OURS, "")
    return int(pid) if pid.isdigit() else None


def start_daemon(log_path: Path, timeout_s: float = 15.0) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``nvidia-cuda-mps-control -f`` with a fresh pipe directory; returns (the daemon's
    process, pipe) once its control socket exists. Raises RuntimeError (the log's tail) if it exits or does
    not come up in ``timeout_s``."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise RuntimeError(f"{CONTROL} is not on PATH")
    pipe = Path(tempfile.mkdtemp(prefix="looprl-mps-"))  # short: a unix socket path
    logs = log_path.parent / "mps"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, PIPE: str(pipe), LOGS: str(logs)}
    env.pop(PERCENT, None)  # the daemon's own default stays 100%
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([exe, "-f"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    end = time.monotonic() + timeout_s
    while not (pipe / "control").exists():
        if proc.poll() is not None or time.monotonic() > end:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(pipe, ignore_errors=True)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{CONTROL} -f exited with {proc.returncode} before its control "
                               f"socket appeared (log {log_path}: {' | '.join(tail) or 'empty'})")  # fmt: skip
        time.sleep(0.05)
    return proc, pipe


def joins(env: dict[str, str]) -> str:
    """'' when a CUDA process comes up under the daemon ``env`` names (its first client starts
    the MPS server: where the host forbids it, or the card is another's in exclusive mode, the
    learner would fail at its first CUDA call), else why not."""
    cmd = (shlex.split(os.environ[PROBE]) if os.environ.get(PROBE) else
           [sys.executable, "-c", "import torch; torch.cuda.mem_get_info()"])  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"a CUDA process did not come up under it in {JOIN_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return ""
    tail = (done.stdout + done.stderr).strip().splitlines()[-2:]
    return f"a CUDA process could not join it (exit {done.returncode}: {' | '.join(tail)})"


def stop_daemon(proc: subprocess.Popen[bytes], pipe: Path, timeout_s: float = 10.0) -> None:
    """Quit a daemon that has no clients and wait for it by its pid (SIGKILL past
    ``timeout_s``); its pipe directory removed."""
    try:
        subprocess.run([shutil.which(CONTROL) or CONTROL], input=b"quit\n", capture_output=True,
                       env={**os.environ, PIPE: str(pipe)}, timeout=timeout_s, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(pipe, ignore_errors=True)


def enter(run_dir: Path, learner_percent: int, explicit: bool) -> None:
    """Put this run (generators.mps true) under MPS before it goes on: nothing if it already is
    (this run's daemon, or the host's with the learner's share as set); else start a daemon of
    its own (none where the host's serves) and replace this process with the same command
    under it (then it does not return). If the daemon cannot start, or a CUDA process cannot
    join it (``joins``; the daemon is then stopped): ``explicit``
    (generators.mps=true was set) raises ConfigError; under auto it logs why and returns (the
    run goes on time-sliced)."""
    share = str(learner_percent) if learner_percent else None
    if ours() is not None or (serving() is not None and os.environ.get(PERCENT) == share):
        return
    env = dict(os.environ)
    if serving() is None:
        try:
            proc, pipe = start_daemon(run_dir / "logs" / "mps.log")
            env.update({PIPE: str(pipe), LOGS: str(run_dir / "logs" / "mps")})
            why = joins(env)
            if why:
                stop_daemon(proc, pipe)
                raise RuntimeError(why)
        except RuntimeError as e:
            if explicit:
                raise ConfigError("run config generators.mps=true: the MPS daemon did not "
                                  f"serve: {e}") from None  # fmt: skip
            log.warning("generators.mps auto: no MPS daemon (%s); the learner and generators "
                        "take turns on the card", e)  # fmt: skip
            return
        env[OURS] = str(proc.pid)
    if share:
        env[PERCENT] = share
    else:
        env.pop(PERCENT, None)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, argv, env)


def generator_env(env: dict[str, str], percent: int) -> dict[str, str]:
    """A generator process's environment: its own SM share (none: the learner's is not
    inherited)."""
    env = dict(env)
    if percent:
        env[PERCENT] = str(percent)
    else:
        env.pop(PERCENT, None)
    return env


def release() -> None:
    """Ask the daemon this run started to quit (it exits once this process, its last client,
    has; its empty pipe directory stays in /tmp). A daemon this run did not start is left
    alone."""
    pid = ours()
    if pid is None:
        return
    pipe = os.environ.get(PIPE, "")
    try:  # the quit command returns only when the daemon has, after this process: not waited
        asker = subprocess.Popen([shutil.which(CONTROL) or CONTROL], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # fmt: skip
        assert asker.stdin is not None
        asker.stdin.write(b"quit\n")
        asker.stdin.close()
    except OSError as e:
        log.warning("MPS daemon pid %d: quit failed (%s)", pid, e)
        return
    log.info("MPS daemon pid %d asked to quit (pipe %s; asked by pid %d)", pid, pipe, asker.pid)
