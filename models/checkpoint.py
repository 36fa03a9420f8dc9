"""Hugging Face checkpoint IO (config.json + safetensors), the same for every model family.

Layout, as `transformers`' `save_pretrained` writes it (HF tools and vLLM read it):

    config.json                          json.dumps(config, indent=2, sort_keys=True) + "\\n"
    model.safetensors                    when every tensor fits one shard, else
    model-00001-of-0000N.safetensors     shards of at most `max_shard_bytes` (a tensor larger
    ...                                  than that gets a shard of its own), plus
    model.safetensors.index.json         {"metadata": {"total_size": bytes},
                                          "weight_map": {tensor name: shard file}}

Safetensors metadata is {"format": "pt"}. Tensors are written as given (casting is the
caller's: `state_dict_for_save` casts parameters, not buffers such as Huginn's fp32
`freqs_cis`); keys are sorted, so a state dict always gives the same bytes and a round trip
is bit-exact. Tied weights ({target: source}, e.g. {"lm_head.weight":
"transformer.wte.weight"}) are stored once, under the source, as `save_pretrained` does;
loading with the same `tied` (or into a module whose parameters are tied) makes the target
the very tensor of its source. A checkpoint storing both (equal) names loads too.

The directory is written as a temporary sibling and renamed into place: readers see the old
checkpoint or the new one (or, for an instant while an old one is swapped out, none), never
a mix; other files of an existing directory (tokenizer, ...) are carried over.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.errors import CheckpointError, ConfigError
from models.pool import hash_pool
from models.ties import (
    alias_groups,
    apply_ties,
    drop_tied,
    same_tensor,
    view_key,
)
from proto.fileio import fsync_path

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
SAFETENSORS_METADATA = {"format": "pt"}
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

ExtraFile = bytes | str | Mapping[str, Any] | os.PathLike
"""bytes: written as is; str: UTF-8 text; mapping: JSON like config.json; path: copied."""
TensorSpec = tuple[tuple[int, ...] | torch.Size, torch.dtype | None]
"""(shape, dtype) a model expects for one tensor; dtype None means any dtype."""


def json_bytes(obj: Any) -> bytes:
    """The bytes `transformers` writes for a JSON file: indent 2, sorted keys, final newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names (sorted) in shards as `huggingface_hub` splits them: a tensor that would push
    the current shard past the limit starts a new one; one larger than the limit is alone."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name in sorted(sizes):
        size = sizes[name]
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def _shard_tensors(state: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors for one shard, none sharing memory (safetensors requires it)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in names:
        t = state[name].detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if t.numel() and ptr in seen else t
        seen.add(ptr)
    return out


_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
              torch.int32: "I32", torch.int64: "I64", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}  # fmt: skip
"""safetensors' dtype names."""

_PIECE = 64 << 20


def _write_blob_shard(path: Path, names: list[str], state: Mapping[str, torch.Tensor],
                      data: bytes | memoryview, meta: Sequence[Mapping[str, Any]]) -> None:  # fmt: skip
    """One safetensors file of the tensors ``names`` (consecutive in the blob) from the blob:
    the header, then the blob's range at its offset in 64 MiB pieces written in parallel
    (os.pwrite releases the GIL), fsynced."""
    at = {str(m["name"]): m for m in meta}
    missing = [n for n in names if n not in at]
    if missing:
        raise ValueError(f"blob: no bytes for {missing[:3]} in its metadata")
    start = int(at[names[0]]["offset"])
    header: dict[str, Any] = {"__metadata__": dict(SAFETENSORS_METADATA)}
    end = start
    for n in names:
        m, t = at[n], state[n]
        off, nbytes = int(m["offset"]), int(m["nbytes"])
        if off != end or nbytes != _nbytes(t) or t.dtype not in _ST_DTYPES:
            raise ValueError(f"blob: tensor {n!r} is not the next {_nbytes(t)} bytes of a "
                             f"supported dtype at offset {end}")  # fmt: skip
        header[n] = {"dtype": _ST_DTYPES[t.dtype], "shape": [int(d) for d in t.shape],
                     "data_offsets": [off - start, off - start + nbytes]}  # fmt: skip
        end = off + nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    head = len(raw).to_bytes(8, "little") + raw
    view = memoryview(data).cast("B")[start:end]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)

        def put(a: int) -> None:
            piece = view[a : a + _PIECE]
            done = 0
            while done < len(piece):
                done += os.pwrite(fd, piece[done:], len(head) + a + done)

        list(hash_pool().map(put, range(0, len(view), _PIECE)))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    fsync_path(path)


def _is_weights_or_config(name: str) -> bool:
    own = (CONFIG_NAME, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    return name in own or bool(_SHARD_RE.fullmatch(name))


def _check_extra_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"extra file name {name!r} must be a plain file name")
    if _is_weights_or_config(name):
        raise ValueError(f"extra file {name!r} would overwrite the checkpoint's own files")


def _write_extra(path: Path, content: ExtraFile) -> None:
    if isinstance(content, os.PathLike):
        shutil.copyfile(os.fspath(content), path)
    elif isinstance(content, bytes | str | Mapping):
        data = content.encode() if isinstance(content, str) else content
        _write_bytes(path, json_bytes(dict(data)) if isinstance(data, Mapping) else data)
    else:
        raise ValueError(
            f"extra file {path.name!r}: content must be bytes, str, a mapping or a path, "
            f"got {type(content).__name__}"
        )


def _carry_over(old: Path, new: Path) -> None:
    """Link (or copy) into `new` what `old` holds that `new` does not replace."""
    for entry in sorted(old.iterdir()):
        dest = new / entry.name
        if _is_weights_or_config(entry.name) or dest.exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dest))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst, follow_symlinks=False)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    backup = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(out_dir, backup)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(backup, out_dir)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config_dict: Mapping[str, Any],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tied: Mapping[str, str] | None = None,
    extra_files: Mapping[str, ExtraFile] | None = None,
    blob: tuple[bytes | memoryview, Sequence[Mapping[str, Any]]] | None = None,
) -> Path:
    """Write `config_dict` and `state_dict` to `out_dir` in the Hugging Face layout; return it.

    blob: (bytes, metadata) of the stored tensors (after the ties): their canonical bytes
        concatenated in sorted-name order with no gaps, and one mapping per tensor with its
        name, offset and nbytes (the weight path's blob, weights.digest, is this layout).
        Each shard's data is written from that blob (a contiguous range of it: shards and
        blob are both in sorted-name order), in pieces in parallel, and `state_dict` gives
        only names, dtypes and shapes (it may live on a device). The
        file is a valid safetensors file with its own header (data in name order).

    tied: {target: source}; the target (equal to its source, or absent) is stored as its
        source. Undeclared aliases are stored once per name, losing nothing.
    extra_files: {file name: content} (see `ExtraFile`), e.g. generation_config.json.
    Raises ValueError for non-tensor entries, a bad tie, a bad extra file, or a file at
    `out_dir`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"checkpoint path {out_dir} exists and is not a directory")
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor) or v.is_sparse]
    if bad:
        raise ValueError(f"state dict entries must be dense tensors; these are not: {bad}")
    if not isinstance(config_dict, Mapping):
        raise ValueError(f"config_dict must be a mapping, got {type(config_dict).__name__}")
    extras = dict(extra_files or {})
    for name in extras:
        _check_extra_name(name)
    state = drop_tied(state_dict, dict(tied or {}))
    shards = plan_shards({k: _nbytes(v) for k, v in state.items()}, max_shard_bytes)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            n = len(shards)
            fname = SAFE_WEIGHTS_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            if blob is None:
                save_file(_shard_tensors(state, names), str(tmp / fname), SAFETENSORS_METADATA)
                fsync_path(tmp / fname)
            else:
                _write_blob_shard(tmp / fname, names, state, *blob)
            weight_map.update({n: fname for n in names})
        if len(shards) > 1:
            total = sum(_nbytes(v) for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_bytes(tmp / SAFE_WEIGHTS_INDEX_NAME, json_bytes(index))
        _write_bytes(tmp / CONFIG_NAME, json_bytes(dict(config_dict)))
        for name in sorted(extras):
            _write_extra(tmp / name, extras[name])
        if out_dir.is_dir():
            _carry_over(out_dir, tmp)
        os.chmod(tmp, 0o755)
        fsync_path(tmp)
        _swap_into_place(tmp, out_dir)
        fsync_path(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from e


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of checkpoint directory `path` as a dict (CheckpointError if bad)."""
    file = Path(path) / CONFIG_NAME
    config = _read_json(file, "config file")
    if not isinstance(config, dict):
        raise CheckpointError(f"config file {file} must hold a JSON object, not {type(config)}")
    return config


def load_config(path: str | os.PathLike) -> Any:
    """The typed model config of checkpoint `path` (`models.config.config_from_hf_dict`).

    A ConfigError (e.g. unknown model_type) is re-raised with the file's path in front.
    """
    from models.config import CONFIG_CLASSES, config_from_hf_dict

    config = read_config(path)
    file = Path(path) / CONFIG_NAME
    if "model_type" not in config:
        raise ConfigError(
            f"{file}: config field 'model_type' is missing (expected one of "
            f"{', '.join(sorted(CONFIG_CLASSES))}; is this a looprl / HF checkpoint?)"
        )
    try:
        return config_from_hf_dict(config)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from e


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e})") from e


def _weight_files(root: Path) -> dict[Path, set[str] | None]:
    """{shard file: tensor names the index puts there (None: no index)}."""
    single = root / SAFE_WEIGHTS_NAME
    index_file = root / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():
        return {single: None}
    if not index_file.exists():
        raise CheckpointError(
            f"checkpoint {root} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}"
        )
    index = _read_json(index_file, "index file")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"index file {index_file} has no weight_map {{tensor: file}}")
    by_file: dict[str, set[str]] = {}
    for tensor, fname in weight_map.items():
        if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            raise CheckpointError(f"index file {index_file}: bad shard name {fname!r}")
        by_file.setdefault(fname, set()).add(tensor)
    missing = [f for f in sorted(by_file) if not (root / f).is_file()]
    if missing:
        detail = "; ".join(f"{f} (holds {', '.join(sorted(by_file[f])[:3])}, ...)" for f in missing)
        raise CheckpointError(
            f"checkpoint {root}: shards listed in the index are missing: {detail}"
        )
    return {root / f: names for f, names in sorted(by_file.items())}


def load_checkpoint(
    path: str | os.PathLike, *, tied: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, {name: tensor}) of checkpoint directory `path`, single file or sharded.

    tied: {target: source}; each target comes back as the very tensor of its source.
    CheckpointError, naming the file, for a missing/invalid config.json or index, a missing
    shard, a corrupt or truncated safetensors file, index and shard disagreeing, a tensor
    stored twice.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config = read_config(root)
    state: dict[str, torch.Tensor] = {}
    for file, listed in _weight_files(root).items():
        tensors = _read_safetensors(file)
        if listed is not None:
            absent, extra = sorted(listed - tensors.keys()), sorted(tensors.keys() - listed)
            if absent:
                raise CheckpointError(f"{file} lacks tensors its index lists there: {absent}")
            if extra:
                raise CheckpointError(f"{file} holds tensors its index does not list: {extra}")
        twice = sorted(tensors.keys() & state.keys())
        if twice:
            raise CheckpointError(f"{file}: tensors stored in more than one file: {twice}")
        state.update(tensors)
    state = {k: state[k] for k in sorted(state)}
    if tied:
        apply_ties(state, tied)
    return config, state


def expected_from_module(module: torch.nn.Module) -> dict[str, TensorSpec]:
    """{name: (shape, dtype)} of everything `module.state_dict()` holds."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def validate_state_dict(
    expected: Mapping[str, TensorSpec],
    got: Mapping[str, torch.Tensor],
    *,
    tied: Mapping[str, str] | None = None,
    strict_dtype: bool = False,
) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor.

    A tie target (`tied`: {target: source}) is not missing when its source is present.
    Floating point may load into another floating dtype (a cast) unless `strict_dtype`.
    """
    tied = dict(tied or {})
    missing = [n for n in sorted(expected) if n not in got and tied.get(n) not in got]
    unexpected = [n for n in sorted(got) if n not in expected]
    wrong: list[str] = []
    for name in sorted(expected.keys() & got.keys()):
        shape, dtype = expected[name]
        t = got[name]
        if tuple(t.shape) != tuple(shape):
            wrong.append(f"{name} (expected shape {tuple(shape)}, got {tuple(t.shape)})")
        elif dtype is not None and t.dtype != dtype:
            castable = t.dtype.is_floating_point and dtype.is_floating_point
            if strict_dtype or not castable:
                wrong.append(f"{name} (expected dtype {dtype}, got {t.dtype})")
    kinds = {"missing": missing, "unexpected": unexpected, "mismatched": wrong}
    problems = [f"{kind} tensors: {', '.join(names)}" for kind, names in kinds.items() if names]
    if problems:
        raise CheckpointError("state dict does not match the model: " + "; ".join(problems))


def load_into(
    module: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    tied: Mapping[str, str] | None = None,
    strict_dtype: bool = False,
) -> dict[str, str]:
    """Copy `state` into `module` in place (its ties and dtypes kept); return ties filled.

    Tied parameters of the module are found by themselves (`tied` adds more): a target
    missing from `state` is taken from its source, and {target: source} returned. Checks as
    `validate_state_dict`; nothing is copied unless everything matches.
    """
    own = module.state_dict()
    state = dict(state)
    ties = {t: s for t, s in dict(tied or {}).items() if t in own}
    for names in alias_groups(own):
        present = [n for n in names if n in state]
        for other in present[1:]:
            if not same_tensor(state[other], state[present[0]]):
                raise CheckpointError(
                    f"{other} and {present[0]} are one tensor in the model but differ in the "
                    "state dict"
                )
        if present:
            ties.update({n: present[0] for n in names if n not in state})
    filled: dict[str, str] = {}
    for target, source in sorted(ties.items()):
        if target not in state and source in state:
            state[target] = state[source]
            filled[target] = source
    validate_state_dict(expected_from_module(module), state, strict_dtype=strict_dtype)
    with torch.no_grad():
        module.load_state_dict(state, strict=True)
    return filled


def state_dict_for_save(
    module: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with floating parameters cast to `dtype`; buffers as they are.

    Ties survive the cast: names that are one tensor in the module stay one tensor.
    """
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    out, cast = dict(module.state_dict()), dict[tuple, torch.Tensor]()
    for name, t in list(out.items()):
        if dtype is not None and name in params and t.is_floating_point():
            key = view_key(t)
            out[name] = cast[key] = cast[key] if key in cast else t.detach().to(dtype)
    return out


def load_model(path: str | os.PathLike, *, seed: int = 0) -> tuple[Any, torch.nn.Module]:
    """(config, reference module) built from checkpoint `path` (`models.reference`)."""
    from models.reference import build_model

    config = load_config(path)
    model = build_model(config, seed=seed)
    _, state = load_checkpoint(path)
    load_into(model, state)
    return config, model
