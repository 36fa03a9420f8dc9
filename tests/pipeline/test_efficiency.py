"""The metrics rows' perf/* keys (pipeline.core.efficiency) and their arithmetic (models.cost):
FLOPs on real tokens as benchmarks/trainer_gpu.py counts them, the decode bound from the bytes
a step reads, the card table."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.trainer_gpu import SHAPES, model_config, real_flops
from models.cost import LoopShape, card_peaks, decode_bound, decode_step_bytes, train_flops
from pipeline.core.efficiency import Efficiency
from tests.pipeline import rollout


@pytest.mark.parametrize("name", ["huginn_1b", "huginn_0125", "ouro_1b"])
@pytest.mark.parametrize("k", [0, 2, 8])
def test_train_flops_match_the_trainer_benchmarks_count(name: str, k: int) -> None:
    s = SHAPES[name]
    shape = LoopShape.of(model_config(s))
    seq, resp = [600, 1, 2049, 300], [500, 0, 2000, 1]
    want = real_flops(s, k, seq, resp)
    assert train_flops(shape, list(zip(seq, resp)), backprop_depth=k) == pytest.approx(want)


def test_the_decode_bound_counts_weights_per_layer_pass_and_the_kv_read() -> None:
    shape = LoopShape.of(model_config(SHAPES["huginn_1b"]))
    h = 2048
    block = 4 * h * h + 3 * h * 5632
    weights = 2 * (4 * block + 4 * (4 * block + 2 * h * h) + 65536 * h)
    kv = 256 * 300 * (2 + 2 + 4 * 4) * 2 * h * 2
    assert decode_step_bytes(shape, 256, 300) == weights + kv
    # the figure the GPU issue quotes: ~55,000-60,000 tokens/s on an H100 at batch 256
    assert 55_000 < decode_bound(shape, 256, 300, 3.35e12) < 60_000
    # half the depth reads fewer weights and K/V: a faster bound
    assert decode_bound(shape, 256, 300, 3.35e12, depth=2) > decode_bound(shape, 256, 300, 3.35e12)


def test_cards() -> None:
    assert card_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert card_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert card_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert card_peaks("cpu") is None


def rows(n: int, tokens: int) -> list[Any]:
    return [rollout(f"w{i}", 0, n_tokens=tokens) for i in range(n)]


def test_a_row_on_a_known_card() -> None:
    shape = LoopShape.of(model_config(SHAPES["huginn_1b"]))
    eff = Efficiency(shape, backprop_depth=8, peaks=(989e12, 3.35e12), ranks=2)
    rolls = rows(8, 10)  # prompts of 2 tokens, exit depth 4
    out = eff.row(rolls, train_s=0.5, step_s=2.0, delivery_s=0.25, version_bytes=1_000_000_000)
    assert out["perf/samples_per_s"] == 4.0 and out["perf/tokens_per_s"] == 40.0
    flops = train_flops(shape, [(11, 10)] * 8, depth=4, backprop_depth=8)
    assert out["perf/train_tflops"] == pytest.approx(flops / 0.5 / 1e12)
    assert out["perf/mfu"] == pytest.approx(flops / 0.5 / (2 * 989e12))
    bound = decode_bound(shape, 8, 2 + 5, 3.35e12, depth=4)
    assert out["perf/decode_bound_tokens_per_s"] == pytest.approx(bound)
    assert out["perf/of_decode_bound"] == pytest.approx(40.0 / bound)
    assert out["perf/delivery_gb_s"] == pytest.approx(4.0)


def test_a_cpu_row_leaves_the_card_keys_out_and_empty_steps_are_safe() -> None:
    shape = LoopShape.of(model_config(SHAPES["tiny"]))
    out = Efficiency(shape).row(rows(2, 3), train_s=0.1, step_s=0.2)
    assert set(out) == {"perf/samples_per_s", "perf/tokens_per_s", "perf/train_tflops"}
    assert Efficiency(shape).row([], train_s=0.0, step_s=0.0) == {}
    zero = Efficiency(shape).row(rows(2, 0), train_s=0.1, step_s=0.2)  # empty responses
    assert zero["perf/tokens_per_s"] == 0.0 and zero["perf/train_tflops"] > 0


def test_the_learners_flops_follow_each_positions_replay_depth() -> None:
    """A learned exit's rollouts: under kv last_exited the learner's replay (depth batching)
    runs the prompt's positions at the full depth and each response position at its exit
    depth, so the FLOPs counted are those, rollout by rollout; under kv full every position
    runs the row's full depth."""
    import dataclasses

    import numpy as np

    shape = LoopShape.of(model_config(SHAPES["huginn_1b"]))  # recurrence 4
    a, b = rows(2, 6)  # prompts of 2 tokens: positions 0 (full depth) and 1..6 (exits)
    a = dataclasses.replace(a, exit_depths=np.array([1, 1, 2, 1, 1, 2], np.uint8), full_depth=4)
    b = dataclasses.replace(b, exit_depths=np.array([4, 3, 4, 4, 2, 4], np.uint8), full_depth=4)
    last = Efficiency(shape, backprop_depth=8, peaks=(989e12, 3.35e12))
    assert last.replay_depth(a) == (4 + 8) / 7 and last.replay_depth(b) == (4 + 21) / 7
    out = last.row([a, b], train_s=1.0, step_s=1.0)
    want = sum(train_flops(shape, [(7, 6)], depth=d, backprop_depth=8)
               for d in (12 / 7, 25 / 7))  # fmt: skip
    assert out["perf/train_tflops"] == pytest.approx(want / 1e12)
    full = dataclasses.replace(last, kv="full")
    assert full.replay_depth(a) == full.replay_depth(b) == 4.0
    at_four = train_flops(shape, [(7, 6)] * 2, depth=4, backprop_depth=8)
    assert full.row([a, b], train_s=1.0, step_s=1.0)["perf/train_tflops"] == pytest.approx(
        at_four / 1e12)  # fmt: skip
    assert want < 0.8 * at_four  # what the exits save the learner here (0.753 of it)
