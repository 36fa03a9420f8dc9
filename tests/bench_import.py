"""Load a script of benchmarks/ as a module without putting benchmarks/ on sys.path.

benchmarks/learner.py would shadow the `learner` package for the rest of the pytest process,
and for every rank a later test spawns (spawn hands the children the parent's sys.path): the
full suite failed so, with "'learner' is not a package", in test_publish and test_trainer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `bench_<name>` (loaded once per process)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
