"""pipeline.commands.mps: the MPS daemon `looprl run` starts for itself (generators.mps on).

The real daemon needs an NVIDIA driver (it ran on the H100: docs/PERFORMANCE.md); here a
stand-in ``nvidia-cuda-mps-control`` on PATH tests the failure and ordering logic: a daemon that
dies at start is named with its log's tail (an explicit ``on`` refused, ``auto`` goes on
time-sliced), one that comes up is found by its control socket and quits when asked, and each
generator gets its own SM share, never the learner's."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from models.errors import ConfigError
from pipeline.commands import mps

STANDIN = """#!{python}
import os, pathlib, sys, time
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if "-f" in sys.argv:
    if os.environ.get("STANDIN_FAIL"):
        print("An instance of this daemon is already running", flush=True)
        sys.exit(1)
    print("daemon up", flush=True)
    (pipe / "control").touch()
    while not (pipe / "quit").exists():
        time.sleep(0.02)
    (pipe / "control").unlink()
else:
    if sys.stdin.read().strip() == "quit":
        (pipe / "quit").touch()
"""


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(STANDIN.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in (mps.PIPE, mps.OURS, mps.PERCENT):
        monkeypatch.delenv(key, raising=False)
    # the stand-in of a CUDA process joining: the daemon's control socket is there
    monkeypatch.setenv(mps.PROBE, f"{sys.executable} -c " + repr(
        "import os, sys; sys.exit(0 if os.path.exists(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + "
        "'/control') else 3)"))  # fmt: skip
    return exe


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
        time.sleep(0.02)
    return False


def test_a_daemon_that_dies_at_start_is_named_with_its_log(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_FAIL", "1")
    log = tmp_path / "run" / "logs" / "mps.log"
    with pytest.raises(RuntimeError, match=r"exited with 1 before its control socket appeared "
                                           r".*already running"):  # fmt: skip
        mps.start_daemon(log)
    # generators.mps=on set by the user: refused by name; auto: the run goes on without it
    with pytest.raises(ConfigError, match=r"generators.mps=true: the MPS daemon did not serve"):
        mps.enter(tmp_path / "run", 0, explicit=True)
    mps.enter(tmp_path / "run", 0, explicit=False)  # returns: no exec, no daemon
    assert mps.ours() is None


def test_a_daemon_comes_up_on_its_own_pipe_and_quits_when_asked(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, pipe = mps.start_daemon(tmp_path / "logs" / "mps.log")
    pid = proc.pid
    try:
        assert (pipe / "control").exists() and pipe.name.startswith("looprl-mps-")
        assert "daemon up" in (tmp_path / "logs" / "mps.log").read_text()
        monkeypatch.setenv(mps.PIPE, str(pipe))
        assert mps.serving() == pipe
        monkeypatch.setenv(mps.OURS, str(pid))
        assert mps.ours() == pid
        mps.release()  # asks, does not wait (the real daemon waits for this process to exit)
        assert _gone(pid), "the daemon did not quit when asked"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_a_daemon_no_cuda_process_can_join_is_stopped(
    standin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that starts but whose server a CUDA process cannot join (a host that forbids
    MPS): stopped by its pid, its pipe removed; generators.mps=true refused with the client's
    last lines, auto goes on time-sliced."""
    import subprocess

    monkeypatch.setenv(mps.PROBE, f"{sys.executable} -c " + repr(
        "import sys; print('CUDA error: all CUDA-capable devices are busy or unavailable'); "
        "sys.exit(1)"))  # fmt: skip
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    real = mps.start_daemon

    def spy(log_path: Path, timeout_s: float = 15.0):  # type: ignore[no-untyped-def]
        proc, pipe = real(log_path, timeout_s)
        started.append((proc, pipe))
        return proc, pipe

    monkeypatch.setattr(mps, "start_daemon", spy)
    with pytest.raises(ConfigError, match=r"generators.mps=true: the MPS daemon did not serve: a "
                       r"CUDA process could not join it \(exit 1: CUDA error: all CUDA-capable "
                       r"devices are busy or unavailable\)"):  # fmt: skip
        mps.enter(tmp_path / "run", 0, explicit=True)
    mps.enter(tmp_path / "run", 0, explicit=False)  # auto: returns, no exec
    assert len(started) == 2 and mps.ours() is None
    for proc, pipe in started:
        assert proc.poll() is not None  # stopped, reaped by its pid
        assert not pipe.exists()


def test_a_host_daemon_is_used_as_it_is(standin: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A daemon already serving this process (the host's): no daemon started, no re-exec."""
    pipe = tmp_path / "host-mps"
    pipe.mkdir()
    (pipe / "control").touch()
    monkeypatch.setenv(mps.PIPE, str(pipe))
    mps.enter(tmp_path / "run", 0, explicit=True)  # returns
    assert not (tmp_path / "run" / "logs" / "mps.log").exists()
    mps.release()  # not ours: left alone
    assert (pipe / "control").exists()


def test_each_generator_gets_its_own_share_never_the_learners() -> None:
    env = {"A": "1", mps.PERCENT: "30"}  # the learner's share, in the run's environment
    assert mps.generator_env(env, 70)[mps.PERCENT] == "70"
    assert mps.PERCENT not in mps.generator_env(env, 0)
    assert env[mps.PERCENT] == "30"  # the caller's mapping unchanged


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


@pytest.mark.slow
def test_a_run_with_mps_on_reexecutes_under_its_daemon_and_lets_it_go(
    standin: Path, tmp_path: Path
) -> None:
    """`looprl run generators.mps=on` (YAML's on: true): the launcher starts the daemon, replaces itself with the
    same command under it (the same pid: its caller waits on it), runs to the end, and asks the
    daemon to quit; the daemon is gone after the run. (On this CPU host the learner does not
    join it: the stand-in tests the process flow, the H100 run the sharing.)"""
    import re
    import subprocess

    from tests.cli.test_run_llama import ENV, QUIET, REPO

    run_dir = tmp_path / "run"
    env = {**ENV, "PATH": os.environ["PATH"], mps.PROBE: os.environ[mps.PROBE]}
    for key in (mps.PIPE, mps.OURS, mps.PERCENT):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pipeline.cli", "run", f"run_dir={run_dir}", *QUIET, "steps=2",
           "generators.engine=torch", "generators.mps=on", "generators.learner_mps_percent=40"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "auto: generators.mps=" not in log  # set by the user, not chosen
    found = re.search(r"MPS daemon pid (\d+) \(pipe (\S+)\) started by this run", log)
    assert found, log[-2000:]
    pid, pipe = int(found.group(1)), Path(found.group(2))
    assert (run_dir / "logs" / "mps.log").read_text().count("daemon up") == 1  # one start, no loop
    assert "asked to quit" in log
    end = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _alive(pid), f"the run's MPS daemon (pid {pid}) outlived the run"
    assert (pipe / "quit").exists()


def test_mps_on_without_the_daemon_is_refused_by_name(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import subprocess

    from tests.cli.test_run_llama import ENV, REPO

    env = {**ENV, "PATH": str(Path(sys.executable).parent)}  # no nvidia-cuda-mps-control
    env.pop(mps.PIPE, None)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", f"run_dir={tmp_path / 'r'}",
                           "generators.mps=on"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("looprl run: error: run config generators.mps=true: the MPS daemon did not serve: "
            "nvidia-cuda-mps-control is not on PATH") in proc.stderr  # fmt: skip


def test_mps_true_from_python_is_refused_not_reexecuted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pipeline.cli.main([...])` from another program: its process is the caller's, so the
    run does not replace it with itself under a daemon; generators.mps=true is refused."""
    from pipeline.cli import main

    rc = main(["run", f"run_dir={tmp_path / 'r'}", "generators.mps=true"])
    assert rc == 2
    assert ("looprl run: error: run config generators.mps=true: needs `looprl run` as a process "
            "of its own") in capsys.readouterr().err  # fmt: skip
