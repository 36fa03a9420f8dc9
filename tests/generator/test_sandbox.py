"""The sandboxed Python tool (generator/tools/sandbox.py): real code tries to break each limit;
the limit fires, the host is fine, nothing escapes."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from generator.tools.sandbox import IS_ROOT, SandboxLimits, run_python


def _procs_of(uid: int, wait_s: float = 2.0) -> list[int]:
    """Live (not zombie: killed ones wait for PID 1 to reap them) processes of ``uid``, after
    waiting up to ``wait_s`` for none to be left."""
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid:
                    with open(f"/proc/{d}/stat") as f:
                        if f.read().rpartition(")")[2].split()[0] != "Z":
                            out.append(int(d))
            except FileNotFoundError:
                pass
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def test_plain_run() -> None:
    r = run_python("import os; print(6 * 7, os.getcwd() == os.environ['HOME'])")
    assert (r.stdout, r.exit_code, r.limit) == ("42 True\n", 0, None)


def test_infinite_loop_hits_cpu_then_wall() -> None:
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=10))
    assert r.limit == "cpu" and 0.9 <= r.elapsed_s < 3.0
    r = run_python("import time\nwhile True: time.sleep(1)", SandboxLimits(wall_s=1.0))
    assert r.limit == "wall" and r.exit_code == -9 and 1.0 <= r.elapsed_s < 2.0


def test_allocating_2_gib_fails() -> None:
    r = run_python("x = bytearray(2 << 30)\nprint('allocated')", SandboxLimits())
    assert r.limit == "memory" and "allocated" not in r.stdout


def test_100_mb_of_output_is_cut() -> None:
    t0 = time.monotonic()
    r = run_python("import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))")
    assert r.limit == "output" and len(r.stdout) == 64 << 10 and time.monotonic() - t0 < 5


def test_file_size_limit() -> None:
    r = run_python("open('big', 'wb').write(b'0' * (32 << 20))", SandboxLimits(file_bytes=1 << 20))
    assert r.limit == "file_size"


@pytest.mark.skipif(not IS_ROOT, reason="RLIMIT_NPROC per uid needs root to switch uid")
def test_fork_bomb_is_bounded_and_cleaned_up() -> None:
    bomb = (
        "import os, time\nn = 0\nfor _ in range(200):\n"
        "    if os.fork() == 0:\n        time.sleep(60); os._exit(0)\n"
        "    n += 1\n    print(n, flush=True)\n"
    )  # guarded: at most 200 sleeping children even with no limit
    r = run_python(bomb, SandboxLimits(processes=16))
    assert r.limit == "processes"
    assert int(r.stdout.split()[-1]) < 16  # the 16th process could not be made
    assert _procs_of(r.uid) == []  # every child killed
    pid = os.fork()  # the host still forks
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_no_connection_reaches_a_listener() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        r = run_python(code)
        assert r.limit == "blocked" and "socket.connect" in r.stderr
        if IS_ROOT:  # the kernel layer: an empty network namespace, only a down loopback
            ifaces = "print(sorted(x.split(':')[0].strip() for x in open('/proc/self/net/dev')"
            r2 = run_python(ifaces + ".readlines()[2:]))")
            assert r.netns and r2.stdout.strip() == "['lo']", r2
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_no_writes_outside_the_directory() -> None:
    outside = f"/tmp/outside-{uuid.uuid4().hex}"
    for code in (f"open({outside!r}, 'w').write('x')",
                 f"import os; os.open({outside!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import os; os.rename('main.py', {outside!r})",
                 "import subprocess; subprocess.run(['touch', " + repr(outside) + "])"):  # fmt: skip
        r = run_python(code)
        assert r.limit == "blocked", (code, r)
        assert not os.path.exists(outside)
    r = run_python("open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())")
    assert (r.stdout, r.limit) == ("ok\n", None)
    if IS_ROOT:  # the kernel layer under the hook: /tmp is a read-only mount, the dir is not
        ro = "import os; print([os.statvfs(d).f_flag & os.ST_RDONLY for d in ('/tmp', '.')])"
        assert run_python(ro).stdout == "[1, 0]\n"
