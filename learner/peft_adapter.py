"""Trained adapters (learner.lora.Adapters) in the Hugging Face PEFT layout, written with every
learner checkpoint of a LoRA run (RUN_DIR/checkpoints/step_<8 digits>/adapter/), so that the
final checkpoint's is the run's adapter for Hugging Face users:

- ``adapter_config.json``: peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the
  adapted modules' full names), base_model_name_or_path, bias none, task_type CAUSAL_LM;
- ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` [r, in] and
  ``...lora_B.weight`` [out, r] in fp32, the scale being lora_alpha / r as here (models.lora);
  norms trained in full (learner.lora.train_norms) are PEFT's ``modules_to_save``, stored as
  ``base_model.model.<module>.weight``.

`read_peft` reads one back (its config and {module: (A, B)}), `read_saved` its saved modules.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from learner.lora import Adapters

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "read_peft", "read_saved", "write_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def write_peft(out_dir: str | os.PathLike[str], adapters: Adapters, base: str) -> Path:
    """Write ``adapters`` to ``out_dir`` (created; files replaced) in the PEFT layout, naming
    ``base`` (the base model's path or hub id) as the model they apply to."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = adapters.config
    tensors: dict[str, Tensor] = {}
    for name, f in adapters.factors.items():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = f.lora_A.detach().float().cpu().contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = f.lora_B.detach().float().cpu().contiguous()
    for name, p in adapters.norms.items():  # trained in full: PEFT's modules_to_save
        tensors[f"{_PREFIX}{name}"] = p.detach().float().cpu().contiguous()
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(adapters.factors),
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": [n.removesuffix(".weight") for n in adapters.norms] or None,
    }
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_peft(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, tuple[Tensor, Tensor]]]:
    """(adapter_config.json, {module: (A [r, in], B [out, r])}) of a PEFT adapter directory
    (the weights of its modules_to_save: `read_saved`); ValueError when a module of
    target_modules lacks its A or B."""
    p = Path(path)
    config: dict[str, Any] = json.loads((p / CONFIG_NAME).read_text())
    state = load_file(str(p / WEIGHTS_NAME))
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for name in config["target_modules"]:
        a, b = (state.get(f"{_PREFIX}{name}.lora_{k}.weight") for k in "AB")
        if a is None or b is None:
            raise ValueError(f"{p / WEIGHTS_NAME}: no lora_A / lora_B for module {name}")
        out[name] = (a, b)
    return config, out


def read_saved(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """{"<module>.weight": tensor} of the adapter's modules_to_save (the trained norms)."""
    p = Path(path)
    config = json.loads((p / CONFIG_NAME).read_text())
    state = load_file(str(p / WEIGHTS_NAME))
    return {f"{m}.weight": state[f"{_PREFIX}{m}.weight"] for m in config["modules_to_save"] or []}
