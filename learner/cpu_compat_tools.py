"""Mechanics behind `learner.cpu_compat`: the torch view and source rewrites.

Imports only torch; the megatron modules named by the patch tables are imported by
`learner.cpu_compat.apply_cpu_compat()`, never at import time.
"""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TORCH_VIEW",
    "CpuCompatError",
    "PreparedRewrite",
    "Rewrite",
    "cuda_call_counts",
    "install_torch_view",
    "prepare_rewrite",
]

_CPU = torch.device("cpu")


class CpuCompatError(RuntimeError):
    """A patch does not match the installed megatron-core, or a CUDA-only feature was asked for."""


# --------------------------------------------------------------------------------------------
# torch view: what a patched megatron module sees as `torch`
# --------------------------------------------------------------------------------------------


class _CudaOnCpu:
    """`torch.cuda` as seen by a patched megatron module on a CPU-only host.

    Redirects device queries, synchronisation and the default-generator RNG calls to the CPU;
    every other attribute is the real `torch.cuda`, so streams, events, memory stats, ... still
    fail loudly.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)


REDIRECTED_CUDA_CALLS = frozenset(
    name for name, value in vars(_CudaOnCpu).items() if isinstance(value, staticmethod)
)
"""The `torch.cuda.<name>` calls the view answers itself."""


class _TorchView(types.ModuleType):
    """The real torch module (looked up on every access) except for `cuda`."""

    def __init__(self) -> None:
        super().__init__("torch", "torch as seen by patched megatron modules on a CPU host")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


TORCH_VIEW = _TorchView()


def install_torch_view(module: types.ModuleType) -> None:
    """Point `module.torch` at TORCH_VIEW (it must be the real torch, or already the view)."""
    current = module.__dict__.get("torch")
    if current is TORCH_VIEW:
        return
    if current is not torch:
        raise CpuCompatError(f"{module.__name__}.torch is {current!r}, expected the torch module")
    module.torch = TORCH_VIEW  # type: ignore[attr-defined]


def cuda_call_counts(module: types.ModuleType) -> dict[str, int]:
    """How often the module's source calls each redirected `torch.cuda.<name>(`."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return {}
    found = re.findall(r"\btorch\.cuda\.(\w+)\(", source)
    return dict(collections.Counter(n for n in found if n in REDIRECTED_CUDA_CALLS))


# --------------------------------------------------------------------------------------------
# source rewrites
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rewrite:
    """Recompile `module.qualname` from its own source after literal edits."""

    module: str
    """Dotted module name."""
    qualname: str
    """`function` or `Class.method`."""
    edits: tuple[tuple[str, str, int], ...]
    """(old, new, expected number of occurrences of old in the function's source)."""
    reason: str
    """One line: the CUDA-only behaviour this removes."""


@dataclass
class PreparedRewrite:
    """A compiled rewrite, checked and ready to install (nothing is mutated before install)."""

    spec: Rewrite
    owner: Any
    attr: str
    original: Any
    replacement: Any

    def install(self) -> list[str]:
        """Bind the replacement; returns the dotted names now bound to it.

        A module-level function is also rebound in every loaded megatron module that imported it
        by name (`from ... import f`), so those call sites get the CPU version too.
        """
        setattr(self.owner, self.attr, self.replacement)
        targets = [f"{self.spec.module}.{self.spec.qualname}"]
        if isinstance(self.owner, types.ModuleType):
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or mod is self.owner or not mod_name.startswith("megatron."):
                    continue
                for key, value in list(vars(mod).items()):
                    if value is self.original:
                        setattr(mod, key, self.replacement)
                        targets.append(f"{mod_name}.{key}")
        return targets


def _resolve(module: types.ModuleType, qualname: str) -> tuple[Any, str]:
    owner: Any = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def prepare_rewrite(spec: Rewrite) -> PreparedRewrite | None:
    """Check and compile one Rewrite; None when it is installed already."""
    module = importlib.import_module(spec.module)
    owner, attr = _resolve(module, spec.qualname)
    original = owner.__dict__[attr]
    wrapper: Callable[[Any], Any] | None = None
    func = original
    if isinstance(original, staticmethod | classmethod):
        wrapper, func = type(original), original.__func__
    if getattr(func, "__looprl_cpu_rewrite__", False):
        return None
    lines, first_line = inspect.getsourcelines(func)
    source = textwrap.dedent("".join(lines))
    for old, new, expected in spec.edits:
        found = source.count(old)
        if found != expected:
            raise CpuCompatError(
                f"{spec.module}.{spec.qualname}: expected {expected} x {old!r}, found {found}; "
                "the installed megatron-core does not match this patch (written for 0.16.1)"
            )
        source = source.replace(old, new)
    # Compile inside a factory whose parameter is `__class__`, so zero-argument super() in a
    # rewritten method binds to its class; line numbers keep pointing into the original file.
    body = textwrap.indent(source, "    ")
    factory = f"def __looprl_factory(__class__):\n{body}\n    return {func.__name__}\n"
    tree = ast.parse(factory)
    ast.increment_lineno(tree, first_line - 2)
    code = compile(tree, inspect.getsourcefile(func) or f"<{spec.module}>", "exec")
    namespace: dict[str, Any] = {}
    exec(code, module.__dict__, namespace)  # globals: the module's own (names resolve as before)
    new_func = namespace["__looprl_factory"](owner if isinstance(owner, type) else None)
    new_func.__qualname__ = func.__qualname__
    new_func.__looprl_cpu_rewrite__ = True
    new_func.__looprl_original__ = func
    replacement = wrapper(new_func) if wrapper else new_func
    return PreparedRewrite(spec, owner, attr, original, replacement)
