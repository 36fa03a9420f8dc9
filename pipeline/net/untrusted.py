"""Text from peers in log lines: escaped, so that it can neither forge lines nor drive the
terminal.

A generator chooses its id (the ZeroMQ routing id, decoded with surrogateescape, so any
bytes), the ids inside its records, the reasons of its Goodbye / WorkReturn / Nack, and
through them the text of the errors they cause. Written raw, a "\\n" in such text forges a
log line, an ANSI escape sequence drives the terminal and a lone surrogate (a byte that is
not UTF-8) makes a UTF-8 log file raise ("--- Logging error ---" and a traceback).

``printable(s)`` keeps printable characters and writes every other one as Python's repr
does: ``\\n``, ``\\x1b``, ``\\udcff`` (the non-UTF-8 byte 0xff), ``\\u202e``. Backslashes are
kept as they are (a peer can write a backslash, never a control character).

:class:`EscapeArgs` is a logging filter that escapes every argument of a record
(``record.args``) this way: a str becomes its escaped text for ``%s`` (``%r`` still gives
the repr of the original, which escapes the same characters), any other object but a
number its escaped ``str`` / ``repr``. Messages (``record.msg``) are the code's own and
stay as written; code must therefore pass untrusted text as an argument (``"%s", text``),
never inside the message (an f-string). Records of ``py.warnings`` keep their lines (the
warnings module formats them from the code's own locations). The filter is idempotent (an
escaped argument is marked), so it may sit on a logger and on the handlers its records
reach: pipeline.commands.console puts it on looprl's handlers (every record of the
process), the transport modules on their own loggers (their records are escaped wherever
they go).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any


def printable(s: str) -> str:
    """``s`` with every non-printable character (``str.isprintable``: control characters,
    line and paragraph separators, format characters, lone surrogates) written as an escape."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


class _Escaped(str):
    """An escaped argument: ``%s`` gives the escaped text, ``%r`` ``self.shown`` (the
    original's repr, escaped); the filter leaves it as it is."""

    shown: str

    @classmethod
    def of(cls, text: str, shown: str) -> _Escaped:
        out = cls(text)
        out.shown = shown
        return out

    def __repr__(self) -> str:
        return self.shown


def _is_number(a: Any) -> bool:
    """Left as they are: ``%d`` / ``%f`` need them, and their text is digits."""
    return (
        a is None
        or isinstance(a, numbers.Number)
        or any(hasattr(type(a), m) for m in ("__index__", "__int__", "__float__"))
    )


def escape_arg(a: Any) -> Any:
    """One log argument, escaped (see the module docstring)."""
    if isinstance(a, _Escaped) or _is_number(a):
        return a
    if isinstance(a, str):
        return _Escaped.of(printable(a), repr(a))
    try:
        return _Escaped.of(printable(str(a)), printable(repr(a)))
    except Exception:  # a broken __str__: logging reports it as it would have
        return a


def escape_args(args: Any) -> Any:
    """``record.args`` (a tuple, or the one mapping of ``%(name)s`` formats), escaped."""
    if isinstance(args, Mapping):
        return {k: escape_arg(v) for k, v in args.items()}
    if isinstance(args, tuple):
        return tuple(escape_arg(a) for a in args)
    return args


class EscapeArgs(logging.Filter):
    """Escapes every argument of a record (and a message that is not a str); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            return True
        if record.args:
            record.args = escape_args(record.args)
        if not isinstance(record.msg, str):
            record.msg = escape_arg(record.msg)
        return True
