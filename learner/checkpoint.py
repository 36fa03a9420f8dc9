"""Training checkpoints: everything needed to continue a run bit for bit.

Order of calls (every rank calls both; the run directory is on a file system all ranks see):

    path = save(trainer, run_dir, data_cursor=..., pipeline_state=..., keep_last=3)
    ...                                  # a fresh process, same world size and TP size:
    trainer = Trainer(...)               # built exactly as before (same configs, same seed)
    state = load(trainer, latest(run_dir))   # -> Resumed(step, weight_version, ...)

Layout of `<run_dir>/checkpoints/step_<step:08d>/` (step = completed `Trainer.step` calls):

    dist/<network>/   megatron dist_checkpointing (torch_dist) of the network's model and
                      optimizer (DistributedOptimizer state as `dp_reshardable`), network in
                      {policy, critic}
    rng/rank_<r:05d>.pt  this rank's RNG states: torch CPU, CUDA (all devices), numpy, python,
                      megatron's RNG tracker (named states: model-parallel, data-parallel, ...)
    loop_weights.pt   objective.loop_weighting learned only, by rank 0: the per-loop logits
                      and their Adam state (learner.objectives.loops.LearnedLoopWeights; the
                      same on every rank)
    meta.json         written last, by rank 0: format, step, update_count, weight_version,
                      world / tp / dp sizes, each network's LR-scheduler state, the caller's
                      data_cursor and pipeline_state (opaque JSON)

Atomicity: all ranks write into `.tmp-step_<step>`; after a barrier rank 0 writes meta.json,
fsyncs and renames the directory into place, then removes complete checkpoints beyond the
newest `keep_last` and stale temporary directories. A directory without meta.json is never
returned by `latest`.

A write that fails (a full disk above all) raises :class:`CheckpointWriteError`, an OSError
whose errno is the cause's (ENOSPC when the file system was full: megatron's writer reports
one as a torch zip-writer error with no errno, or as a `CheckpointException`, which is a
BaseException) and whose filename is the checkpoint directory; rank 0 removes the partial
`.tmp-step_<step>` first (it never had meta.json). The checkpoints before it are untouched.
megatron logs the failed write at ERROR before raising; while saving, those records of its
writer are demoted to WARNING (kept in the log file, off the terminal: the error raised here
is the one to report).

megatron-core 0.16.1 workarounds (docs/LEARNER_CPU.md, "megatron issues"): a fresh
optimizer's per-parameter states are created first (Adam zeros + step 0, SGD momentum zeros:
the values its first step starts from) before any sharded state dict is requested, and
FP32Optimizer's missing SGD `init_state_fn` is replaced by a no-op; the optimizer state is
loaded under `torch.no_grad()`; after loading, each parameter gets its own `step` tensor with
the checkpoint's step (megatron leaves one shared tensor holding the fresh optimizer's step);
`dp_reshardable` format.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from learner.network import adam_step_tensor
from proto.fileio import fsync_path

__all__ = ["CHECKPOINT_FORMAT", "CheckpointWriteError", "Resumed", "latest", "load", "save"]

CHECKPOINT_FORMAT = "looprl-train-ckpt/1"
_META = "meta.json"
_LOOP_WEIGHTS = "loop_weights.pt"
_OPT_META = {"distrib_optim_sharding_type": "dp_reshardable"}
LOW_SPACE_BYTES = 1 << 20  # a failed write with less free than this: the file system is full
_WRITER_LOGGERS = ("megatron.core.dist_checkpointing", "torch.distributed.checkpoint")


class CheckpointWriteError(OSError):
    """Writing checkpoint ``filename`` failed; ``errno`` ENOSPC when the file system was full
    (None: another cause, in ``strerror``). ``free`` / ``total``: bytes of the file system
    when it failed (None: unknown). The partial directory is gone; earlier checkpoints stay."""

    free: int | None = None
    total: int | None = None

    def __str__(self) -> str:
        room = f"; {self.free:,} of {self.total:,} bytes free" if self.free is not None else ""
        return (f"writing checkpoint {self.filename} failed: {self.strerror}{room}; the partial "
                "checkpoint was removed (a resume never takes it)")  # fmt: skip


@dataclass(frozen=True)
class Resumed:
    """What `load` restored besides the tensors (for the caller's own state)."""

    path: Path
    step: int
    update_count: int
    weight_version: int
    data_cursor: Any
    pipeline_state: dict[str, Any]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [
            np_state[0],
            torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            *[float(x) if isinstance(x, float) else int(x) for x in np_state[2:]],
        ],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch_cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))  # type: ignore[arg-type]
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


def _check_json(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected a JSON-serialisable value ({e})") from e


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return int(ps.get_tensor_model_parallel_world_size())


def _in_process_results_queue() -> None:
    """megatron's torch_dist writer collects its results through a multiprocessing Manager
    queue, i.e. a spawned server process (~300 MB) that nothing stops when the learner is
    killed -9: it outlived the learner. looprl saves synchronously (the results are put and
    taken in this process), so an in-process queue does the same job with no child process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(
    trainer: Any,
    run_dir: str | os.PathLike,
    *,
    data_cursor: Any = None,
    pipeline_state: dict[str, Any] | None = None,
    keep_last: int = 3,
) -> Path:
    """Save `trainer` (a learner.trainer.Trainer) as `<run_dir>/checkpoints/step_<step>`; a
    collective (every rank). data_cursor / pipeline_state: the caller's JSON-able state.
    CheckpointWriteError when writing fails (the partial directory removed)."""
    if keep_last < 1:
        raise ValueError(f"keep_last: expected >= 1, got {keep_last}")
    pipeline_state = dict(pipeline_state or {})
    _check_json("data_cursor", data_cursor)
    _check_json("pipeline_state", pipeline_state)
    root = Path(run_dir) / "checkpoints"
    name = f"step_{trainer.step_count:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    try:
        if _rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
            for net_name in trainer.networks():
                (tmp / "dist" / net_name).mkdir(parents=True)
        _barrier()
        _in_process_results_queue()
        with _writer_errors_demoted():
            _write_state(trainer, tmp)
        _barrier()
        if _rank() == 0:
            _finish(trainer, root, tmp, final, data_cursor, pipeline_state)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # megatron's CheckpointException is a BaseException
        raise _write_failed(err, root, tmp, final) from err
    if _rank() == 0:
        _prune(root, keep_last)
    _barrier()
    return final


def _write_state(trainer: Any, tmp: Path) -> None:
    """Every network's model and optimizer, this rank's RNG state, the learned loop weights."""
    from megatron.core import dist_checkpointing

    for net_name, net in trainer.networks().items():
        _init_optimizer_state(net.opt)
        model_sd = net.module.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": net.opt.sharded_state_dict(model_sd, metadata=_OPT_META),
        }
        dist_checkpointing.save(state, str(tmp / "dist" / net_name))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    learned = getattr(trainer, "loop_weights", None)  # loop_weighting learned: every rank's same
    if learned is not None and _rank() == 0:
        torch.save(learned.state_dict(), tmp / _LOOP_WEIGHTS)


def _finish(trainer: Any, root: Path, tmp: Path, final: Path, data_cursor: Any,
            pipeline_state: dict[str, Any]) -> None:  # fmt: skip
    """Rank 0: meta.json last, fsync, then the rename that makes the checkpoint complete."""
    meta = {
        "format": CHECKPOINT_FORMAT,
        "step": trainer.step_count,
        "update_count": trainer.update_count,
        "weight_version": trainer.weight_version,
        "world_size": _world(),
        "tp_size": _tp_size(),
        "dp_size": trainer.dp_size,
        "schedulers": {k: n.sched.state_dict() for k, n in trainer.networks().items()},
        "skipped_nonfinite": {k: n.skipped_nonfinite for k, n in trainer.networks().items()},
        "data_cursor": data_cursor,
        "pipeline_state": pipeline_state,
    }
    with open(tmp / _META, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    if final.exists():  # the same step saved again (e.g. after a crash): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)


def _errno(err: BaseException) -> int | None:
    """The first errno in ``err``'s chain (causes, contexts, and the per-rank failures a
    torch CheckpointException carries)."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return int(e.errno)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(v[0] for v in failures.values()
                         if isinstance(v, tuple) and v and isinstance(v[0], BaseException))  # fmt: skip
    return None


def _write_failed(err: BaseException, root: Path, tmp: Path, final: Path) -> CheckpointWriteError:
    """The CheckpointWriteError for ``err`` (its errno, else ENOSPC when under LOW_SPACE_BYTES
    are free, measured before the partial directory is removed), the partial removed."""
    code = _errno(err)
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        usage = None
    if code is None and usage is not None and usage.free < LOW_SPACE_BYTES:
        code = errno.ENOSPC
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    first = " ".join(str(err).split("Traceback")[0].split()) or type(err).__name__
    why = os.strerror(code) if code is not None else f"{type(err).__name__}: {first[:200]}"
    out = CheckpointWriteError(code, why, str(final))
    if usage is not None:
        out.free, out.total = usage.free, usage.total
    return out


class _Demote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


@contextmanager
def _writer_errors_demoted() -> Iterator[None]:
    """megatron's checkpoint writer logs a failed write at ERROR and then raises it: while
    saving, its records are WARNINGs (the log file keeps them; the raised error is reported)."""
    demote = _Demote()  # a logger's filters see only its own records: every writer module's
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(_WRITER_LOGGERS)]
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(demote)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(demote)


def _complete(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("step_*") if root.is_dir() else []:
        suffix = p.name.removeprefix("step_")
        if suffix.isdigit() and (p / _META).is_file():
            out.append((int(suffix), p))
    return sorted(out)


def _prune(root: Path, keep_last: int) -> None:
    for _, p in _complete(root)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of `run_dir` (None if there is none)."""
    found = _complete(Path(run_dir) / "checkpoints")
    return found[-1][1] if found else None


def _noop_init_state(opt: Any, config: Any = None) -> None:
    return None


def _init_optimizer_state(opt: Any) -> None:
    """Create the lazily-made per-parameter states of a fresh optimizer, with the values the
    first step would start from (so the update is unchanged): torch Adam's zeros and step 0,
    SGD's momentum buffers as zeros (0 * momentum + grad == grad exactly, dampening 0).

    megatron 0.16.1 without Apex/TE needs this: the DistributedOptimizer's state_dict()
    asserts one common Adam step (none exists before the first step), FP32Optimizer calls its
    `init_state_fn`, which is None for SGD, on loading, and an SGD momentum buffer that does not
    exist yet would be missing from the checkpoint's keys."""
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        if getattr(sub, "init_state_fn", _noop_init_state) is None:
            sub.init_state_fn = _noop_init_state
        adam = isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if adam and not state:
                    state["step"] = adam_step_tensor(0.0, group, p)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                elif isinstance(inner, torch.optim.SGD) and group.get("momentum", 0.0):
                    if state.get("momentum_buffer") is None:
                        state["momentum_buffer"] = torch.zeros_like(p)


def _restore_steps(opt: Any) -> None:
    """megatron 0.16.1 (no Apex/TE), DistributedOptimizer load: every parameter's Adam `step`
    ends up as ONE shared tensor holding the *fresh* optimizer's value (the dp_reshardable
    parameter state copies the current step into it); the checkpoint's step survives only in
    the param groups. Give each parameter its own tensor with the group's step (else clone)."""
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p)
                if not state or not isinstance(state.get("step"), torch.Tensor):
                    continue
                step = group.get("step")
                state["step"] = (
                    adam_step_tensor(float(step), group, p)
                    if step is not None
                    else state["step"].clone()
                )


def load(trainer: Any, path: str | os.PathLike) -> Resumed:
    """Restore `trainer` (built as for the saved run) from checkpoint `path`; a collective.
    ValueError when the checkpoint is incomplete or the world / TP size differ."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        raise ValueError(f"{path}: not a complete checkpoint (no {_META})")
    meta = json.loads(meta_file.read_text("utf-8"))
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    here = {"world_size": _world(), "tp_size": _tp_size()}
    for key, value in here.items():
        if meta[key] != value:
            raise ValueError(f"{path}: saved with {key}={meta[key]}, this job has {value}")
    nets = trainer.networks()
    if set(nets) != set(meta["schedulers"]):
        raise ValueError(f"{path}: networks {sorted(meta['schedulers'])}, trainer {sorted(nets)}")
    for net_name, net in nets.items():
        _init_optimizer_state(net.opt)
        model_sd = net.module.sharded_state_dict()
        opt_sd = net.opt.sharded_state_dict(model_sd, is_loading=True, metadata=_OPT_META)
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": opt_sd}, str(path / "dist" / net_name)
        )
        net.module.load_state_dict(loaded["model"])
        with torch.no_grad():  # fp32 params: the main params are views of the model params
            net.opt.load_state_dict(loaded["optimizer"])
        _restore_steps(net.opt)
        net.sched.load_state_dict(meta["schedulers"][net_name])
        # Older checkpoints predate the count: 0.
        net.skipped_nonfinite = int(meta.get("skipped_nonfinite", {}).get(net_name, 0))
    learned = getattr(trainer, "loop_weights", None)
    if learned is not None and (path / _LOOP_WEIGHTS).is_file():
        learned.load_state_dict(torch.load(path / _LOOP_WEIGHTS, map_location=learned.logits.device,
                                           weights_only=True))  # fmt: skip
    rng = torch.load(path / "rng" / f"rank_{_rank():05d}.pt", weights_only=True)
    _set_rng_state(rng)
    trainer.step_count = int(meta["step"])
    trainer.update_count = int(meta["update_count"])
    trainer.weight_version = int(meta["weight_version"])
    _barrier()
    return Resumed(
        path=path,
        step=trainer.step_count,
        update_count=trainer.update_count,
        weight_version=trainer.weight_version,
        data_cursor=meta["data_cursor"],
        pipeline_state=meta["pipeline_state"],
    )
