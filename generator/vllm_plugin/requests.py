"""The vLLM requests of a WorkItem (generator.engine's `LoopedEngine._generate`): one
`SamplingParams` per latent seed, and the per-request sampler seed.

Every request asks for the sampled token's log-prob (`logprobs=0`, read from the worker's book:
generator.vllm_plugin.sampled), ignores EOS (the item's `stop_token_ids` stop it), detokenizes only
when the item has stop strings, carries its latent seed and record key in `extra_args`
(generator.vllm_plugin.context), and returns one output when it finishes (`FINAL_ONLY`). On the CPU
the sampler is not seeded per request (generator.engine's module doc says why).
"""

from __future__ import annotations

import copy
from typing import Any

from generator.vllm_plugin.context import RECORD_KEY, SEED_KEY
from models.reference import sampling_seed
from proto.records import WorkItem


def request_seed(latent_seed: int, offset: int = 0) -> int:
    """vLLM's per-request sampler seed (`SamplingParams.seed`, a non-negative int64) of a
    completion of ``latent_seed`` with sampling-seed offset ``offset``: the latent seed's low 63
    bits at offset 0 (every single-turn request, as before), else those of
    `models.reference.sampling_seed(latent_seed, offset)` (a conversation's turn ``offset``)."""
    mixed = int(latent_seed) if offset == 0 else sampling_seed(latent_seed, offset)
    return mixed & 0x7FFF_FFFF_FFFF_FFFF


def sampling_params(item: WorkItem, seed: int, key: str, offset: int, cpu: bool) -> Any:
    """The SamplingParams of the request of ``item`` with latent seed ``seed`` and record key
    ``key`` (module doc)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = item.temperature == 0
    return SamplingParams(
        n=1,
        temperature=0.0 if greedy else float(item.temperature),
        top_p=1.0 if greedy else float(item.top_p),
        max_tokens=int(item.max_tokens),
        stop_token_ids=[int(t) for t in item.stop_token_ids],
        ignore_eos=True,
        seed=None if cpu else request_seed(seed, offset),
        logprobs=0,
        detokenize=bool(item.stop),  # stop strings are matched on the detokenized text
        stop=list(item.stop) or None,
        include_stop_str_in_output=True,
        extra_args={SEED_KEY: seed, RECORD_KEY: key},
        skip_clone=True,  # one object per request: vLLM's deep copy of it is not needed
        # one output per request, when it finishes (what `LLM.generate` asks for): no
        # cumulative RequestOutput built for every request at every engine step
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def like_params(first: Any, seed: int, key: str, offset: int, cpu: bool) -> Any:
    """The SamplingParams of another request of the item whose first request has ``first``:
    a shallow copy with this request's own seeds and record key (the only per-request
    fields). Building and validating one per request cost ~18 us each (128 a Llama batch:
    ~2 ms of its ~100 ms); a copy ~0.5 us. vLLM's own updates of the object (the stop-id set
    from the generation config) are the same for every request of an item."""
    params = copy.copy(first)
    params.extra_args = {SEED_KEY: seed, RECORD_KEY: key}
    if not cpu:
        params.seed = request_seed(seed, offset)
    return params


__all__ = ["like_params", "request_seed", "sampling_params"]
