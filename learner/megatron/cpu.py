"""Run megatron-core 0.16.1 on CPU over gloo.

megatron-core assumes a CUDA device in a few dozen places: buffers allocated on
`torch.cuda.current_device()`, tensors created with a literal `device='cuda'`, parameter type
checks against `'torch.cuda.FloatTensor'`, `torch.cuda.synchronize()`, and an RNG tracker built
on the CUDA generator. `apply_cpu_compat()` redirects exactly those spots, and only when
`torch.cuda.is_available()` is False: on a GPU host it returns at once and changes nothing.

Three mechanisms, each applied to the named targets below (`describe_patches()` lists them):

- torch-view: the module global `torch` of a listed megatron module is replaced by a view of
  torch whose `cuda` answers `current_device()` with `torch.device("cpu")`, makes
  `synchronize()` / `empty_cache()` no-ops and maps the CUDA RNG calls to the CPU generator.
  Every other attribute is the real torch / torch.cuda; torch itself is never modified.
- rewrite: a listed function is recompiled from its own source with literal edits
  (`device='cuda'` -> `device='cpu'`, ...). Each edit must match its expected count, so another
  megatron version fails loudly (`CpuCompatError`) instead of being half patched.
- replace: megatron's RNG tracker class and its CUDA rng-state getter/setter are swapped for
  CPU versions with the same semantics (`learner.megatron.rng`).

Everything is checked and compiled before anything is mutated, so a mismatch leaves megatron
untouched. Call it before building models, DDP wrappers or optimizers;
`learner.parallel.init_distributed` does. See docs/LEARNER_CPU.md.

This module imports only torch (and its error type): the megatron modules named by the patch tables are imported by
`apply_cpu_compat()`, never at import time. The mechanics (the torch view, the source rewrites)
come first, then the tables of what is patched and `apply_cpu_compat()`.
"""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import re
import sys
import textwrap
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from learner.megatron.errors import CpuCompatError

__all__ = [
    "REDIRECTED_CUDA_CALLS",
    "REWRITES",
    "TORCH_VIEW",
    "TORCH_VIEW_MODULES",
    "PatchRecord",
    "PreparedRewrite",
    "Rewrite",
    "applied_patches",
    "apply_cpu_compat",
    "cpu_compat_active",
    "cuda_call_counts",
    "describe_patches",
    "install_torch_view",
    "prepare_rewrite",
]

_CPU = torch.device("cpu")


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


# --------------------------------------------------------------------------------------------
# what is patched, and applying it
# --------------------------------------------------------------------------------------------

_TP = "megatron.core.tensor_parallel"
_OPT = "megatron.core.optimizer"
_CKPT = "megatron.core.dist_checkpointing.strategies"

TORCH_VIEW_MODULES: tuple[tuple[str, str], ...] = (
    (f"{_TP}.random", "model_parallel_cuda_manual_seed seeds the CUDA default generator"),
    (f"{_TP}.layers", "TP weights (use_cpu_initialization=False), wgrad buffers"),
    (f"{_TP}.mappings", "all-gather / reduce-scatter output buffers"),
    (f"{_TP}.utils", "1-D split / gather buffers (recompute with distributed activations)"),
    ("megatron.core.utils", "GlobalMemoryBuffer (attention score buffers)"),
    ("megatron.core.transformer.dot_product_attention", "off-by-one / learnable softmax offset"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RoPE inv_freq"),
    ("megatron.core.distributed.param_and_grad_buffer", "DDP param / grad buffers"),
    (f"{_OPT}.distrib_optimizer", "optimizer-state shard buffers (checkpoint gather / scatter)"),
    (f"{_OPT}.optimizer", "loss scale of an empty chained optimizer; empty_cache() on offload"),
    ("megatron.core.parallel_state", "synchronize() in update_pg_timeout"),
    (f"{_CKPT}.filesystem_async", "dist_checkpointing: synchronize() before writing"),
    (f"{_CKPT}.state_dict_saver", "dist_checkpointing: write-failure flag"),
    (f"{_CKPT}.async_utils", "dist_checkpointing: liveness flags, synchronize()"),
    (f"{_CKPT}.fully_parallel", "dist_checkpointing: synchronize() in fully parallel load"),
    ("megatron.core.dist_checkpointing.tensor_aware_state_dict", "synchronize() when copying"),
)
"""(module, reason): modules whose global `torch` becomes the CPU view; "on current_device()"
unless the reason says otherwise. Only the training path: the inference KV cache, CUDA-graph
static inputs and DDP buffer offloading (attention, transformer_layer, module, gpt_model,
distributed_data_parallel) are deliberately left alone."""


def _cuda(n: int, quote: str = "'") -> tuple[str, str, int]:
    return (f"device={quote}cuda{quote}", f"device={quote}cpu{quote}", n)


def _types(n: int) -> tuple[str, str, int]:
    return ("'torch.cuda.", "'torch.", n)  # 'torch.cuda.FloatTensor' -> 'torch.FloatTensor'


REWRITES: tuple[Rewrite, ...] = (
    Rewrite(
        "megatron.core.transformer.utils",
        "get_default_causal_mask",
        (_cuda(1, '"'),),
        "causal mask built on 'cuda' when attention_mask is None",
    ),
    Rewrite(
        "megatron.core.transformer.utils",
        "get_sliding_window_causal_mask",
        (_cuda(1, '"'),),
        "sliding-window mask built on 'cuda'",
    ),
    Rewrite(
        "megatron.core.utils",
        "local_multi_tensor_l2_norm",
        (_cuda(1, '"'),),
        "no-Apex grad-norm fallback returns its result on 'cuda'",
    ),
    Rewrite(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_no_pipelining",
        (_cuda(1, '"'),),
        "microbatch token counter on 'cuda'",
    ),
    Rewrite(
        f"{_OPT}.optimizer",
        "MixedPrecisionOptimizer.__init__",
        (_cuda(3),),
        "found_inf / overflow buffer / unit loss scale on 'cuda' (bf16/fp16 optimizers)",
    ),
    Rewrite(
        f"{_OPT}.optimizer",
        "Float16OptimizerWithFloat16Params.__init__",
        (_types(6),),
        "param.type() compared with 'torch.cuda.*Tensor' names",
    ),
    Rewrite(
        f"{_OPT}.optimizer", "FP32Optimizer.__init__", (_cuda(1),), "unit loss scale on 'cuda'"
    ),
    Rewrite(
        f"{_OPT}.distrib_optimizer",
        "DistributedOptimizer.__init__",
        (_types(2),),
        "param.type() compared with 'torch.cuda.*Tensor' names",
    ),
    Rewrite(
        f"{_OPT}.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
        (_types(6),),
        "param.type() compared with 'torch.cuda.*Tensor' names",
    ),
    Rewrite(
        f"{_OPT}.distrib_optimizer",
        "DistributedOptimizer.get_parameter_state_dp_zero",
        (("send_tensor.cuda()", "send_tensor.cpu()", 1),),
        "optimizer-state gather (fully_reshardable checkpoints) moves shards with .cuda()",
    ),
    Rewrite(
        f"{_OPT}.clip_grads",
        "get_grad_norm_fp32",
        (_cuda(3),),
        "grad-norm accumulators on 'cuda'",
    ),
    Rewrite(
        f"{_OPT}.clip_grads",
        "clip_grad_by_total_norm_fp32",
        (_cuda(1), _types(1)),
        "overflow buffer on 'cuda'; grads asserted to be 'torch.cuda.FloatTensor'",
    ),
    Rewrite(f"{_OPT}.clip_grads", "count_zeros_fp32", (_cuda(1),), "zero counter on 'cuda'"),
    Rewrite(
        f"{_CKPT}.state_dict_saver",
        "verify_global_md_reuse",
        (_cuda(1),),
        "dist_checkpointing: metadata-reuse vote on 'cuda'",
    ),
    Rewrite(
        f"{_CKPT}.torch",
        "sharded_tensor_to_torch_sharded_tensor",
        (('/cuda"', '/cpu"', 2),),
        "dist_checkpointing: torch ShardedTensor shard placements say 'rank:N/cuda'",
    ),
)
"""Functions recompiled with literal edits."""


@dataclass(frozen=True)
class PatchRecord:
    """One applied redirection."""

    target: str
    """Dotted name of what was patched: a module's `torch`, a function, a class attribute."""
    mechanism: str
    """`torch-view`, `rewrite` or `replace`."""
    reason: str
    """One line: which CUDA-only behaviour it redirects."""


_LOCK = threading.Lock()
_APPLIED: list[PatchRecord] = []
_ACTIVE = False


def cpu_compat_active() -> bool:
    """True once `apply_cpu_compat()` has patched this process."""
    return _ACTIVE


def applied_patches() -> tuple[PatchRecord, ...]:
    """The patches applied in this process, in order (empty on a GPU host)."""
    return tuple(_APPLIED)


def describe_patches() -> str:
    """Human-readable list of what `apply_cpu_compat()` changed in this process."""
    if not _ACTIVE:
        if torch.cuda.is_available():
            return "megatron CPU compat: not applied (CUDA is available; nothing patched)"
        return "megatron CPU compat: not applied yet (learner.megatron.cpu.apply_cpu_compat())"
    width = max(len(p.target) for p in _APPLIED)
    lines = [f"megatron CPU compat: {len(_APPLIED)} patches"]
    lines += [f"  {p.mechanism:<10s} {p.target:<{width}s}  {p.reason}" for p in _APPLIED]
    return "\n".join(lines)


def apply_cpu_compat() -> bool:
    """Redirect megatron-core's CUDA-only spots to the CPU; idempotent and thread-safe.

    Returns True when the CPU patches are in place (now or from an earlier call), False when
    `torch.cuda.is_available()` is True, in which case nothing at all is touched.
    Raises `CpuCompatError` (before changing anything) when the installed megatron-core does
    not match a patch.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _ACTIVE:
            return True
        # Phase 1: import, check and compile everything; nothing is mutated yet.
        views = []
        for name, reason in TORCH_VIEW_MODULES:
            module = importlib.import_module(name)
            if module.__dict__.get("torch") is not torch:
                raise CpuCompatError(f"{name}.torch is not the torch module")
            calls = ", ".join(f"{k} x{v}" for k, v in sorted(cuda_call_counts(module).items()))
            views.append((module, f"{reason} [torch.cuda: {calls or 'none'}]"))
        prepared = [p for p in (prepare_rewrite(spec) for spec in REWRITES) if p is not None]
        from learner.megatron import rng  # imports megatron.core.tensor_parallel.random

        # Phase 2: install.
        records: list[PatchRecord] = []
        for module, reason in views:
            install_torch_view(module)
            records.append(PatchRecord(f"{module.__name__}.torch", "torch-view", reason))
        for rewrite in prepared:
            records += [PatchRecord(t, "rewrite", rewrite.spec.reason) for t in rewrite.install()]
        records += [PatchRecord(t, "replace", reason) for t, reason in rng.install()]
        _APPLIED.extend(records)
        _ACTIVE = True
        return True
