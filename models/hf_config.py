"""Strict parsing and writing of HF config.json dicts for the frozen family configs.

`HFConfig` is the base of every family config (`models.config`): field names are config.json
keys, annotations say the JSON type; unknown keys, missing required keys and wrong types raise
`ConfigError` naming the field; HF bookkeeping keys are kept in `hf_extra`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from models.errors import ConfigError

HF_BOOKKEEPING_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "_name_or_path",
        "initializer_range",
        "attention_dropout",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "pretraining_tp",
        "generation_config",
        "quantization_config",
    }
)
"""Keys kept verbatim (they do not change the forward pass)."""

_JSON_KINDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "str": "a string",
    "float | None": "a number or null",
    "int | None": "an integer or null",
    "tuple[str, ...]": "a list of strings",
    "None": "null (nothing else is implemented)",
}


def _coerce(name: str, kind: str, value: Any) -> Any:
    """Check one JSON value against a field's annotation; return the typed value."""
    ok = True
    if value is None and kind.endswith("None"):
        return None
    if kind == "None":
        raise ConfigError(f"config field {name!r} must be {_JSON_KINDS[kind]}, got {value!r}")
    base = kind.removesuffix(" | None")
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base == "str":
        ok = isinstance(value, str)
    elif base == "tuple[str, ...]":
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        if ok:
            value = tuple(value)
    else:  # pragma: no cover - annotation typo
        raise AssertionError(f"unhandled annotation {kind} of {name}")
    if not ok:
        raise ConfigError(f"config field {name!r} must be {_JSON_KINDS[kind]}, got {value!r}")
    return value


class HFConfig:
    """Shared strict parsing / writing; subclasses are frozen dataclasses."""

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    family_name: ClassVar[str]
    derived_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Any:
        """Parse a config.json dict (strict; see the module docstring)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a {cls.__name__} needs a JSON object, got {type(d).__name__}")
        mt = d.get("model_type", cls.model_type)
        if mt != cls.model_type:
            raise ConfigError(
                f"model_type must be {cls.model_type!r} for {cls.__name__}, got {mt!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "hf_extra"}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in d.items():
            if key == "model_type" or key in cls.derived_keys:
                continue
            if key in fields:
                kwargs[key] = _coerce(key, str(fields[key].type), value)
            elif key in HF_BOOKKEEPING_KEYS:
                extra[key] = value
            else:
                raise ConfigError(
                    f"unknown config field {key!r} for model_type {cls.model_type!r} "
                    f"(known: {', '.join(sorted(fields))})"
                )
        for name, f in fields.items():
            no_default = (
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
            if name not in kwargs and no_default:
                expected = _JSON_KINDS.get(str(f.type), str(f.type))
                raise ConfigError(f"config field {name!r} is missing (expected {expected})")
        extra.pop("architectures", None)
        config = cls._from_parsed(kwargs, tuple(sorted(extra.items())))
        config._check_derived(d)
        return config

    @classmethod
    def _from_parsed(cls, kwargs: dict[str, Any], extra: tuple) -> Any:
        return cls(**kwargs, hf_extra=extra)  # type: ignore[call-arg]

    def _check_derived(self, d: Mapping[str, Any]) -> None:
        for key in self.derived_keys:
            if key in d and not _close(d[key], self._derived()[key]):
                raise ConfigError(
                    f"config field {key!r} is derived and must be {self._derived()[key]!r}, "
                    f"got {d[key]!r}"
                )

    def _derived(self) -> dict[str, Any]:
        return {}

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict (round trips through `from_hf_dict`)."""
        out: dict[str, Any] = dict(getattr(self, "hf_extra", ()))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "hf_extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out.update(self._derived())
        out["model_type"] = self.model_type
        out["architectures"] = [self.architecture]
        return out

    @property
    def family(self) -> str:
        """'huginn' | 'ouro' | 'nanbeige' | 'llama'."""
        return self.family_name

    def _positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name!r} must be > 0, got {getattr(self, name)}")

    def _require(self, name: str, allowed: tuple[Any, ...]) -> None:
        if getattr(self, name) not in allowed:
            raise ConfigError(
                f"config field {name!r} must be one of {allowed!r} (the only setting "
                f"implemented), got {getattr(self, name)!r}"
            )


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return bool(a == b)


__all__ = ["HF_BOOKKEEPING_KEYS", "HFConfig"]
