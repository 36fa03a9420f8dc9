"""The package layout's import rules (docs/ARCHITECTURE.md), checked on every import statement
of the source, at module level and inside functions: a rule broken anywhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("proto", "models", "weights", "generator", "learner", "pipeline")
ALLOWED = {  # package -> our packages it may import (itself always)
    "proto": set(),
    "models": {"proto"},
    "weights": {"proto", "models"},
    "generator": {"proto", "models", "weights"},
    "learner": {"proto", "models", "weights"},
    "pipeline": {"proto", "models", "weights", "generator", "learner"},
}
PIPELINE_ALLOWED = {  # pipeline sub-package -> pipeline sub-packages it may import
    "net": {"top"},
    "config": {"net"},  # the run config composes the transport's settings
    "backends": {"top", "config", "backends"},
    "core": {"top", "config", "net", "backends"},
    "commands": {"top", "config", "net", "backends", "core"},
    "top": {"top", "config", "net", "backends", "core", "commands"},  # cli.py: commands/
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _sub(module: str) -> str:
    """pipeline.<sub>.x -> sub; pipeline.cli -> top."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in PIPELINE_ALLOWED else "top"


FILES = [p for pkg in OURS for p in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layout(path: Path) -> None:
    rel = path.relative_to(ROOT).with_suffix("")
    pkg, module = rel.parts[0], ".".join(rel.parts)
    bad = []
    for name in _imports(path):
        top = name.split(".")[0]
        if top in OURS and top != pkg and top not in ALLOWED[pkg]:
            bad.append(name)
        if pkg == "pipeline" and top == "pipeline" and name.count(".") >= 1:
            if _sub(name) not in PIPELINE_ALLOWED[_sub(module)] and _sub(name) != _sub(module):
                bad.append(name)
    assert not bad, f"{rel}: imports {sorted(set(bad))} against the layout rules"


def test_the_rules_see_every_package() -> None:
    assert {p.relative_to(ROOT).parts[0] for p in FILES} == set(OURS)
    subs = {_sub(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in FILES
            if p.relative_to(ROOT).parts[0] == "pipeline"}  # fmt: skip
    assert subs == set(PIPELINE_ALLOWED)
    assert _sub("pipeline.core") == "core" and _sub("pipeline.net.transport.zmq") == "net"
    assert _sub("pipeline.config.run") == "config" and _sub("pipeline.cli") == "top"
