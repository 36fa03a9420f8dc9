"""A sandboxed Python tool: run a code string in a separate, limited process.

``run_python(code, limits)`` writes ``code`` to ``main.py`` in a fresh temporary directory and
runs ``python -I -B`` on it there (cwd, HOME and TMPDIR the directory, a minimal environment,
its own session / process group) and returns a :class:`SandboxResult`. Which layer enforces what
(docs/REWARDS.md "Tools and remote rewards"):

- wall time: the parent kills the whole process group (SIGKILL, by pgid) at ``wall_s``;
- CPU time: RLIMIT_CPU (SIGXCPU at ``cpu_s``); memory: RLIMIT_AS (allocations fail with
  MemoryError); file size: RLIMIT_FSIZE (writes fail with EFBIG); output: the parent keeps the first
  ``output_bytes`` of stdout and of stderr and kills the group once either passes it;
- processes: RLIMIT_NPROC, which the kernel ignores for root, so when the parent is root the
  child first switches to an unused unprivileged uid/gid (one per run) and the limit holds;
- network: when root, a new, empty network namespace (``unshare(CLONE_NEWNET)``: no interface
  is up, not even loopback); always also an audit hook refusing socket connect/bind/sendto;
- writes outside the directory: the unprivileged uid (root-owned files are read-only to it),
  plus the audit hook refusing open-for-write, remove, rename, mkdir, chmod ... outside it
  (and, as root, a mount namespace where /tmp, /var/tmp and /dev/shm are read-only bind
  mounts and only the directory is writable), and refusing
  subprocess/exec/spawn and ctypes (which could bypass the hook).
The audit hook is an in-process Python layer, not a kernel boundary; the kernel layers (rlimits,
namespace, uid) hold whatever the code does.
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
READ_ONLY_DIRS = (b"/tmp", b"/var/tmp", b"/dev/shm")
"""World-writable places made read-only (bind mounts) in the run's mount namespace, as root."""
_LIBC = ctypes.CDLL(None, use_errno=True)
IS_ROOT = os.geteuid() == 0
EXIT_MEMORY, EXIT_PROCESSES, EXIT_BLOCKED, EXIT_FSIZE = 120, 121, 122, 123
PYTHON = "/usr/bin/python3" if IS_ROOT and os.path.exists("/usr/bin/python3") else sys.executable
"""Interpreter of the runs (stdlib only): as root, the system one, which the unprivileged uid
can read and execute (a venv or pyenv interpreter under /root cannot be)."""

_BOOTSTRAP = r"""
import os, sys
work = os.path.realpath(sys.argv[1])
def _inside(p):
    if isinstance(p, int): return True
    if isinstance(p, bytes): p = os.fsdecode(p)
    r = os.path.realpath(os.path.join(work, p))
    return r == work or r.startswith(work + os.sep)
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATHS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link",
          "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree"}
_NEVER = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "ctypes.",
          "socket.connect", "socket.bind", "socket.sendto", "os.kill", "os.killpg")
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        w = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags or 0) & _W
        if w and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside {work} is not allowed")
    elif event in _PATHS:
        for a in args[:2]:
            if isinstance(a, (str, bytes)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside {work} is not allowed")
    elif event.startswith(_NEVER):
        raise PermissionError(f"sandbox: {event} is not allowed")
src = open(os.path.join(work, "main.py")).read()
sys.addaudithook(_hook)
try:
    exec(compile(src, "main.py", "exec"), {"__name__": "__main__"})
except MemoryError:
    sys.stderr.write("MemoryError: the sandbox's memory limit\n"); sys.stderr.flush()
    os._exit(120)
except BlockingIOError as e:
    sys.stderr.write(f"BlockingIOError: {e} (the sandbox's process limit)\n"); sys.stderr.flush()
    os._exit(121)
except PermissionError as e:
    sys.stderr.write(f"PermissionError: {e}\n"); sys.stderr.flush()
    os._exit(122 if str(e).startswith("sandbox:") else 1)
except OSError as e:
    if e.errno != 27:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
        raise
    sys.stderr.write(f"OSError: {e} (the sandbox's file size limit)\n"); sys.stderr.flush()
    os._exit(123)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run: wall_s and cpu_s (s), memory_bytes (address space), output_bytes
    (kept of stdout and of stderr each), file_bytes (largest file written), processes
    (RLIMIT_NPROC of the run's own uid, root only: see the module docstring)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    file_bytes: int = 16 << 20
    processes: int = 16

    def __post_init__(self) -> None:
        if not (self.wall_s > 0 and self.cpu_s >= 1 and self.memory_bytes >= 64 << 20
                and self.output_bytes >= 1 and self.file_bytes >= 0 and self.processes >= 1):  # fmt: skip
            raise ValueError(f"sandbox limits {self} need wall_s > 0, cpu_s >= 1, memory_bytes "
                             ">= 64 MiB, output_bytes >= 1, file_bytes >= 0, processes >= 1")  # fmt: skip


@dataclass(frozen=True)
class SandboxResult:
    """stdout/stderr (text, each cut at output_bytes), exit_code (negative: killed by that
    signal), limit: None or "wall", "cpu", "memory", "output", "file_size", "processes",
    "blocked" (the audit hook refused an operation); elapsed_s wall time; netns/uid: which
    kernel layers were on."""

    stdout: str
    stderr: str
    exit_code: int
    limit: str | None
    elapsed_s: float
    netns: bool
    uid: int


def _preexec(limits: SandboxLimits, uid: int, netns: bool, work: str) -> None:
    """In the child between fork and exec: rlimits, network namespace, unprivileged uid."""
    for res, v in ((resource.RLIMIT_AS, limits.memory_bytes),
                   (resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_FSIZE, limits.file_bytes),
                   (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):  # fmt: skip
        resource.setrlimit(res, (v, v + 1 if res == resource.RLIMIT_CPU else v))
    if netns and _LIBC.unshare(CLONE_NEWNET) != 0:
        os._exit(125)
    if IS_ROOT:
        _private_mounts(work)
    if IS_ROOT:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _mount(src: bytes | None, dst: bytes, flags: int) -> None:
    if _LIBC.mount(src, dst, None, flags, None) != 0:
        os._exit(126)


def _private_mounts(work: str) -> None:
    """A mount namespace where READ_ONLY_DIRS are read-only and ``work`` stays writable."""
    if _LIBC.unshare(CLONE_NEWNS) != 0:
        os._exit(126)
    _mount(b"none", b"/", MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    for d in READ_ONLY_DIRS:
        if os.path.isdir(d):
            _mount(d, d, MS_BIND | MS_REC)
            _mount(None, d, MS_BIND | MS_REMOUNT | MS_RDONLY)
    w = os.fsencode(work)
    _mount(w, w, MS_BIND)  # a fresh bind mount: writable again


def _reader(pipe, cap: int, out: list[bytes], over: threading.Event) -> None:
    kept, total = bytearray(), 0
    while chunk := pipe.read(65536):
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
        if total > cap:
            over.set()
            break
    out.append(bytes(kept))


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` under ``limits`` (see the module docstring); never raises for what the code
    does. Every process of the run is killed (by process group) before this returns."""
    limits = limits or SandboxLimits()
    work = tempfile.mkdtemp(prefix="looprl-sandbox-")
    uid = random.randrange(200_000, 900_000) if IS_ROOT else os.getuid()
    netns = IS_ROOT
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if IS_ROOT:
            os.chown(work, uid, uid)
            os.chmod(work, 0o700)
        env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [PYTHON, "-I", "-B", "-c", _BOOTSTRAP, work], cwd=work, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=lambda: _preexec(limits, uid, netns, work),
        )  # fmt: skip
        over = threading.Event()
        outs: list[list[bytes]] = [[], []]
        readers = [threading.Thread(target=_reader, args=(p, limits.output_bytes, o, over),
                                    daemon=True) for p, o in ((proc.stdout, outs[0]), (proc.stderr, outs[1]))]  # fmt: skip
        for r in readers:
            r.start()
        limit = None
        deadline = t0 + limits.wall_s
        while proc.poll() is None:
            if over.is_set() or time.monotonic() >= deadline:
                limit = "output" if over.is_set() else "wall"
                break
            over.wait(0.01)
        _kill_group(proc.pid)
        code_ = proc.wait()
        elapsed = time.monotonic() - t0
        for r in readers:
            r.join(2.0)
        if limit is None and over.is_set():
            limit = "output"
        if limit is None:
            limit = {-signal.SIGXCPU: "cpu", -signal.SIGKILL: "cpu" if elapsed >= limits.cpu_s else None,
                     -signal.SIGXFSZ: "file_size", EXIT_FSIZE: "file_size", EXIT_MEMORY: "memory",
                     EXIT_PROCESSES: "processes", EXIT_BLOCKED: "blocked"}.get(code_)  # fmt: skip
        text = [b"".join(o).decode("utf-8", "replace") for o in outs]
        return SandboxResult(text[0], text[1], code_, limit, elapsed, netns, uid)
    finally:
        if IS_ROOT:
            _kill_uid_leftovers(uid)
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_uid_leftovers(uid: int) -> None:
    """Processes of the run's own uid that left its process group (os.setsid): killed by pid."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    os.kill(int(d), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
