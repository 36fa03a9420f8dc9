"""Why a learner stops before its last step when the user must act, in one line each.

:class:`LearnerStopped` (a ConfigError, so every command that prints ConfigError in one
line prints these too) has two kinds: :class:`LearnerStalled` (no training step for
max_wait_s: the line says which endpoint to start generators on) and :class:`DiskFull`
(the file system of the run directory is full: the line names the path, what the run
kept, and that ``looprl learner --resume RUN_DIR`` continues once space is freed).

Nothing acknowledged is lost on a full disk: the recorder appends and flushes a rollout's
frame before the learner acknowledges it (pipeline.core.recorder), so a frame that could
not be written was never acknowledged and its generator sends it again; a checkpoint is
written to a temporary directory and renamed only when complete (learner.checkpoint: a
failed write raises CheckpointWriteError, an OSError naming the checkpoint directory with
ENOSPC when the disk was full, after removing the partial directory; its line names the
checkpoint, the cause and the space free when it failed).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

from models.errors import ConfigError
from proto.stream.format import StreamError
from proto.stream.reader import StreamReader

LOW_SPACE_BYTES = 1 << 20  # below this many free bytes a failed write is taken as "disk full"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class LearnerStopped(ConfigError):
    """The run cannot go on until the user acts; the message is the one line to print."""


class LearnerStalled(LearnerStopped):
    """No training step for max_wait_s: the line says where generators connect."""


class DiskFull(LearnerStopped):
    """The run directory's file system is full: the line names the path and what was kept."""


def _no_space(err: BaseException) -> OSError | None:
    """The first ENOSPC / EDQUOT OSError in ``err``'s chain (causes and contexts)."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _free(run_dir: Path) -> tuple[int, int] | None:
    try:
        usage = shutil.disk_usage(run_dir)
    except OSError:
        return None
    return usage.free, usage.total


def disk_full(run_dir: Path, err: BaseException, trainer: Any) -> DiskFull | None:
    """A DiskFull for ``err`` when it is (or was caused by) a full file system under
    ``run_dir``: an ENOSPC in its chain, or a failure while under LOW_SPACE_BYTES are free
    (megatron's checkpoint writer reports a full disk as a torch zip-writer error)."""
    nospace = _no_space(err)
    space = _free(run_dir)
    if nospace is None and (space is None or space[0] >= LOW_SPACE_BYTES):
        return None
    path = Path(nospace.filename) if nospace is not None and nospace.filename else run_dir
    todo = (f"kept: {kept(run_dir, trainer)}; free space, then `looprl learner --resume "
            f"{run_dir}` continues from the checkpoint")  # fmt: skip
    from learner.checkpoint import CheckpointWriteError  # torch is loaded by now (not at startup)

    if isinstance(nospace, CheckpointWriteError):  # the space when it failed, before its partial
        # directory was removed; the checkpoints before it are what a resume takes
        free, total = nospace.free, nospace.total
        room = f"{free:,} of {total:,} bytes free when it failed; " if free is not None else ""
        return DiskFull(
            f"no space left on device writing checkpoint {path} ([Errno {nospace.errno}] "
            f"{nospace.strerror}; {room}the partial checkpoint was removed, a resume never "
            f"takes it); {todo}"
        )
    why = " ".join(str(err).split())
    why = why if len(why) <= 100 else why[:97] + "..."
    room = f"{space[0]:,} of {space[1]:,} bytes free" if space else "free space unknown"
    return DiskFull(
        f"no space left on device writing {path} ({room}; {type(err).__name__}: {why}); {todo}"
    )


def kept(run_dir: Path, trainer: Any) -> str:
    """What the run directory holds that a resume continues from (best effort, one line)."""
    parts: list[str] = []
    try:
        ckpt = trainer.latest(run_dir)
    except Exception:  # noqa: BLE001 (a report: never mask the stop it describes)
        ckpt = None
    parts.append(f"checkpoint {ckpt}" if ckpt else "no checkpoint yet (a resume starts over)")
    stream = run_dir / "stream"
    if stream.is_dir():
        try:
            with StreamReader(stream) as r:
                parts.append(f"stream {stream} with {len(r)} frames (every acknowledged rollout)")
        except StreamError as e:
            parts.append(f"stream {stream} (unreadable: {e})")
    digests = run_dir / "weights" / "digests.jsonl"
    try:
        lines = digests.read_text().splitlines() if digests.is_file() else []
        newest = max((int(json.loads(ln)["version"]) for ln in lines if ln.strip()), default=0)
    except (OSError, ValueError, KeyError):
        newest = 0
    if newest:
        parts.append(f"weights up to v{newest}")
    steps = run_dir / "steps.jsonl"
    if steps.is_file():
        n = sum(1 for ln in steps.read_text(errors="replace").splitlines() if ln.strip())
        parts.append(f"{n} steps logged in {steps.name}")
    return ", ".join(parts)
