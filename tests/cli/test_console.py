"""pipeline.commands.console: looprl's lines on the terminal, third-party logs and warnings in the file.

(Loggers that do not propagate to the root, like torch's own, keep their own handlers.)"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from pipeline.commands import console


def _emit() -> None:
    logging.getLogger("pipeline.core.coordinator").info("own info line")
    logging.getLogger("megatron.core.optimizer").info("third-party info line")
    logging.getLogger("somelib.worker").error("third-party error line")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        site = "/x/site-packages/megatron/core/optimizer/__init__.py"
        warnings.warn_explicit("Apex is not installed", UserWarning, site, 24)
        warnings.warn_explicit("torch.load default", FutureWarning, site, 30)
        own = str(Path(console.__file__).resolve())
        warnings.warn_explicit("an own warning", UserWarning, own, 1)


def test_quiet_terminal_full_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = console.setup(tmp_path / "logs" / "learner.log")
    _emit()
    err = capsys.readouterr().err
    assert "own info line" in err and "third-party error line" in err and "an own warning" in err
    assert "third-party info line" not in err and "Apex" not in err and "FutureWarning" not in err
    text = path.read_text()
    for s in ("own info line", "third-party info line", "third-party error line",
              "UserWarning: Apex is not installed", "FutureWarning: torch.load default"):  # fmt: skip
        assert s in text, s


def test_verbose_shows_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOPRL_VERBOSE", "1")
    assert console.verbose_from_env()
    console.setup(tmp_path / "a.log")  # a first setup is replaced by the second
    console.setup(tmp_path / "b.log", verbose=console.verbose_from_env())
    _emit()
    err = capsys.readouterr().err
    assert "third-party info line" in err and "UserWarning: Apex" in err
    assert err.count("own info line") == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_log_file_is_one_line_not_a_traceback_per_record(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every write to /dev/full fails with ENOSPC, as a log file on a full disk does (the
    disk-full checkpoint test met logging's "--- Logging error ---" traceback there): one
    warning line for the file, whatever the number of records; a record that is not an
    OSError's victim still goes through logging's own report."""
    handler = console.LogFile("/dev/full")
    lg = logging.getLogger("test_console.full")
    lg.propagate = False
    lg.addHandler(handler)
    try:
        for i in range(3):
            lg.error("record %d", i)
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Logging error" not in err, err
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("looprl: warning: the log file /dev/full could not take")
        assert "(ENOSPC)" in lines[0], lines[0]
        lg.error("bad %d", "not a number")  # a formatting error: logging's own report
        assert "Logging error" in capsys.readouterr().err
    finally:
        lg.removeHandler(handler)
        handler.close()
