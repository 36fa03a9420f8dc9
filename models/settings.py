"""The one way every component's config is declared, validated, documented and loaded.

A component's config is a frozen dataclass: each field with its default and a one-line
docstring below it, values checked in ``__post_init__`` with :func:`check` (a bad value is a
:class:`models.errors.ConfigError` naming the dotted key). Composite configs (the run config)
nest them. :func:`load` merges schema defaults < a YAML file < overrides with OmegaConf and
builds the dataclass; :func:`field_docs` reads the docstrings for the reference docs.

Used by learner.config, generator.config and pipeline.config (OmegaConf is imported only
when a config is loaded).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from models.errors import ConfigError

T = TypeVar("T")

AUTO = "auto"
"""The value of a key chosen for the host when a process starts (learner.threads; the run's
device keys, pipeline.config.device; a lone generator's, generator.config.for_this_host)."""


def check(ok: bool, key: str, value: Any, why: str, *, what: str = "") -> None:
    """Raise ``ConfigError("[<what> ]<key>=<value>: <why>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{what + ' ' if what else ''}{key}={value!r}: {why}")


def checker(obj: Any, section: str, what: str = "") -> Callable[[bool, str, str], None]:
    """``need(ok, field, why)``: :func:`check` of ``obj``'s field, keyed ``section.field``."""

    def need(ok: bool, name: str, why: str) -> None:
        check(ok, f"{section}.{name}", getattr(obj, name), why, what=what)

    return need


def _own_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of the fields declared in ``cls`` itself (not its bases)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                out[a.target.id] = str(b.value.value)
    return out


def field_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """{dotted key: its one-line docstring} for every field of ``cls`` (inherited ones too),
    nested dataclass sections included, in declaration order."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if is_dataclass(base):
            docs.update(_own_docs(base))
    out: dict[str, str] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        key = prefix + f.name
        out[key] = docs.get(f.name, "")
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(default):
            out.update(field_docs(type(default), key + "."))
    return out


def defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """{dotted key: default value} of every leaf field of ``cls`` (nested sections flattened)."""
    out: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        value = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(value):
            out.update(defaults(type(value), prefix + f.name + "."))
        else:
            out[prefix + f.name] = value
    return out


def reference_table(cls: type, notes: Mapping[str, str] | None = None) -> str:
    """The Markdown reference of a config: one row per leaf key with its default and its
    docstring, or ``notes[key]`` instead (the docs' configuration tables are this text; a
    test checks they are current)."""

    def show(v: Any) -> str:
        text = "null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v)
        return f"`{text}`".replace("|", "\\|")

    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, value in defaults(cls).items():
        doc = (notes or {}).get(key) or " ".join(docs.get(key, "").split())
        doc = doc.replace("|", "\\|")
        rows.append(f"| `{key}` | {show(value)} | {doc} |")
    return "\n".join(rows) + "\n"


MARK_START, MARK_END = "<!-- config-reference:{}:start -->", "<!-- config-reference:{}:end -->"


def splice_reference(text: str, name: str, table: str) -> str:
    """``text`` with the block between the ``name`` markers replaced by ``table``
    (ValueError if the markers are missing)."""
    start, end = MARK_START.format(name), MARK_END.format(name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {start} ... {end} not found")
    return text[: i + len(start)] + "\n" + table + text[j:]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict (values parsed as YAML scalars / lists)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)))  # type: ignore[return-value]
    except Exception as e:
        raise ConfigError(f"bad override in {list(items)}: expected key=value ({e})") from None


def _writable(node: Any) -> Any:
    """Clear the read-only flag OmegaConf < 2.4 puts on every node of a frozen dataclass
    (merging a file or override into one then fails: "Cannot set value of read-only config
    node"); the dataclasses built at the end stay frozen."""
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node:
            child = node[key]
            if OmegaConf.is_config(child):
                _writable(child)
    return node


_STRUCTURED: dict[type, Any] = {}
"""schema -> its writable OmegaConf node, built once per process: building one is most of a
load's time (0.3-0.4 s for the run config); merges deep-copy it and never change it."""


def _structured(schema: type) -> Any:
    from omegaconf import OmegaConf

    node = _STRUCTURED.get(schema)
    if node is None:
        node = _STRUCTURED[schema] = _writable(OmegaConf.structured(schema))
    return node


def load(
    schema: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    what: str = "config",
    keys_hint: str = "",
    skip_none: bool = False,
) -> T:
    """Schema defaults < the YAML mapping at ``path`` < ``overrides`` (``key=value`` strings or
    a nested dict), built into ``schema``; ``skip_none``: override values of None mean "not
    given" (unset command-line flags) and are dropped. Every failure is a
    ConfigError naming where (file or overrides) and the key; ``what`` names the config in
    messages ("run config", "generator config"), ``keys_hint`` says where the keys are listed."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    layers: list[Any] = [_structured(schema)]
    where = "defaults"
    try:
        if path is not None:
            where = str(path)
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{what} file {p} not found")
            loaded = OmegaConf.load(p)
            if not OmegaConf.is_dict(loaded):
                raise ConfigError(f"{p}: expected a mapping of {what} keys at top level")
            layers.append(loaded)
        merged = OmegaConf.merge(*layers)
        if overrides:
            where = "overrides"
            given = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
            given = {k: v for k, v in given.items() if v is not None} if skip_none else given
            merged = OmegaConf.merge(merged, OmegaConf.create(dict(given)))
        obj = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        key = getattr(e, "full_key", None) or str(e).splitlines()[0]
        hint = f" ({keys_hint})" if keys_hint else ""
        raise ConfigError(f"{where}: unknown {what} key {key!r}{hint}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "")
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        msg = str(cause) if cause else str(e).splitlines()[0]
        raise ConfigError(f"{where}: {what} {key}: {msg}") from None
    assert isinstance(obj, schema)
    return obj


def to_yaml(cfg: Any) -> str:
    """A config dataclass as YAML."""
    from omegaconf import OmegaConf

    return str(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as a plain nested dict."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
