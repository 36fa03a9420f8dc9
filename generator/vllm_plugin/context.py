"""The model-runner hook: which request each flattened token belongs to (vLLM 0.32 internals).

vLLM hands a model only flattened tokens (`input_ids`, `positions`). The looped models also
need, per token, the request's latent seed (`SamplingParams.extra_args["latent_seed"]`), its
prompt length (prompt positions run full depth) and its sampling settings (behaviour
log-probs). `install_runner_hook()` wraps `GPUModelRunner._model_forward` (the CPU runner
inherits it) so that, during the call, `current_runner()` returns the runner; `step_batch()`
then reads, for the step being run:

- `runner.input_batch.req_ids[:num_reqs]`: request ids in batch order;
- `runner.query_start_loc.np[: num_reqs + 1]`: token offsets of each request in the flattened
  batch (tokens past the last offset are padding);
- `runner.requests[req_id]` (`CachedRequestState`): `sampling_params`, `num_prompt_tokens`.

These are internals of vLLM 0.32's V1 model runner (`vllm/v1/worker/gpu_model_runner.py`);
tests/generator/test_vllm_plugin.py exercises them. The V2 runner (`VLLM_USE_V2_MODEL_RUNNER=1`)
does not call `_model_forward`: the looped models refuse to run under it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import weakref
from typing import Any

import numpy as np

from models.seeds import check_latent_seed

_RUNNER: contextvars.ContextVar[Any] = contextvars.ContextVar("looprl_runner", default=None)
_HOOK_ATTR = "_looprl_hooked"

SEED_KEY = "latent_seed"
"""`SamplingParams.extra_args` key of the 64-bit latent seed (docs/CONTRACTS.md 1)."""
RECORD_KEY = "looprl_id"
"""`SamplingParams.extra_args` key of the id the side-channel records are filed under
(default: vLLM's internal request id)."""


def install_runner_hook() -> None:
    """Wrap `GPUModelRunner._model_forward` to expose the runner (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward
    if getattr(original, _HOOK_ATTR, False):
        return

    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _RUNNER.set(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _RUNNER.reset(token)

    setattr(_model_forward, _HOOK_ATTR, True)
    _model_forward.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._model_forward = _model_forward  # type: ignore[method-assign]


def current_runner() -> Any:
    """The model runner whose forward is in progress, or None (profiling, other callers)."""
    return _RUNNER.get()


@dataclasses.dataclass
class RequestSlice:
    """One request's tokens in the flattened batch."""

    key: str
    """Record key: extra_args[RECORD_KEY] or the vLLM request id."""
    start: int
    end: int
    """Token rows [start, end) of the flattened batch."""
    prompt_len: int
    seed: int
    temperature: float
    """0 = greedy."""
    top_p: float


@dataclasses.dataclass
class StepBatch:
    """Per-token request data of one forward (tokens past `n_real` are padding)."""

    requests: list[RequestSlice]
    seeds: np.ndarray
    """uint64 [T] latent seed per token (0 for padding)."""
    prompt_len: np.ndarray
    """int64 [T] prompt length of the token's request (huge for padding: full depth)."""
    n_real: int
    logits_rows_valid: bool = True
    """Set False once compute_logits consumed this step."""


def _seed_of(params: Any) -> int:
    extra = getattr(params, "extra_args", None) or {}
    return check_latent_seed(extra.get(SEED_KEY, 0), f"extra_args[{SEED_KEY!r}]")


_REQUEST_CACHE: dict[str, tuple[Any, tuple[str, int, int, float, float]]] = {}
"""req_id -> (weak reference to its CachedRequestState, (key, prompt_len, seed, temperature,
top_p)): read once per request state, not once per step (a new state object, e.g. the same
request id in another engine, is read again)."""


def _request_fields(rid: str, state: Any) -> tuple[str, int, int, float, float]:
    hit = _REQUEST_CACHE.get(rid)
    if hit is not None and hit[0]() is state:
        return hit[1]
    params = state.sampling_params
    extra = getattr(params, "extra_args", None) or {}
    fields = (
        str(extra.get(RECORD_KEY, rid)),
        int(state.num_prompt_tokens),
        _seed_of(params),
        float(getattr(params, "temperature", 1.0) or 0.0),
        float(getattr(params, "top_p", 1.0)),
    )
    try:
        ref = weakref.ref(state)
    except TypeError:  # not weak-referenceable: no cache
        return fields
    if len(_REQUEST_CACHE) >= 1 << 14:
        _REQUEST_CACHE.clear()
    _REQUEST_CACHE[rid] = (ref, fields)
    return fields


def step_batch(runner: Any, num_tokens: int) -> StepBatch:
    """Read the current step's request layout from `runner` (see module doc)."""
    big = np.iinfo(np.int64).max
    if runner is None:
        seeds = np.zeros(num_tokens, dtype=np.uint64)
        return StepBatch([], seeds, np.full(num_tokens, big, dtype=np.int64), 0)
    batch = runner.input_batch
    num_reqs = int(batch.num_reqs)
    qsl = np.asarray(runner.query_start_loc.np[: num_reqs + 1], dtype=np.int64)
    bounds = qsl.tolist()
    reqs: list[RequestSlice] = []
    for i, rid in enumerate(batch.req_ids[:num_reqs]):
        key, prompt_len, seed, temperature, top_p = _request_fields(rid, runner.requests[rid])
        reqs.append(
            RequestSlice(key, bounds[i], bounds[i + 1], prompt_len, seed, temperature, top_p)
        )
    n_real = min(bounds[-1] if num_reqs else 0, num_tokens)
    lengths = np.diff(qsl) if num_reqs else np.zeros(0, dtype=np.int64)
    seeds = np.zeros(num_tokens, dtype=np.uint64)
    plen = np.full(num_tokens, big, dtype=np.int64)
    seeds[:n_real] = np.repeat(np.asarray([r.seed for r in reqs], dtype=np.uint64), lengths)[
        :n_real
    ]
    plen[:n_real] = np.repeat(np.asarray([r.prompt_len for r in reqs], np.int64), lengths)[:n_real]
    return StepBatch(reqs, seeds, plen, n_real)


__all__ = [
    "RECORD_KEY",
    "SEED_KEY",
    "RequestSlice",
    "StepBatch",
    "current_runner",
    "install_runner_hook",
    "step_batch",
]
