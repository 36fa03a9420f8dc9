"""Fresh, randomly initialised checkpoints of every family, ready for vLLM and the learner.

`init_checkpoint(family, size, out_dir)` writes, in one atomic step:

    config.json                 the family's official config keys (`to_hf_dict`), plus
                                torch_dtype and the tokenizer's bos/eos/pad ids
    model.safetensors           official parameter names (sharded past 2 GiB); floating
                                parameters in `dtype`, buffers (RoPE tables) as built (fp32);
                                a head tied to the embedding stored once, as transformers does
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                `models.tokenizer`, vocab = the config's vocab_size
    generation_config.json      bos / eos / pad ids

Sizes: "tiny" = `models.config.tiny_config` (hidden 64, for tests); "small" = hidden 512,
four blocks (~13-15M parameters), for runs that should learn something on a CPU; the GPU
shapes (`GPU_SIZES`, one family each): Huginn's "1b" and "0125", Ouro's "400m".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import save_checkpoint, state_dict_for_save
from models.config import config_from_hf_dict, tiny_config
from models.ties import tied_from_module
from models.tokenizer import BOS_ID, EOS_ID, PAD_ID, tokenizer_files

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
SIZES = ("tiny", "small", "1b", "0125", "400m")
"""tiny (head_dim 32, vLLM CPU), small (hidden 512), two GPU shapes of Huginn only: 1b (the
~1B Huginn shape of benchmarks/trainer_gpu.py: hidden 2048, 16 heads, 2 + 4 + 2 layers, mean
recurrence 4) and 0125 (the Huginn-0125 shape: hidden 5280, 55 heads, 2 + 4 + 2 layers, mean
recurrence 32), both vocab 65536, for the one-GPU end to end run (scripts/gpu_e2e.sh); and one of
Ouro only: 400m (Ouro-1.4B's layer, hidden 2048, 16 heads of 128, intermediate 5632, in 8 of its
24 layers, 4 loops: 413 M parameters, the tiny preset's vocab 512 so the CPU tasks' tokenizer
serves it), weight-bound in decode on one GPU (benchmarks/exit_pays.py --device cuda)."""
GPU_SIZES = {"1b": "huginn", "0125": "huginn", "400m": "ouro"}
"""Each GPU shape's one family."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"huginn_raven": "huginn", "nanbeige_looped": "nanbeige"}

_SMALL_HUGINN = {
    "n_embd": 512,
    "n_heads": 8,
    "intermediate_size": 1536,
    "block_size": 2048,
}
_GPU_HUGINN = {  # the shapes of benchmarks/trainer_gpu.py (random init: no download)
    "1b": {"n_embd": 2048, "n_heads": 16, "intermediate_size": 5632, "mean_recurrence": 4},
    "0125": {"n_embd": 5280, "n_heads": 55, "intermediate_size": 17920, "mean_recurrence": 32},
}
_GPU_HUGINN_COMMON = {
    "n_layers": 8,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "mean_backprop_depth": 8,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
}
_GPU_OURO = {  # Ouro-1.4B's layer (benchmarks/trainer_gpu.py's ouro_1b), 8 layers of its 24
    "400m": {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
             "head_dim": 128, "intermediate_size": 5632, "num_hidden_layers": 8,
             "max_position_embeddings": 2048, "total_ut_steps": 4},
}  # fmt: skip
_SMALL_LLAMA_LIKE = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "max_position_embeddings": 2048,
}


def _family(family: str) -> str:
    name = _ALIASES.get(family, family)
    if name not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    return name


def model_config(family: str, size: str) -> Any:
    """The typed config of `family` at `size` (one of SIZES; a GPU shape only for its family,
    GPU_SIZES: 1b and 0125 Huginn, 400m Ouro)."""
    name = _family(family)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; allowed: {', '.join(SIZES)}")
    owner = GPU_SIZES.get(size, name)
    if owner != name:
        raise ValueError(f"size {size!r} is a{'n' if owner == 'ouro' else ''} "
                         f"{owner.capitalize()} shape; for family {name!r} use tiny or small"
                         f"{''.join(f', {s}' for s, f in GPU_SIZES.items() if f == name)}")  # fmt: skip
    tiny = tiny_config(name)
    if size == "tiny":
        return tiny
    d = {k: v for k, v in tiny.to_hf_dict().items() if k not in type(tiny).derived_keys}
    if size in _GPU_HUGINN:
        d.update({**_GPU_HUGINN_COMMON, **_GPU_HUGINN[size]})
    elif size in _GPU_OURO:
        d.update(_GPU_OURO[size])
    else:
        d.update(_SMALL_HUGINN if name == "huginn" else _SMALL_LLAMA_LIKE)
    d.pop("layer_types", None)  # per-layer list of the tiny stack; the default fits any depth
    return config_from_hf_dict(d)


def init_checkpoint(
    family: str,
    size: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: str = "float32",
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Build `family` at `size` with `models.reference.build_model(config, seed=seed)` and
    write it, with its tokenizer, to `out_dir` (see the module doc); return the path.
    ``overrides``: HF config keys over the preset's (e.g. {"tie_word_embeddings": True}).

    Raises ValueError naming the allowed values for an unknown family, size or dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    config = model_config(family, size)
    if overrides:
        config = config_from_hf_dict({**config.to_hf_dict(), **overrides})
    from models.reference import build_model

    model = build_model(config, seed=seed)
    state = state_dict_for_save(model, DTYPES[dtype])
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    config_dict = {**config.to_hf_dict(), **ids, "torch_dtype": dtype}
    if config_dict.get("layer_types") == []:
        # transformers' PreTrainedConfig (which AutoTokenizer and vLLM fall back to for a
        # model_type it does not know) rejects a layer_types list shorter than the stack
        config_dict["layer_types"] = ["full_attention"] * config_dict["num_hidden_layers"]
    extra: dict[str, Any] = dict(tokenizer_files(config.vocab_size))
    extra["generation_config.json"] = ids
    return save_checkpoint(
        state, config_dict, out_dir, tied=tied_from_module(model), extra_files=extra
    )


__all__ = ["DTYPES", "FAMILIES", "GPU_SIZES", "SIZES", "init_checkpoint", "model_config"]
