"""Helpers of the weight-update tests: engines, perturbed weight sets, sample comparisons.

Two engines may live in one process, but closing one tears down vLLM's process-wide state
(`cleanup_dist_env_and_memory`, and `shutdown` itself): close engines only together, when
none is used any more.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import torch

from generator.engine import LoopedEngine, Sample
from models.checkpoint import (
    load_checkpoint,
    save_checkpoint,
)
from models.random_init import init_checkpoint
from proto.records import WorkItem
from tests.generator import prompts, replay_diff, work_item

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json")  # fmt: skip


def engine(path: Path) -> LoopedEngine:
    return LoopedEngine(path, kv_cache_bytes=16 << 20, max_model_len=256, max_num_seqs=8)


def shutdown(*engines: LoopedEngine) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for e in engines:
        e.close()
    del engines
    gc.collect()
    cleanup_dist_env_and_memory()


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every weight moved by 0.05 x N(0, 1) (tables such as Huginn's freqs_cis kept)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        if k.endswith(("weight", "bias"))
        else v
        for k, v in state.items()
    }


def write_like(src: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """A checkpoint of ``state`` with ``src``'s config and tokenizer files."""
    config, _ = load_checkpoint(src)
    extra = {name: (src / name).read_bytes() for name in COPIED if (src / name).is_file()}
    return save_checkpoint(state, config, out, extra_files=extra)


def tied_llama(out: Path, seed: int) -> Path:
    """The tiny Llama (`looprl model init --family llama --size tiny`) with its head tied to
    the embedding (stored once, as transformers does)."""
    return init_checkpoint("llama", "tiny", out, seed=seed, overrides={"tie_word_embeddings": True})


def greedy_items() -> list[WorkItem]:
    """Greedy only: two engines in one process share the sampling RNG (CPU), so sampled
    tokens would differ by the draw order alone."""
    return [
        work_item(p, [5 + i], temperature=0.0, max_tokens=8, name=f"g{i}")
        for i, p in enumerate(prompts(3, [4, 9, 17], seed=3))
    ]


def flat(results: list[list[Sample]]) -> list[Sample]:
    return [s for group in results for s in group]


def max_diff(a: list[list[Sample]], b: list[list[Sample]]) -> float:
    for x, y in zip(flat(a), flat(b)):
        assert x.tokens.tolist() == y.tokens.tolist()
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(flat(a), flat(b)))


def moved(a: list[list[Sample]], b: list[list[Sample]]) -> float:
    """How far the log-probs of the first tokens moved (tokens may differ after them)."""
    return max(abs(float(x.logprobs[0]) - float(y.logprobs[0])) for x, y in zip(flat(a), flat(b)))


def replay_all(model: Any, items: list[WorkItem], results: list[list[Sample]]) -> float:
    return max(replay_diff(model, it, ss, "fast") for it, ss in zip(items, results))
