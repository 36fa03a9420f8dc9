"""The plugin with vLLM's compilation (enforce_eager=False, CPU: DYNAMO_TRACE_ONCE + inductor):
the FixedDepth decode core is compiled and gives eager's log-probs bit for bit."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from generator.engine import LoopedEngine
from models.checkpoint import load_checkpoint
from models.exits import FixedDepth
from models.random_init import init_checkpoint
from tests.generator import prompts, work_item
from weights.digest import canonical_digest
from weights.verified import VerifiedWeights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _compiled(worker: Any) -> bool:
    model = worker.model_runner.get_model()
    return bool(model._compiled) and bool(getattr(model._compiled[0], "compiled", False))


def test_compiled_fixed_depth_decode_equals_eager(tmp_path: Path) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    path = init_checkpoint("huginn", "tiny", tmp_path / "huginn")
    kw: dict[str, Any] = dict(
        numerics="fast", exit_policy=FixedDepth(6), kv_cache_bytes=16 << 20,
        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
    )  # fmt: skip
    eager = LoopedEngine(path, **kw)
    compiled = LoopedEngine(path, enforce_eager=False, **kw)
    try:
        assert not eager.llm.collective_rpc(_compiled)[0]
        # greedy: the two engines share the process's sampling RNG, so sampled tokens would
        # differ by the draw order alone; prompts longer than the 32-token budget: chunked
        items = [
            work_item(p, [7 + i, 2**64 - 1 - i], temperature=0.0, max_tokens=12, name=f"c{i}")
            for i, p in enumerate(prompts(4, [5, 11, 40, 17], seed=11))
        ]
        got, want = compiled.generate(items), eager.generate(items)
        assert compiled.llm.collective_rpc(_compiled)[0], "the FixedDepth core was compiled"
        diff = 0.0
        for gs, ws in zip(got, want):
            for g, w in zip(gs, ws):
                assert g.tokens.tolist() == w.tokens.tolist()
                assert g.exit_depths.tolist() == [6] * 12
                diff = max(diff, float(np.abs(g.logprobs - w.logprobs).max()))
        print(f"\ncompiled vs eager max|dlogprob| = {diff}")
        assert diff <= 1e-6
        assert diff == 0.0
        # new weights in place: the compiled graph reads the parameters, not a copy of them
        gen = torch.Generator().manual_seed(5)
        state = {
            k: v + 0.05 * torch.randn(v.shape, generator=gen) if k != "freqs_cis" else v
            for k, v in load_checkpoint(path)[1].items()
        }
        for engine in (compiled, eager):
            engine.load_weights(VerifiedWeights.of(state, 1, canonical_digest(state)))
        got2, want2 = compiled.generate(items[:2]), eager.generate(items[:2])
        moved = max(float(np.abs(a[0].logprobs - b[0].logprobs).max()) for a, b in zip(got, got2))
        after = max(float(np.abs(a[0].logprobs - b[0].logprobs).max()) for a, b in zip(got2, want2))
        assert moved > 1e-3 and after == 0.0
    finally:
        for engine in (compiled, eager):
            engine.close()
        del compiled, eager
        gc.collect()
        cleanup_dist_env_and_memory()
