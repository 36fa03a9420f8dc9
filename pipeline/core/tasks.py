"""The prompts of a run: the synthetic task, a jsonl of token ids, or a dataset of text.

``load_prompts(cfg, model)`` builds the run's :class:`TaskSource` from ``cfg.task``:

- ``synthetic``: the count-on task (generator.rewards.synthetic_task_prompts);
- ``jsonl``: one ``{"prompt_id"?, "prompt_tokens": [ids], "task"?: {scalars}}`` per line;
- ``dataset``: local parquet / jsonl / json / csv / arrow files read with Hugging Face
  ``datasets`` (``read_split``); each row's prompt (a string, or chat messages) is rendered
  with the checkpoint's own tokenizer and chat template (models.chat.ChatRenderer); the
  answer column and the metadata columns become the reward's task dict, on top of
  ``task.reward_args``. Rendered prompts longer than the limit are dropped and counted.

Order and cursor: the dispatcher asks ``source.at(counter)`` for its c-th work item, a pure
function of (rows, task.seed, c): epoch e = c // rows visits every row once in the order of
a shuffle seeded by (seed, e) (pipeline.core.dispatch.PromptSource). The counter is saved in
every checkpoint, so a resumed run rebuilds the same source from the same files and
continues at the same row; ``cursor(c)`` names that place (epoch, index) with a fingerprint
of the prompts, and ``check_cursor(saved)`` refuses to continue over data that changed.

``check_data(run_dir, source, resume=...)`` keeps the fingerprint in RUN_DIR/task.json and
checks it on resume. ``with_task_stops(cfg, model)`` adds the checkpoint's EOS ids to
``rollout.stop_token_ids`` (dataset with ``stop_on_eos``), and ``planned_steps(cfg, source)``
caps the steps at ``task.epochs`` passes over the data.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generator.rewards import synthetic_task_prompts
from models.chat import ChatError, ChatRenderer, eos_token_ids
from models.checkpoint import read_config
from models.errors import ConfigError
from pipeline.config.run import RunConfig
from pipeline.config.sections import TaskSection
from pipeline.core.dispatch import Prompt, PromptSource

log = logging.getLogger(__name__)

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".arrow": "arrow"}  # fmt: skip
"""File extension -> the ``datasets`` builder that reads it."""


class TaskError(ConfigError):
    """The task's data cannot be read or turned into prompts; the message says where."""


@dataclass(frozen=True)
class TaskStats:
    """What loading the prompts found: rows read, prompts kept, rows dropped as too long
    (rendered tokens > limit), the limit, the longest kept prompt, a fingerprint."""

    rows: int
    kept: int
    dropped_too_long: int
    limit: int
    longest: int
    fingerprint: str


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """sha256 (16 hex digits) over every prompt's id, token ids and task, in order."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.prompt_id, p.tokens, p.task], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


class TaskSource(PromptSource):
    """A PromptSource that knows its stats and can name and check its data cursor."""

    def __init__(self, prompts: list[Prompt], seed: int, stats: TaskStats) -> None:
        super().__init__(prompts, seed)
        self.stats = stats

    def cursor(self, counter: int) -> dict[str, Any]:
        """Where work item ``counter`` reads: epoch, index in that epoch's order, rows and
        the data fingerprint (what a checkpoint stores beside the counter)."""
        epoch, index = divmod(counter, len(self.prompts))
        return {"counter": counter, "epoch": epoch, "index": index, "rows": len(self.prompts),
                "fingerprint": self.stats.fingerprint}  # fmt: skip

    def check_cursor(self, saved: dict[str, Any]) -> None:
        """TaskError unless ``saved`` (a cursor of the checkpoint) was taken on these prompts."""
        if saved.get("fingerprint") != self.stats.fingerprint or saved.get("rows") != len(
            self.prompts
        ):
            raise TaskError(
                f"the prompts changed since the checkpoint (saved {saved.get('rows')} rows, "
                f"fingerprint {saved.get('fingerprint')}; now {len(self.prompts)} rows, "
                f"{self.stats.fingerprint}): resuming would not continue where the run stopped; "
                "restore the data files (and task settings) of the run, or start a new run"
            )


# -- reading data ----------------------------------------------------------------------------
def _builder(files: list[str], where: str) -> str:
    exts = {Path(f).suffix.lower() for f in files}
    if len(exts) != 1 or next(iter(exts)) not in BUILDERS:
        raise TaskError(
            f"{where}: cannot tell the format of {sorted(exts) or files} (expected one of "
            f"{', '.join(BUILDERS)})"
        )
    return BUILDERS[exts.pop()]


def read_split(path: str, split: str, *, key: str = "task.path") -> Any:
    """The ``split`` of the data at ``path`` as a ``datasets.Dataset``: a directory written
    by ``save_to_disk``, a directory of files named by split (train*.parquet, test*.jsonl,
    ...), or a file / glob (which is the split itself, whatever its name)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask the hub
    import datasets  # local: ~2 s of imports, only for task.kind dataset

    datasets.disable_progress_bars()
    p = Path(path)
    where = f"{key}={path}"
    try:
        if p.is_dir():
            if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
                loaded = datasets.load_from_disk(str(p))
            else:
                loaded = datasets.load_dataset(str(p))
            if isinstance(loaded, datasets.Dataset):
                return loaded
            if split not in loaded:
                raise TaskError(f"{where}: no split {split!r}; it has {sorted(loaded)}")
            return loaded[split]
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
        if not files or not all(Path(f).is_file() for f in files):
            raise TaskError(f"{where}: no such data file or directory")
        builder = _builder(files, where)
        return datasets.load_dataset(builder, data_files={split: files}, split=split)
    except TaskError:
        raise
    except Exception as e:  # the library's own errors: say which path and why
        raise TaskError(f"{where}: could not read the {split!r} split: {e}") from e


def _metadata(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, default=str)


def dataset_prompts(
    t: TaskSection, model: Path, limit: int, *, path: str = "", split: str = ""
) -> tuple[list[Prompt], TaskStats]:
    """Rows of ``path`` / ``split`` (default ``t.path`` / ``t.split``) as prompts (see the
    module doc), dropping those longer than ``limit`` tokens; TaskError names a bad row."""

    path, split = path or t.path, split or t.split
    ds = read_split(path, split)
    wanted = [t.prompt_column, *([t.answer_column] if t.answer_column else []),
              *([t.id_column] if t.id_column else []), *t.metadata_columns]  # fmt: skip
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise TaskError(
            f"task.path={path} split {split!r}: no column(s) {missing}; it has {ds.column_names} "
            "(set task.prompt_column / answer_column / id_column / metadata_columns)"
        )
    try:
        renderer = ChatRenderer.from_checkpoint(model, template=t.template,
                                                system_prompt=t.system_prompt,
                                                suffix=t.instruction)  # fmt: skip
    except ChatError as e:
        raise TaskError(f"task.template={t.template}: {e}") from e
    out, dropped, longest, seen = [], 0, 0, set()
    for i, row in enumerate(ds):
        where = f"task.path={path} split {split!r} row {i}"
        prompt = row[t.prompt_column]
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        ):
            raise TaskError(f"{where}: column {t.prompt_column!r} is a {type(prompt).__name__}; "
                            "expected a string or chat messages [{role, content}]")  # fmt: skip
        try:
            tokens = renderer.render(prompt)
        except ChatError as e:
            raise TaskError(f"{where}: {e}") from e
        if len(tokens) > limit:
            dropped += 1
            continue
        pid = str(row[t.id_column]) if t.id_column else f"{split}-{i}"
        if pid in seen:
            raise TaskError(f"{where}: prompt id {pid!r} repeats (task.id_column must be unique)")
        seen.add(pid)
        task: dict[str, Any] = dict(t.reward_args)
        if t.answer_column:
            task["answer"] = None if row[t.answer_column] is None else str(row[t.answer_column])
        task.update({c: _metadata(row[c]) for c in t.metadata_columns})
        out.append(Prompt(pid, tokens, task))
        longest = max(longest, len(tokens))
    if dropped:
        log.warning("%s split %r: dropped %d of %d prompts longer than %d tokens",
                    path, split, dropped, len(ds), limit)  # fmt: skip
    if not out:
        raise TaskError(
            f"task.path={path} split {split!r}: no prompt left ({len(ds)} rows, {dropped} longer "
            f"than {limit} tokens; raise task.max_prompt_tokens or generators.max_model_len)"
        )
    return out, TaskStats(len(ds), len(out), dropped, limit, longest, fingerprint(out))


# -- the run's source ------------------------------------------------------------------------
def prompt_limit(cfg: RunConfig, model: Path) -> int:
    """Longest prompt a generator can take: task.max_prompt_tokens, else the context
    (generators.max_model_len; 0: the checkpoint's max_position_embeddings, as vLLM derives
    it) minus the completion (rollout.max_tokens)."""
    if cfg.task.max_prompt_tokens:
        return cfg.task.max_prompt_tokens
    context = cfg.generators.max_model_len
    if not context:
        hf = read_config(model)  # Huginn names it block_size (vLLM maps it the same way)
        context = int(hf.get("max_position_embeddings") or hf.get("block_size") or 0)
        if not context:
            raise ConfigError(f"{model}/config.json gives no context length: set run config "
                              "generators.max_model_len")  # fmt: skip
    room = context - cfg.rollout.max_tokens
    if room < 1:
        raise ConfigError(
            f"run config generators.max_model_len={context}: leaves no "
            f"room for a prompt beside rollout.max_tokens={cfg.rollout.max_tokens}"
        )
    return room


def load_prompts(cfg: RunConfig, model: Path) -> TaskSource:
    """The run's prompt source (see the module doc)."""
    t = cfg.task
    if t.kind == "synthetic":
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        pairs = synthetic_task_prompts(t.num_prompts, t.seed, vocab, length=cfg.rollout.max_tokens,
                                       max_step=t.max_step)  # fmt: skip
        prompts = [Prompt(f"p{i}", p, dict(k)) for i, (p, k) in enumerate(pairs)]
    elif t.kind == "jsonl":
        prompts = []
        for i, line in enumerate(Path(t.path).read_text().splitlines()):
            if line.strip():
                d = json.loads(line)
                prompts.append(Prompt(str(d.get("prompt_id", f"p{i}")), list(d["prompt_tokens"]),
                                      dict(d.get("task", {}))))  # fmt: skip
    else:
        prompts, stats = dataset_prompts(t, model, prompt_limit(cfg, model))
        log.info("task: %d prompts from %s (%s), longest %d tokens", stats.kept, t.path,
                 t.split, stats.longest)  # fmt: skip
        return TaskSource(prompts, t.seed, stats)
    longest = max((len(p.tokens) for p in prompts), default=0)
    stats = TaskStats(len(prompts), len(prompts), 0, 0, longest, fingerprint(prompts))
    return TaskSource(prompts, t.seed, stats)


def with_task_stops(cfg: RunConfig, model: Path) -> RunConfig:
    """``cfg`` with the checkpoint's EOS ids added to rollout.stop_token_ids (dataset tasks
    with ``stop_on_eos``; others unchanged)."""
    if cfg.task.kind != "dataset" or not cfg.task.stop_on_eos:
        return cfg

    eos = eos_token_ids(model)
    if not eos:
        log.warning("task.stop_on_eos: %s declares no EOS id; completions run to max_tokens", model)
    stops = list(cfg.rollout.stop_token_ids) + [
        i for i in eos if i not in cfg.rollout.stop_token_ids
    ]
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, stop_token_ids=stops))


def planned_steps(cfg: RunConfig, source: PromptSource) -> int:
    """``cfg.steps``, capped at ``task.epochs`` passes over the prompts when that is set."""
    if not cfg.task.epochs:
        return cfg.steps
    cap = max(1, cfg.task.epochs * len(source.prompts) // cfg.rollout.prompts_per_step)
    if cap < cfg.steps:
        log.warning("task.epochs=%d over %d prompts: %d steps, not %d", cfg.task.epochs,
                    len(source.prompts), cap, cfg.steps)  # fmt: skip
    return min(cfg.steps, cap)


def check_data(run_dir: Path, source: TaskSource, *, resume: bool) -> None:
    """A new run writes RUN_DIR/task.json (its data cursor's fingerprint and stats); a
    resumed run checks that its rebuilt prompts are those (TaskError otherwise), so the
    checkpoint's counter points at the same rows (see the module doc)."""
    path = run_dir / "task.json"
    if resume and path.is_file():
        source.check_cursor(json.loads(path.read_text()))
        return
    stats = dataclasses.asdict(source.stats)
    path.write_text(json.dumps({"rows": len(source.prompts), **stats}, indent=1) + "\n")
