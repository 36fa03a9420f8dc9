"""Untrusted text in log lines: a hostile generator id (a newline, an ANSI escape, a byte
that is not UTF-8) gives exactly one line per event, visibly escaped, and never a
"--- Logging error ---" traceback; through the real logging setup
(pipeline.commands.console), in a real learner endpoint process and in this one."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pipeline.commands import console
from pipeline.net.transport.config import TransportConfig
from pipeline.net.transport.memory import MemoryNetwork
from pipeline.net.untrusted import printable
from proto.codec import Codec
from tests.pipeline import FakeClock, hello
from tests.pipeline.test_bombs import Learner

# A routing id that forges a line, turns the terminal red and is not UTF-8.
HOSTILE = b"evil\n2026-01-01 00:00:00,000 ERROR pipeline.core.coordinator: forged\x1b[31m red \xff"
PEER = HOSTILE.decode("utf-8", "surrogateescape")  # how the transport reads it
ESCAPED = ("evil\\n2026-01-01", "forged\\x1b[31m red \\udcff")
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def check_lines(text: str, events: int) -> list[str]:
    """Every line is one the formatter began; ``events`` of them name the hostile id,
    escaped; no raw escape character anywhere."""
    lines = text.splitlines()
    assert all(LINE.match(x) for x in lines), [x for x in lines if not LINE.match(x)]
    hits = [x for x in lines if "evil" in x]
    assert len(hits) == events, hits
    for x in hits:
        assert all(e in x for e in ESCAPED), x
    assert (
        "\x1b" not in text
        and "\udcff" not in text
        and "forged" not in text.replace("forged\\x1b", "")
    )
    return hits


def test_hostile_routing_id_gives_one_escaped_line_per_event(tmp_path: Path) -> None:
    log, err = tmp_path / "learner.log", tmp_path / "stderr.txt"
    lrn = Learner(log, err)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.routing_id, raw.linger = HOSTILE + b"\0" + os.urandom(8), 0
    try:
        raw.connect(lrn.endpoints["control"])
        raw.send(b"junk")  # event 1: a malformed frame
        end = time.monotonic() + 10
        while lrn.stats()["rejected"] < 1:
            assert time.monotonic() < end
            time.sleep(0.02)
        raw.send(Codec().encode(hello("someone-else")))  # event 2: a Hello for another id
        while lrn.stats()["rejected"] < 2:
            assert time.monotonic() < end
            time.sleep(0.02)
    finally:
        raw.close(0)
        ctx.term()
        lrn.stop()
    hits = check_lines(log.read_text(encoding="utf-8"), events=2)
    assert "rejected a frame from evil\\n" in hits[0] and "hello.generator_id" in hits[1]
    stderr = err.read_text(encoding="utf-8", errors="strict")  # the terminal, as written
    assert "Logging error" not in stderr and "Traceback" not in stderr
    check_lines(stderr, events=2)
    print(f"\n{len(hits)} events, {len(hits)} lines: {hits[0]}")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo console.setup in this process after the test."""
    root = logging.getLogger()
    level = root.level
    yield
    for h in list(root.handlers):
        if getattr(h, "_looprl", False):
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
    logging.captureWarnings(False)


def test_console_escapes_every_argument(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """The lines of pipeline.core that carry a generator's id and texts (a Goodbye reason,
    a WorkReturn reason, an error) reach the file and the terminal escaped."""
    logged = console.setup(tmp_path / "run.log")  # here: its terminal is capfd's stderr
    core = logging.getLogger("pipeline.core.coordinator")
    core.warning("generator %s gone (%s): %d samples to re-dispatch", PEER, f"goodbye: {PEER}", 3)
    core.info("generator %s returned %d samples: %s", PEER, 2, PEER)
    core.error("generator %r dropped for the run: %s", PEER, ValueError(PEER))
    core.warning("%(gid)s held %(n)d items", {"gid": PEER, "n": 4})
    core.warning(ValueError(PEER))  # a message that is not a str
    for h in logging.getLogger().handlers:
        h.flush()
    hits = check_lines(logged.read_text(encoding="utf-8"), events=5)
    assert "gone (goodbye: evil\\n" in hits[0] and "3 samples" in hits[0]
    assert "'evil\\n" in hits[2]  # %r: the repr, escaped once
    assert "held 4 items" in hits[3]
    err = capfd.readouterr().err
    assert "Logging error" not in err
    check_lines(err, events=5)  # the terminal: looprl's own lines from INFO


def test_transport_warnings_are_escaped_without_console(caplog: pytest.LogCaptureFixture) -> None:
    """The transport's own lines are escaped at the source (any handler, here pytest's)."""
    caplog.set_level(logging.WARNING, logger="pipeline.net.transport.session")
    net, clock = MemoryNetwork(), FakeClock()
    cfg = TransportConfig(heartbeat_interval_s=1.0, peer_timeout_s=5.0)
    ep = net.bind("learner", cfg, clock=clock)
    ep.inbox.put(("control", PEER, [b"junk"]))
    assert ep.recv(0) is None and ep.stats.rejected == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and all(e in line for e in ESCAPED)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("générateur-1 中文 ok", "générateur-1 中文 ok"),  # printable: unchanged
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x1b[2J\x07\x7f\x9b", "\\x1b[2J\\x07\\x7f\\x9b"),
        ("x\udcffy", "x\\udcffy"),  # a byte that is not UTF-8 (surrogateescape)
        ("abc\u202egnp.exe\u2028", "abc\\u202egnp.exe\\u2028"),  # bidi override, line sep
        ("back\\slash", "back\\slash"),
    ],
)
def test_printable(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(shown) == shown
