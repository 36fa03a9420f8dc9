"""The torch engine decoding adaptive depths by ticks (`TorchEngine(ticks=k)`,
generator.torch_engine.ticks): every row at its own core iteration of its own token, more
requests than slots (a freed slot prefilled while the other rows are mid-token), mixed exit
depths, greedy / sampled / stopping requests: each record equals the reference generation of
its request alone (models.reference.generate), bit for bit in exact numerics, as the chunk
decode's do (tests/generator/test_torch_engine.py); refused where it cannot decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from generator.torch_engine.engine import TorchEngine
from models.exits import KL, ExitPolicy, FixedDepth, LatentDiff, OuroGate, SampledGate
from models.random_init import init_checkpoint
from tests.generator import prompts, work_item
from tests.generator.test_torch_engine import _items, equal_to_reference

CASES: list[tuple[str, ExitPolicy, int]] = [
    ("huginn", LatentDiff(0.45), 1),
    ("huginn", LatentDiff(0.45), 3),
    ("ouro", OuroGate(0.8, kv="last_exited"), 2),  # token 0 under the policy (contract 2)
    ("ouro", SampledGate(kv="last_exited"), 1),  # exits drawn, their log-probs filed
    ("ouro", SampledGate(kv="last_exited"), 3),  # ... while exited rows wait for the readout
]


@pytest.mark.parametrize("tick_graph", [False, True], ids=["eager", "fixed_shape"])
@pytest.mark.parametrize("family,policy,ticks", CASES)
def test_ticks_records_equal_the_reference(
    family: str, policy: ExitPolicy, ticks: int, tick_graph: bool, tmp_path: Path
) -> None:
    """(tick_graph: the ticks at one shape, models.engine.tickgraph.GraphTicker; a CUDA graph
    on a GPU, eager on the same buffers here.)"""
    path = init_checkpoint(family, "tiny", tmp_path / family, seed=1)
    eng = TorchEngine(path, numerics="exact", exit_policy=policy, max_num_seqs=2, device="cpu",
                      ticks=ticks, tick_graph=tick_graph)  # fmt: skip
    items = _items()
    items[2].stop_token_ids = [int(t) for t in range(3, 512, 7)]  # some completions stop early
    equal_to_reference(path, items, eng.generate(items), policy)


@pytest.mark.parametrize("slots,readout_rows", [(2, None), (4, 2)], ids=["all_rows", "2_of_4"])
@pytest.mark.parametrize("family,policy,ticks", CASES)
def test_graph_steps_records_equal_the_reference(
    family: str, policy: ExitPolicy, ticks: int, slots: int, readout_rows: int | None,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Every request of a call at one (temperature, top_p): the readout, the draw and the feed
    run inside the fixed-shape step (GraphTicker.step: one CUDA graph replay on a GPU, eager on
    the same buffers here); records equal the reference's bit for bit in exact numerics: greedy,
    sampled with top_p, stops, more requests than slots (freed slots refilled), a one-token
    prompt; every prompt fed token by token through the ticks (GraphTicker.feed_prompts).
    readout_rows 2 of 4 slots: a step reads out at most two rows (the others wait; some steps
    have more exited rows than that) while the last step collected read out fewer, else all
    four: the records are the same."""
    import generator.torch_engine.ticks as tt
    from models.engine.tickgraph import GraphTicker

    calls = []
    real = tt._by_graph_steps
    monkeypatch.setattr(tt, "_by_graph_steps", lambda *a: calls.append(1) or real(*a))
    widths: list[int] = []
    real_feed = GraphTicker._readout_feed
    monkeypatch.setattr(GraphTicker, "_readout_feed",
                        lambda self, n: widths.append((n, len(self.rows),
                                                       int(self._waiting().sum())))
                        or real_feed(self, n))  # fmt: skip
    path = init_checkpoint(family, "tiny", tmp_path / family, seed=1)
    eng = TorchEngine(path, numerics="exact", exit_policy=policy, max_num_seqs=slots,
                      device="cpu", ticks=ticks, tick_graph=True, readout_rows=readout_rows)  # fmt: skip
    items = _items()
    items[2].latent_seeds = np.asarray([12345, 7, 99, 5, 3], dtype=np.uint64)  # more than slots
    items[2].stop_token_ids = [int(t) for t in range(3, 512, 7)]  # some completions stop early
    # a one-token prompt: its only position samples token 0
    items.append(work_item(prompts(1, [1], seed=9)[0], [77, 78, 79], temperature=1.0,
                           top_p=1.0, max_tokens=4, name="d"))  # fmt: skip
    results = [eng.generate([it])[0] for it in items]  # one sampling setting a call
    assert len(calls) == len(items)
    equal_to_reference(path, items, results, policy)
    if readout_rows is None:
        assert all(n == b for n, b, _ in widths), sorted(set(widths))
    else:  # compacted steps; with a readout every 2+ ticks some had more rows exited than
        # they read out (those waited for a later step)
        assert any(n < b for n, b, _ in widths), sorted(set(widths))
        assert ticks == 1 or any(n < b and w > n for n, b, w in widths), sorted(set(widths))


def test_ticks_refused_where_they_cannot_decode(tmp_path: Path) -> None:
    path = init_checkpoint("ouro", "tiny", tmp_path / "o", seed=1)
    with pytest.raises(ValueError, match="decode by ticks needs kv last_exited and no graph"):
        TorchEngine(path, numerics="exact", exit_policy=OuroGate(0.8), device="cpu", ticks=1)
    with pytest.raises(ValueError, match="graph"):
        TorchEngine(path, exit_policy=FixedDepth(4), device="cpu", graph=True, ticks=1)
    with pytest.raises(ValueError, match="ticks must be >= 0"):
        TorchEngine(path, device="cpu", ticks=-1)
    with pytest.raises(ValueError, match="tick_graph needs decode by ticks"):
        TorchEngine(path, device="cpu", tick_graph=True)
    with pytest.raises(ValueError, match="readout_rows=4: needs tick_graph"):
        TorchEngine(path, exit_policy=OuroGate(0.8, kv="last_exited"), device="cpu", ticks=1,
                    readout_rows=4)  # fmt: skip
    with pytest.raises(ValueError, match="readout_rows=0: needs tick_graph and a value >= 1"):
        TorchEngine(path, exit_policy=OuroGate(0.8, kv="last_exited"), device="cpu", ticks=1,
                    tick_graph=True, readout_rows=0)  # fmt: skip
    hug = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    with pytest.raises(ValueError, match="tick_graph: KL reads a readout every iteration"):
        TorchEngine(hug, exit_policy=KL(0.1), device="cpu", ticks=1, tick_graph=True)
    assert not TorchEngine(hug, exit_policy=KL(0.1), device="cpu", ticks=1).tick_graph


def test_the_generator_key_reaches_the_main_torch_engine_only(tmp_path: Path) -> None:
    """generators.depth_ticks: refused for the vLLM engine and below 0, naming the key; handed
    to the generator's main torch engine (not to the FixedDepth engines of eval.depths), which
    then decodes by ticks."""
    from generator.config import GeneratorConfig
    from models.errors import ConfigError
    from pipeline.commands.generator_cli import engine_kwargs

    with pytest.raises(ConfigError, match="depth_ticks=2: only the torch engine decodes by ticks"):
        GeneratorConfig(engine="vllm", depth_ticks=2)
    with pytest.raises(ConfigError, match="depth_ticks=-1: must be >= 0"):
        GeneratorConfig(engine="torch", depth_ticks=-1)
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    common, main_only = engine_kwargs(GeneratorConfig(model=str(path), engine="torch",
                                                      depth_ticks=2))  # fmt: skip
    assert main_only == {"ticks": 2, "inflight_updates": False, "decode_chunk": 1}
    assert "ticks" not in common and "decode_chunk" not in common
    eng = TorchEngine(path, exit_policy=LatentDiff(0.45), device="cpu", **common, **main_only)
    assert eng.ticks == 2
    assert engine_kwargs(GeneratorConfig(engine="vllm"))[1] == {"inflight_updates": False}


def test_the_benchmark_prints_its_line() -> None:
    """benchmarks/torch_depth.py --tiny (the CPU smoke run of the GPU benchmark): one JSON
    line, every configuration timed, the tick rows the same tokens and exits as the chunk rows,
    the solved gate's mean depths below the full depth."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks/torch_depth.py"), "--device", "cpu", "--tiny",
         "--batch", "4", "--depth", "6", "--tokens", "4", "--reps", "1", "--ticks", "2",
         "--temperature", "1", "--profile", "half:chunk"],
        capture_output=True, text=True, timeout=300, env=env, cwd=root, check=True,
    )  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {x["config"]: x for x in r["rows"]}
    assert set(rows) == {"fixed"} | {f"{s}:{p}" for s in ("gate_fixed", "half", "quarter")
                                     for p in ("chunk", "ticks2")}  # fmt: skip
    assert all(x["tokens_per_s"] > 0 for x in rows.values())
    assert all(x["same_as_chunk"] for k, x in rows.items() if k.endswith("ticks2"))
    assert rows["gate_fixed:chunk"]["mean_depth"] == 6.0
    assert rows["quarter:chunk"]["mean_depth"] < rows["half:chunk"]["mean_depth"] < 6.0
    prof = r["profiles"]["half:chunk"]  # sampled requests; the stages inside the call's time
    assert r["temperature"] == 1.0
    assert set(prof["stages_s"]) >= {"_prefill", "_decode", "_sample_block"}
    assert 0 < sum(prof["stages_s"].values()) <= prof["call_s"]
    assert prof["top_host_ms"] and all(ms >= 0 for _, ms, _ in prof["top_host_ms"])


def test_the_graph_stand_in_prints_its_line() -> None:
    """benchmarks/depth_graphs.py --tiny on the CPU (its graphs run eagerly there): one JSON line,
    labelled a stand-in, every configuration timed, the schedules' mean depths in order."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks/depth_graphs.py"), "--device", "cpu", "--tiny",
         "--batch", "16", "--depth", "6", "--steps", "3", "--reps", "1", "--buckets", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=root, check=True,
    )  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {x["config"]: x for x in r["rows"]}
    assert r["stand_in"] is True and set(rows) == {
        "graph_fixed", "buckets:fixed", "buckets:half", "buckets:quarter"}  # fmt: skip
    assert all(x["ms_per_token"] > 0 for x in rows.values())
    assert rows["buckets:quarter"]["mean_depth"] < rows["buckets:half"]["mean_depth"] < 6.0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("readout_rows", [None, 1], ids=["all_rows", "1_of_2"])
@pytest.mark.parametrize("family,policy,ticks", [CASES[1], CASES[4]])
def test_graph_steps_on_cuda(
    family: str, policy: ExitPolicy, ticks: int, readout_rows: int | None, tmp_path: Path
) -> None:
    """On CUDA the step is a captured CUDA graph (ticks, readout, draw, feed): in exact
    numerics its records equal the eager ticks' (host readout and draw) on the same device, bit
    for bit, greedy and sampled, with slots refilled; readout_rows 1: the compacted readout's
    graph and the full one captured and replayed as the steps need."""
    path = init_checkpoint(family, "tiny", tmp_path / family, seed=1)
    items = _items()
    items[2].latent_seeds = np.asarray([12345, 7, 99], dtype=np.uint64)
    out = {}
    for graph in (False, True):
        eng = TorchEngine(path, numerics="exact", exit_policy=policy, max_num_seqs=2,
                          device="cuda", ticks=ticks, tick_graph=graph,
                          readout_rows=readout_rows if graph else None)  # fmt: skip
        assert eng.tick_graph is graph
        out[graph] = [eng.generate([it])[0] for it in items]
        out[graph] += [eng.generate([it])[0] for it in items]  # the kept graph, again
    for a, b in zip(out[False], out[True], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist()
            assert x.exit_depths.tolist() == y.exit_depths.tolist()
            assert np.array_equal(x.logprobs, y.logprobs)
            if x.exit_logprobs is not None:
                assert np.array_equal(x.exit_logprobs, y.exit_logprobs)
