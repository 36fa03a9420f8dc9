"""Attention on the running rows alone (depth batching, fast numerics, vLLM's CPU_ATTN backend;
`generator.vllm_plugin.attention.row_segments` / `cpu_rows_plan` / `cpu_rows_attention`): for any
subset of a step's query rows (a prefill chunk cut in the middle, decodes dropped, single rows,
padding rows) each row's output equals the row vLLM's own backend computes on the step's full
layout (`CPUAttentionBackendImpl.forward`), through the real kernel on a real paged cache.
No engine: the layout and the cache are built here (block size 32, head_dim 32, GQA 4 / 2)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from generator.vllm_plugin.attention import cpu_rows_attention, cpu_rows_plan, row_segments

pytestmark = [pytest.mark.vllm]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 32
# (tokens already in the cache, query tokens this step) per request: a long prefill chunk
# (two blocks), decodes (one at a block boundary), a chunk after a context, a one-token prompt
LAYOUT = [(0, 40), (37, 1), (5, 7), (0, 1), (63, 1), (20, 3), (31, 2)]
N = sum(q for _, q in LAYOUT)  # the step's query rows


def test_row_segments_layout() -> None:
    """Three requests: rows 0-3 (positions 0-3), 4-6 (positions 7-9), 7-9 (positions 0-2);
    row 11 is padding. Each run of consecutive rows of one request is a segment ending at its
    last row's position."""
    qsl, seq = np.array([0, 4, 7, 10]), np.array([4, 10, 3])
    keep, req, qsl2, seq2 = row_segments(np.array([0, 1, 3, 5, 6, 9, 11]), qsl, seq)
    assert keep.tolist() == [True] * 6 + [False]
    assert req.tolist() == [0, 0, 1, 2]
    assert qsl2.tolist() == [0, 2, 3, 5, 6]
    assert seq2.tolist() == [2, 4, 10, 3]
    keep, req, qsl2, seq2 = row_segments(np.array([3, 4]), qsl, seq)  # across a request border
    assert req.tolist() == [0, 1] and qsl2.tolist() == [0, 1, 2] and seq2.tolist() == [4, 8]
    keep, req, qsl2, seq2 = row_segments(np.zeros(0, np.int64), qsl, seq)
    assert keep.size == req.size == seq2.size == 0 and qsl2.tolist() == [0]


@pytest.fixture(scope="module")
def step() -> dict[str, Any]:
    """A step over LAYOUT: the paged cache holding every request's context and this step's
    K/V, the CPU_ATTN metadata, and the backend's own output on the full layout."""
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackendImpl,
        CPUAttentionMetadata,
        _get_attn_isa,
    )

    cfg = VllmConfig()
    cfg.model_config = SimpleNamespace(dtype=torch.float32)  # type: ignore[assignment]
    with set_current_vllm_config(cfg):
        impl = CPUAttentionBackendImpl(
            HEADS, HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM), KV_HEADS, None, None, "auto"
        )
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM, "auto")
    layer: Any = SimpleNamespace(impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    gen = torch.Generator().manual_seed(7)
    seq_lens = [c + q for c, q in LAYOUT]
    pages = max(-(-s // BLOCK) for s in seq_lens)
    n_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 3
    order = torch.randperm(n_blocks, generator=gen)  # blocks scattered over the cache
    table = torch.zeros(len(LAYOUT), pages, dtype=torch.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        nb = -(-s // BLOCK)
        table[r, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    kv_cache = torch.zeros(n_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)

    def slots(r: int, positions: range) -> list[int]:
        return [int(table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]

    ctx_slots = [s for r, (c, _) in enumerate(LAYOUT) for s in slots(r, range(c))]
    k_ctx = torch.randn(len(ctx_slots), KV_HEADS, HEAD_DIM, generator=gen)
    v_ctx = torch.randn(len(ctx_slots), KV_HEADS, HEAD_DIM, generator=gen)
    impl.do_kv_cache_update(layer, k_ctx, v_ctx, kv_cache, torch.tensor(ctx_slots))
    step_slots = torch.tensor([s for r, (c, q) in enumerate(LAYOUT)
                               for s in slots(r, range(c, c + q))])  # fmt: skip
    n = int(step_slots.shape[0])
    q = 3.0 * torch.randn(n, HEADS, HEAD_DIM, generator=gen)  # peaked softmaxes too
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    impl.do_kv_cache_update(layer, k, v, kv_cache, step_slots)
    qsl = torch.tensor(
        np.concatenate([[0], np.cumsum([q_ for _, q_ in LAYOUT])]), dtype=torch.int32
    )
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(LAYOUT), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        seq_lens=seq_t, dtype=torch.float32, query_start_loc=qsl, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=True, kv_cache_dtype="auto",
    )  # fmt: skip
    md = CPUAttentionMetadata(
        num_actual_tokens=n, max_query_len=max(q_ for _, q_ in LAYOUT), query_start_loc=qsl,
        max_seq_len=max(seq_lens), seq_lens=seq_t, block_table=table, slot_mapping=step_slots,
        scheduler_metadata=sched, causal=True,
    )  # fmt: skip
    out = torch.zeros(n, HEADS, HEAD_DIM)  # (vLLM's Attention passes [T, H, D] views)
    impl.forward(layer, q, k, v, kv_cache, md, out)
    out = out.view(n, -1)
    return dict(layer=layer, md=md, kv_cache=kv_cache, q=q, full=out, n=n, isa=isa)


def _subsets(n: int) -> dict[str, list[int]]:
    gen = np.random.default_rng(3)
    first = LAYOUT[0][1]
    return {
        "all": list(range(n)),
        "prefill_cut_in_the_middle": [r for r in range(n) if r not in (3, 17, 18, 39)],
        "prefill_without_its_last_row": list(range(first - 1)) + list(range(first, n)),
        "one_row_requests": [first, first + 8, first + 9],  # two decodes, a 1-token prompt
        "every_other": list(range(0, n, 2)),
        "one_row": [n - 2],
        "random_half": sorted(gen.choice(n, n // 2, replace=False).tolist()),
        "with_padding": [0, 5, n - 1, n, n + 2],  # rows >= n: padding of the step
        "padding_only": [n, n + 1],
    }


@pytest.mark.parametrize("name", list(_subsets(N)))
def test_rows_attention_equals_the_backend_on_the_full_layout(
    step: dict[str, Any], name: str
) -> None:
    n = step["n"]
    assert n == N
    rows = _subsets(n)[name]
    idx = torch.tensor(rows, dtype=torch.int64)
    plan = cpu_rows_plan(idx, step["md"], step["layer"].impl, step["isa"], torch.float32,
                         (HEADS, KV_HEADS, HEAD_DIM))  # fmt: skip
    q = step["q"]
    qm = torch.cat([q, torch.zeros(3, HEADS, HEAD_DIM)])[idx]  # padding rows' queries: zeros
    got = cpu_rows_attention(qm, step["kv_cache"], plan, step["layer"])
    assert got.shape == (len(rows), HEADS * HEAD_DIM)
    real = idx < n
    want = step["full"][idx[real]]
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))
    if name == "padding_only":
        assert not real.any()
        return
    diff = float((got[real] - want).abs().max())
    print(f"\n{name}: {len(rows)} rows, {plan.seq_lens.numel()} segments, max |diff| {diff:.3g}")
    assert diff <= 1e-6 * max(1.0, float(want.abs().max()))
    assert float(want.abs().max()) > 0.1  # (real outputs: the comparison is not of zeros)
