"""Run configs load, merge nested keys and resume on every omegaconf the project allows
(pyproject: >=2.3,<2.5). omegaconf 2.3 marks the nodes of a frozen dataclass read-only,
which broke every nested override, config file, ``--resume`` and ``looprl replay``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = """
import sys, tempfile, pathlib, omegaconf
from pipeline.config.run import load_config, to_yaml
from pipeline.commands.learner_main import resolve_config
d = pathlib.Path(tempfile.mkdtemp())
cfg = load_config("configs/quickstart.yaml", ["model.family=ouro", f"run_dir={d}", "steps=3"])
(d / "config.yaml").write_text(to_yaml(cfg))
back = resolve_config(None, str(d), ["rollout.n=2", "steps=5"])  # --resume / replay
assert (back.model.family, back.steps, back.rollout.n, back.run_dir) == ("ouro", 5, 2, str(d))
print("omegaconf", omegaconf.__version__, "ok")
"""


def _check(pythonpath: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO)])}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_nested_overrides_and_resume_config() -> None:
    assert "ok" in _check([])


@pytest.mark.skipif(
    not os.environ.get("LOOPRL_OMEGACONF_23"),
    reason="set LOOPRL_OMEGACONF_23=DIR after `pip install --target DIR omegaconf==2.3.0 "
    "antlr4-python3-runtime==4.9.3`",
)
def test_on_omegaconf_2_3() -> None:
    assert "omegaconf 2.3." in _check([os.environ["LOOPRL_OMEGACONF_23"]])
