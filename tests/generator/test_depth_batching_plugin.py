"""Depth batching in the vLLM plugin: at each core iteration only the tokens
still running are computed (`generator.vllm_plugin.models`, `depth_batching=True`, the default), and the
results equal the masked path (`depth_batching=False`: every token to the deepest running one,
K/V writes masked): tokens, behaviour log-probs, exit depths and exit log-probs bit for bit in
exact numerics, within 1e-6 in fast, for both KV semantics.

One engine for the module: tiny Ouro (head_dim 32) under a sampled exit deeper than the model's
trained depth (SampledGate, max depth 8: the exits vary per token), 6 requests of different
prompt lengths with a 32-token budget per step, so prompt chunks of some requests and decode
tokens of others share a step. The numerics mode, the KV semantics and the path are switched on
the live model between generate calls (`_configure`: the attributes its forward reads; prefix
caching is off for looped models, so no cached K/V crosses a switch); the sampler's generator
is reseeded before each call (on CPU the engine-wide generator draws the tokens).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from generator.engine import LoopedEngine, Sample
from models.exits import SampledGate
from models.random_init import init_checkpoint
from tests.generator import prompts, work_item

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DEPTH = 8
LENGTHS = [5, 12, 40, 3, 21, 9]  # 40 > the 32-token budget: chunked, beside decodes


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopedEngine]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    path: Path = init_checkpoint("ouro", "tiny", tmp_path_factory.mktemp("ckpt") / "ouro")
    eng = LoopedEngine(
        path,
        numerics="exact",
        exit_policy=SampledGate(max_depth=DEPTH, kv="last_exited"),
        kv_cache_bytes=16 << 20,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    yield eng
    eng.close()
    del eng
    gc.collect()
    cleanup_dist_env_and_memory()


def _configure(worker: Any, settings: dict[str, Any]) -> None:
    """Set the live model's numerics mode ('mode': the model's and every attention slot's),
    KV semantics ('kv') and path ('depth_batching')."""
    from generator.vllm_plugin.attention import SlotAttention

    model = worker.model_runner.get_model()
    for key, value in settings.items():
        setattr(model, key, value)
        if key == "mode":
            for m in model.modules():
                if isinstance(m, SlotAttention):
                    m.mode = value


def _core_rows(worker: Any, start: bool) -> int:
    """start=True: count the rows that enter the core stack (core_in) from now; False: stop
    counting, return the count."""
    model = worker.model_runner.get_model()
    if start:
        model._rows = 0
        inner = type(model).core_in

        def counting(state: torch.Tensor, e: torch.Tensor, mode: str) -> torch.Tensor:
            model._rows += state.shape[0]
            return inner(model, state, e, mode)  # type: ignore[no-any-return]

        model.core_in = counting
        return 0
    del model.core_in
    return int(model._rows)


def _attn_rows(worker: Any, start: bool) -> list[int]:
    """start=True: count the query rows the core slots attend from now, [through the step's
    full layout (`SlotAttention.forward`), through `attend_rows` (the running rows alone)];
    False: stop counting, return the counts."""
    from generator.vllm_plugin.attention import SlotAttention

    model = worker.model_runner.get_model()
    if not start:
        SlotAttention.forward, SlotAttention.attend_rows = model._attn_inner  # type: ignore[method-assign]
        return list(model._attn_counts)
    counts = model._attn_counts = [0, 0]
    fwd, rows = model._attn_inner = (SlotAttention.forward, SlotAttention.attend_rows)

    def forward(self: Any, q: torch.Tensor, *args: Any) -> torch.Tensor:
        counts[0] += q.shape[0] if ".core." in f".{self.layer_name}" else 0
        return fwd(self, q, *args)  # type: ignore[no-any-return]

    def attend_rows(self: Any, q: torch.Tensor, *args: Any) -> torch.Tensor:
        counts[1] += q.shape[0]
        return rows(self, q, *args)  # type: ignore[no-any-return]

    setattr(SlotAttention, "forward", forward)  # noqa: B010
    setattr(SlotAttention, "attend_rows", attend_rows)  # noqa: B010
    return [0, 0]


ITEMS = [
    work_item(p, [41 + i], temperature=0.0 if i % 3 == 0 else 0.9, max_tokens=8, name=f"d{i}")
    for i, p in enumerate(prompts(len(LENGTHS), LENGTHS, seed=5))
]


def _generate(engine: LoopedEngine, **settings: Any) -> tuple[list[Sample], int]:
    samples, rows, _ = _generate_counted(engine, **settings)
    return samples, rows


def _generate_counted(engine: LoopedEngine, **settings: Any) -> tuple[list[Sample], int, list[int]]:
    """Samples, core rows (`_core_rows`) and core attention rows (`_attn_rows`) of a call."""
    settings.setdefault("rows_attention", True)
    engine.llm.collective_rpc(_configure, args=(settings,))
    engine.llm.collective_rpc(_core_rows, args=(True,))
    engine.llm.collective_rpc(_attn_rows, args=(True,))
    torch.manual_seed(1234)
    try:
        samples = [ss[0] for ss in engine.generate(ITEMS)]
    finally:  # the class methods restored whatever happens
        attn = engine.llm.collective_rpc(_attn_rows, args=(False,))[0]
    return samples, engine.llm.collective_rpc(_core_rows, args=(False,))[0], attn


def _compare(new: list[Sample], old: list[Sample], tol: float) -> float:
    """Tokens and exit depths equal, log-probs and exit log-probs within tol; the max diff."""
    diff = 0.0
    for a, b in zip(new, old, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.exit_depths.tolist() == b.exit_depths.tolist()
        assert a.exit_logprobs is not None and b.exit_logprobs is not None
        diff = max(diff, float(np.abs(a.logprobs - b.logprobs).max()),
                   float(np.abs(a.exit_logprobs - b.exit_logprobs).max()))  # fmt: skip
    assert diff <= tol
    return diff


@pytest.mark.parametrize("kv", ["last_exited", "full"])
def test_compacted_equals_masked_exact(engine: LoopedEngine, kv: str) -> None:
    """Exact numerics: bit for bit; and the core rows computed are the iterations each token
    runs (last_exited: prompt positions D, each sampling position its exit depth), fewer than
    the masked path's, while under `full` both paths run every token D iterations (no saving:
    every token feeds K/V to every iteration's slot)."""
    new, rows = _generate(engine, mode="exact", kv=kv, depth_batching=True)
    old, old_rows = _generate(engine, mode="exact", kv=kv, depth_batching=False)
    assert _compare(new, old, 0.0) == 0.0
    for a, b in zip(new, old):
        assert np.array_equal(a.logprobs, b.logprobs)
        assert np.array_equal(a.exit_logprobs, b.exit_logprobs)  # type: ignore[arg-type]
    depths = [int(d) for s in new for d in s.exit_depths[1:]]
    assert len(set(depths)) >= 3, f"mixed exit depths needed, got {depths}"
    assert min(depths) < DEPTH
    # every position fed to the model: the prompt, and each generated token but the last
    prompt = sum((len(it.prompt_tokens) - 1) * DEPTH for it in ITEMS)
    if kv == "last_exited":
        want = prompt + sum(int(s.exit_depths[: len(s.tokens)].sum()) for s in new)
        print(f"\nkv={kv}: core rows {rows} (masked path {old_rows}), exit depths {depths}")
        assert rows == want and rows < old_rows
    else:
        want = prompt + sum(len(s.tokens) * DEPTH for s in new)
        assert rows == want == old_rows


@pytest.mark.parametrize("kv", ["last_exited", "full"])
def test_compacted_within_1e6_fast(engine: LoopedEngine, kv: str) -> None:
    """Fast numerics: within 1e-6 of the masked path; under last_exited the core attention
    runs on the running rows alone (vLLM's CPU kernel, `attend_rows`): every core row computed
    attends once per layer, no more; with `rows_attention` off the running rows' queries go
    through the step's full layout (every row attends) and give the same tokens and depths."""
    layers = int(engine.llm.collective_rpc(_core_layers)[0])
    new, rows, attn = _generate_counted(engine, mode="fast", kv=kv, depth_batching=True)
    old, old_rows, old_attn = _generate_counted(engine, mode="fast", kv=kv, depth_batching=False)
    diff = _compare(new, old, 1e-6)
    print(f"\nfast, kv={kv}: max |dlogprob| compacted vs masked {diff}; core rows {rows} "
          f"(masked {old_rows}), attention rows [full layout, running rows] {attn} "
          f"(masked {old_attn})")  # fmt: skip
    assert old_attn == [old_rows * layers, 0]  # the masked path: every row, every iteration
    if kv == "full":
        assert attn == old_attn
        return
    assert attn[1] > 0 and sum(attn) == rows * layers < old_rows * layers
    scattered, rows2, attn2 = _generate_counted(
        engine, mode="fast", kv=kv, depth_batching=True, rows_attention=False
    )
    _compare(scattered, new, 1e-6)
    assert rows2 == rows and attn2[1] == 0 and attn2[0] > rows * layers


def _core_layers(worker: Any) -> int:
    return len(list(worker.model_runner.get_model().core_blocks()))
