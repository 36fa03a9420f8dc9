"""The worker's book of sampled log-probs (generator.vllm_plugin.sampled) against vLLM's own path.

One real vLLM engine on the tiny Llama (`looprl model init --family llama --size tiny`: the
depth-1 case, whose behaviour log-probs are these), with a 16-token step budget so that the
longer prompts are prefilled in chunks (rows vLLM samples and throws away) beside decodes, and
more requests than sequences so that requests wait and join a running batch. The engine's
sampling generator (CPU: one RNG for the engine) is reseeded and its prefix cache emptied before
each call (a cached prompt is prefilled in fewer chunks, which changes the draws' order), so the
book path and vLLM's path draw the same tokens: their log-probs must be the same floats.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from generator.engine import LoopedEngine, Sample
from generator.vllm_plugin.sampled import SampledBook
from models.random_init import init_checkpoint
from tests.generator import prompts, work_item
from tests.generator.update_utils import flat, shutdown

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopedEngine]:
    path = init_checkpoint("llama", "tiny", tmp_path_factory.mktemp("llama") / "m")
    eng = LoopedEngine(path, kv_cache_bytes=16 << 20, max_model_len=256, max_num_seqs=4,
                       max_num_batched_tokens=16)  # fmt: skip
    yield eng
    shutdown(eng)


def _reseed(worker: object, seed: int) -> None:
    torch.manual_seed(seed)


def _items(temperature: float) -> list:
    return [
        work_item(
            p,
            [11 + 2 * i, 12 + 2 * i],
            temperature=temperature,
            top_p=1.0,
            max_tokens=6 + i,
            name=f"t{i}",
        )
        for i, p in enumerate(prompts(4, [3, 21, 40, 7], seed=5))
    ]


def _run(eng: LoopedEngine, book: bool, temperature: float) -> list[Sample]:
    eng.use_sampled_book(book)
    eng.llm.reset_prefix_cache()
    eng.llm.collective_rpc(_reseed, args=(1234,))
    return flat(eng.generate(_items(temperature)))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_book_gives_vllms_own_logprobs(llama: LoopedEngine, temperature: float) -> None:
    try:
        ours = _run(llama, True, temperature)
        theirs = _run(llama, False, temperature)
    finally:
        llama.use_sampled_book(True)
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.sampler_logprobs is not None and b.sampler_logprobs is not None
        assert len(a.sampler_logprobs) == len(a.tokens) > 0
        assert np.array_equal(a.sampler_logprobs, b.sampler_logprobs)  # the same floats
        assert np.array_equal(a.logprobs, b.logprobs)  # depth 1: the behaviour log-probs
        assert np.all(a.sampler_logprobs <= 0) and np.all(np.isfinite(a.sampler_logprobs))
    if temperature:  # sampled, not all greedy: some token below its row's best
        assert min(float(s.sampler_logprobs.min()) for s in ours) < -0.5
    book = llama.llm.collective_rpc(lambda w: len(w.model_runner._looprl_sampled_book))[0]
    assert book == 0  # every request's list handed back


def test_book_is_bounded_and_pops_only_whole_lists() -> None:
    book = SampledBook(max_requests=2)
    for key, lp in [("a", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0)]:
        book.add(key, lp)
    assert len(book) == 2  # "a" (the oldest) dropped
    assert book.pop("a", 1) is None
    assert book.pop("b", 2) is None  # fewer kept than asked: not a short list
    assert book.pop("c", 1) == [-4.0] and len(book) == 0
    book.add("d", -1.0)
    book.add("d", -0.5)
    assert book.pop("d", 1) == [-1.0]  # a stop string may cut after the core sampled on


def test_missing_entries_are_an_error_not_zeros(llama: LoopedEngine, tmp_path: Path) -> None:
    out = type("Out", (), {"token_ids": [5, 6], "logprobs": [], "finish_reason": "length"})()
    with pytest.raises(RuntimeError, match="lacks the sampled log-probs"):
        llama._sample(out, None, 7, None)
