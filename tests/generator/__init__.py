"""Generator tests: shared helpers (work items, reference replay of engine samples)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from generator.engine import Sample
from models.base import LoopedLM
from models.reference import ReplayItem, replay
from proto.records import WorkItem


def work_item(
    prompt: Sequence[int],
    seeds: Sequence[int],
    *,
    temperature: float = 0.9,
    top_p: float = 0.95,
    max_tokens: int = 10,
    name: str = "w",
) -> WorkItem:
    return WorkItem(
        work_id=name,
        prompt_id=f"p-{name}",
        prompt_tokens=np.asarray(prompt, dtype=np.int32),
        latent_seeds=np.asarray(seeds, dtype=np.uint64),
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
    )


def prompts(n: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 512, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(n)
    ]


def replay_diff(
    model: LoopedLM,
    item: WorkItem,
    samples: Sequence[Sample],
    mode: str,
    kv: str | None = None,
) -> float:
    """max |engine log-prob - reference replay log-prob| over the samples of `item` (replayed
    with KV semantics `kv`; None = the family's default)."""
    greedy = item.temperature == 0
    items = [
        ReplayItem(
            item.prompt_tokens.tolist(),
            s.tokens.tolist(),
            s.latent_seed,
            s.exit_depths.tolist(),
            s.full_depth or None,
        )
        for s in samples
    ]
    results = replay(
        model,
        items,
        temperature=1.0 if greedy else item.temperature,
        top_p=1.0 if greedy else item.top_p,
        numerics=mode,
        kv=kv,
    )
    return max(
        float((torch.from_numpy(s.logprobs) - r.logprobs).abs().max())
        for s, r in zip(samples, results)
    )
