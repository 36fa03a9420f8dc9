"""Plugin settings: numerics mode, exit policy and recording, read from vLLM's
`additional_config["looprl"]` (`LLM(..., additional_config={"looprl": {...}})` or
`vllm serve --additional-config '{"looprl": {...}}'`).

    {"numerics": "fast" | "exact",                       default "fast"
     "exit_policy": {"kind": "fixed", "depth": 4}         default: full depth (model max_depth)
                  | {"kind": "latent_diff" | "kl" | "entropy_diff", "threshold": 0.1,
                     "min_depth": 1, "max_depth": null}
                  | {"kind": "ouro_gate", "q": 0.8, "min_depth": 1, "max_depth": null},
                  every kind also takes "kv": "full" | "last_exited" | null (family default;
                  docs/CONTRACTS.md 3) and a depth / max_depth up to 255 (beyond the model's own)
     "record": true}                                      per-token depths / log-probs side channel

The policy's mapping form and its parser live in `models.exits` (`policy_to_dict`,
`policy_from_dict`): `LoopedEngine` hands the typed policy in `PluginSettings`, it crosses into
vLLM's config as that mapping and each model parses it once. Kept out of config.json on
purpose: `models.config` parses config.json strictly, and these are serving choices, not model
facts. The settings are engine-wide (one policy per engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models import numerics as nx
from models.exits import ExitPolicy, policy_from_dict, policy_to_dict

KEY = "looprl"
"""The key of `additional_config` that holds the plugin settings."""


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """What the looped vLLM models read at construction."""

    numerics: str = "fast"
    """'fast' (vLLM kernels) or 'exact' (fp64-accumulated, bit-equal to the reference)."""
    exit_policy: ExitPolicy | None = None
    """Engine-wide exit policy; None = every token at the model's max_depth."""
    record: bool = True
    """Keep per-token exit depths, behaviour log-probs and weight versions per request."""


def settings_to_dict(settings: PluginSettings) -> dict[str, Any]:
    """The `additional_config` entry for `settings`: {KEY: {...}}."""
    return {
        KEY: {
            "numerics": settings.numerics,
            "exit_policy": policy_to_dict(settings.exit_policy),
            "record": settings.record,
        }
    }


def settings_from_additional_config(additional: Any) -> PluginSettings:
    """Parse `vllm_config.additional_config` (missing key = defaults; unknown fields error)."""
    raw = (additional or {}).get(KEY, {}) if isinstance(additional, Mapping) else {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"additional_config[{KEY!r}] must be a mapping, got {raw!r}")
    unknown = set(raw) - {"numerics", "exit_policy", "record"}
    if unknown:
        raise ValueError(f"additional_config[{KEY!r}]: unknown fields {sorted(unknown)}")
    numerics = nx.check_mode(str(raw.get("numerics", "fast")))
    record = raw.get("record", True)
    if not isinstance(record, bool):
        raise ValueError(f"additional_config[{KEY!r}]['record'] must be a boolean")
    return PluginSettings(numerics, policy_from_dict(raw.get("exit_policy")), record)


__all__ = [
    "KEY",
    "PluginSettings",
    "settings_from_additional_config",
    "settings_to_dict",
]
