"""vLLM's own log-probs of the sampled tokens, kept on the worker (vLLM 0.32 internals).

The engine asks every request for `logprobs=0` (the sampled token's log-prob after temperature
and top-p: `logprobs_mode="processed_logprobs"`); for a plain (depth-1) model these are the
behaviour log-probs, for the looped models the cross-check `Sample.sampler_logprobs`. vLLM
carries them from the sampler to the caller as Python objects: a list per step
(`LogprobsTensors.tolists`), a slice per request in the scheduler, a `Logprob` object in a
dict per token in the output processor: ~7 ms of a ~90 ms engine batch of the small job (128
requests x 8 tokens; docs/PERFORMANCE.md, "Side by side with TRL"). An engine that turns the book on
(`enable_book`, through `LLM.collective_rpc`) has the runner's `_sample` wrapped
(`install_sampler_hook`, idempotent, at plugin load): after vLLM's sampler ran, column 0 of its
`logprobs_tensors` (the sampled token's log-prob: `Sampler.gather_logprobs` puts it first) is
appended to the request's list, filed under its record key (`context.RECORD_KEY`), and the
tensors are dropped from the step's output, so nothing downstream builds objects for them.
`pop_sampled` hands the lists back once a request finished. The values are the very floats vLLM
would have returned (tests/generator/test_sampled_book.py compares both paths on one engine).

Which rows count (the same rule as vLLM's `_bookkeeping_sync`): the first `num_reqs` rows of a
step are the requests in `input_batch.req_ids` order; a row whose request is mid-prefill
(`discard_request_mask`) samples a token that is thrown away, and its log-prob is too. A
preempted request recomputed later samples its next token after the re-prefill: appended in
order. A request ending on a stop string may have sampled past the text vLLM returns: the first
`len(token_ids)` entries are the returned tokens'. Not with speculative decoding or vLLM's
asynchronous scheduling (the hook then leaves the step to vLLM: neither is used here).
"""

from __future__ import annotations

import collections
from typing import Any

from generator.vllm_plugin.context import RECORD_KEY

BOOK_ATTR = "_looprl_sampled_book"
"""Attribute of a model runner whose engine turned the book on."""
_HOOK_ATTR = "_looprl_sampled_hooked"


class SampledBook:
    """Per request (record key): the sampled tokens' log-probs in order; at most
    ``max_requests`` requests kept (the oldest dropped), so a caller that never pops cannot
    leak memory."""

    def __init__(self, max_requests: int = 65536) -> None:
        self.max_requests = max_requests
        self._lists: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def add(self, key: str, logprob: float) -> None:
        got = self._lists.get(key)
        if got is None:
            got = self._lists[key] = []
            while len(self._lists) > self.max_requests:
                self._lists.popitem(last=False)
        got.append(logprob)

    def pop(self, key: str, n: int) -> list[float] | None:
        """The first ``n`` log-probs of ``key`` (None: fewer were kept), forgotten after."""
        got = self._lists.pop(key, None)
        if got is None or len(got) < n:
            return None
        return got[:n]

    def __len__(self) -> int:
        return len(self._lists)


def _record(runner: Any, book: SampledBook, out: Any) -> None:
    n = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np[:n]
    logprobs = out.logprobs_tensors.logprobs[:n, 0].tolist()
    requests = runner.requests
    for i, rid in enumerate(runner.input_batch.req_ids[:n]):
        if discard[i]:
            continue
        extra = requests[rid].sampling_params.extra_args or {}
        book.add(str(extra.get(RECORD_KEY, rid)), logprobs[i])
    out.logprobs_tensors = None


def install_sampler_hook() -> None:
    """Wrap `GPUModelRunner._sample` (the CPU runner inherits it) as the module doc says;
    a runner without a book is left as vLLM made it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if getattr(original, _HOOK_ATTR, False):
        return

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        out = original(self, logits, spec_decode_metadata)
        book = getattr(self, BOOK_ATTR, None)
        if (book is not None and out.logprobs_tensors is not None
                and spec_decode_metadata is None and not self.use_async_scheduling):  # fmt: skip
            _record(self, book, out)
        return out

    setattr(_sample, _HOOK_ATTR, True)
    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._sample = _sample  # type: ignore[method-assign]


def enable_book(worker: Any) -> bool:
    """`LLM.collective_rpc` callable: give this worker's runner a book (True once hooked)."""
    install_sampler_hook()
    runner = worker.model_runner
    if getattr(runner, BOOK_ATTR, None) is None:
        setattr(runner, BOOK_ATTR, SampledBook())
    return True


def disable_book(worker: Any) -> bool:
    """`LLM.collective_rpc` callable: drop this worker's book (vLLM's own path again)."""
    if getattr(worker.model_runner, BOOK_ATTR, None) is not None:
        setattr(worker.model_runner, BOOK_ATTR, None)
    return True


def pop_sampled(worker: Any, requests: list[tuple[str, int]]) -> dict[str, list[float] | None]:
    """`LLM.collective_rpc` callable: {key: the first n log-probs, or None} for (key, n) pairs."""
    book: SampledBook = getattr(worker.model_runner, BOOK_ATTR)
    return {key: book.pop(key, n) for key, n in requests}


__all__ = [
    "BOOK_ATTR",
    "SampledBook",
    "disable_book",
    "enable_book",
    "install_sampler_hook",
    "pop_sampled",
]
