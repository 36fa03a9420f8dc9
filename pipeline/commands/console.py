"""Where log records and Python warnings go: looprl's own lines to the terminal, the rest to
a log file.

``setup(log_file, verbose=..., level=...)`` configures the root logger of the process:

- a file handler on ``log_file`` (e.g. RUN_DIR/logs/learner.log, appended): every record at
  INFO and above from every logger, and every Python warning (``logging.captureWarnings``),
  so megatron's and torch's UserWarnings / FutureWarnings land there, once each;
- a stderr handler: records of looprl's own packages at ``level`` and above, anyone's
  ERROR and above, and warnings raised from looprl's own code. With ``verbose`` (the
  ``-v/--verbose`` flag, or ``LOOPRL_VERBOSE=1``) it shows everything the file gets.

Both handlers escape the arguments of every record (pipeline.net.untrusted.EscapeArgs): a
generator id or a reason a peer sent, with a newline, an ANSI escape sequence or bytes that
are not UTF-8, stays on its one line, visibly escaped (``\\n``, ``\\x1b``, ``\\udcff``); so
untrusted text goes in arguments (``log.warning("... %s", text)``), never in the message.
The file is written with ``errors="backslashreplace"``: a message that still holds a lone
surrogate (a traceback's text) is written escaped instead of failing.

A record the log file cannot take (its disk full, its file system gone) is not a traceback on
the terminal (logging's default): ``LogFile`` says so in one line, once per file, and goes on
trying (a record that fits later is written); the terminal still gets what it would.

The progress bar (tqdm) writes to stderr itself and is not affected.

``last_error_line(log)``: the line a log ends on for the terminal; ``generators_exited``: the
line a run stops on when every generator exited (pipeline.commands.launcher, generator_threads).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from pipeline.net.untrusted import EscapeArgs

OWN_PACKAGES = ("pipeline", "generator", "learner", "models", "proto", "benchmarks", "__main__")
_REPO = str(Path(__file__).resolve().parents[2])
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def verbose_from_env(flag: bool = False) -> bool:
    """``flag`` or LOOPRL_VERBOSE set to something other than "", "0" or "false"."""
    return flag or os.environ.get("LOOPRL_VERBOSE", "").lower() not in ("", "0", "false")


def is_own(record: logging.LogRecord) -> bool:
    """A record from looprl's code (a warning counts when raised in a file of this repo)."""
    if record.name == "py.warnings":
        text = record.getMessage()
        return text.startswith(_REPO) and "site-packages" not in text.split(":", 1)[0]
    return record.name.split(".", 1)[0] in OWN_PACKAGES


class LogFile(logging.FileHandler):
    """A FileHandler that reports a failed write (an OSError: ENOSPC, EIO, ...) in one stderr
    line, once, instead of logging's traceback per record; other errors as logging does."""

    _told = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            self._tell(err)
        else:
            super().handleError(record)

    def close(self) -> None:
        """Closed even when its last buffered bytes cannot be written (told as above)."""
        try:
            super().close()
        except OSError as err:
            self._tell(err)

    def _tell(self, err: OSError) -> None:
        if not self._told:
            self._told = True
            code = errno.errorcode.get(err.errno or 0, "an OSError")
            print(
                f"looprl: warning: the log file {self.baseFilename} could not take a record "
                f"({code}); its later records are tried again, some may be missing",
                file=sys.stderr,
                flush=True,
            )


class _Terminal(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return is_own(record) and record.levelno >= self.level


def setup(log_file: str | Path, *, verbose: bool = False, level: int = logging.INFO) -> Path:
    """Configure logging as the module docstring says; returns the log file's path."""
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for h in list(root.handlers):  # a second setup in one process (tests) replaces the first
        if getattr(h, "_looprl", False):
            root.removeHandler(h)
            h.close()
    fmt = logging.Formatter(_FORMAT)
    to_file = LogFile(path, encoding="utf-8", errors="backslashreplace")
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.INFO)
    to_term = logging.StreamHandler()
    to_term.setFormatter(fmt)
    if not verbose:
        to_term.addFilter(_Terminal(level))
    for h in (to_file, to_term):
        h.addFilter(EscapeArgs())
        setattr(h, "_looprl", True)  # noqa: B010 (marks our handlers for a second setup)
        root.addHandler(h)
    root.setLevel(min(level, logging.INFO))
    logging.captureWarnings(True)
    return path


def last_error_line(log_path: Path, max_bytes: int = 64 << 10) -> str:
    """The last line of a generator log that reports an error (else its last line), trimmed."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, log_path.stat().st_size - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    lines = [ln.strip() for ln in lines if ln.strip()]
    errors = [ln for ln in lines if " ERROR " in ln or "error:" in ln.lower()]
    line = (errors or lines or [""])[-1]
    logged = _LOG_LINE.match(line)  # "<date> <time> ERROR <logger>: <message>"
    line = logged.group(1) if logged else line
    return line if len(line) <= 600 else line[:597] + "..."


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ [A-Z]+ [\w.]+: (.*)$")


def generators_exited(codes: list[tuple[str, Any]], logs: Path, steps: int | None = None,
                      errors: dict[str, str] | None = None) -> str:  # fmt: skip
    """One line for a run whose generators all exited: each one's exit code (``codes``: name,
    code), the first known reason (an ``errors`` entry, else the first log's last error line:
    ``logs``/NAME.log) and where the logs are."""
    listed = ", ".join(f"{name}={code}" for name, code in codes)
    after = f" after {steps} steps" if steps is not None else ""
    why = next((f"; {n}: {e}" for n, _ in codes if (e := (errors or {}).get(n))), "")
    if not why:
        why = next((f"; {n}: {line}" for n, _ in codes
                    if (line := last_error_line(logs / f"{n}.log"))), "")  # fmt: skip
    return f"every generator exited (codes {listed}){after}{why}; logs in {logs}"
