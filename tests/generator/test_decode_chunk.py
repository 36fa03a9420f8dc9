"""generator.torch_engine.chunked (generators.decode_chunk > 1): the fixed-depth graph decode
``chunk`` tokens a row per replay, each token drawn on the device and fed to the next step.
Its records equal the reference generation of each request alone and the 1-step path's, bit
for bit in exact numerics, with requests finishing by a stop token inside a chunk, by length,
more requests than slots (refills), chunk sizes that do and do not divide max_tokens, and
greedy requests; a call whose requests sample differently decodes one token a replay; bad
settings are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from generator.torch_engine.chunked import ChunkGraph, uniform_sampling
from generator.torch_engine.engine import TorchEngine
from models.checkpoint import load_model
from models.exits import FixedDepth
from models.random_init import init_checkpoint
from models.reference import SamplingParams, generate
from proto.records import WorkItem
from tests.generator import prompts, work_item


def _items(temperature: float, top_p: float) -> list[WorkItem]:
    """6 requests (3 + 2 + 1 seeds), prompts of 7, 3 and 11 tokens, one sampling setting;
    the first item's completions can stop early, the others run to max_tokens 9 / 5 / 10."""
    ps = prompts(3, [7, 3, 11], seed=5)
    items = [
        work_item(ps[0], [11, 2**64 - 3, 4], temperature=temperature, top_p=top_p,
                  max_tokens=9, name="a"),
        work_item(ps[1], [5, 6], temperature=temperature, top_p=top_p, max_tokens=5, name="b"),
        work_item(ps[2], [12345], temperature=temperature, top_p=top_p, max_tokens=10, name="c"),
    ]  # fmt: skip
    items[0].stop_token_ids = [int(t) for t in range(2, 512, 5)]
    return items


def _reference(model: torch.nn.Module, it: WorkItem, seed: int, depth: int) -> tuple:
    greedy = it.temperature == 0
    sp = SamplingParams(temperature=1.0 if greedy else it.temperature,
                        top_p=1.0 if greedy else it.top_p, max_new_tokens=it.max_tokens,
                        stop_token_ids=tuple(it.stop_token_ids), greedy=greedy)  # fmt: skip
    (g,) = generate(model, [it.prompt_tokens.tolist()], [seed], sp, FixedDepth(depth), "exact")  # type: ignore[arg-type]
    return g.tokens, g.exit_depths, g.logprobs.numpy()


def _engine(path: Path, chunk: int, device: str = "cpu") -> TorchEngine:
    return TorchEngine(path, numerics="exact", max_num_seqs=2, device=device, graph=True,
                       decode_chunk=chunk)  # fmt: skip


@pytest.mark.parametrize(("family", "chunk", "temperature", "top_p"), [
    ("huginn", 4, 0.8, 0.9), ("ouro", 3, 1.0, 1.0), ("huginn", 2, 0.0, 1.0)])  # fmt: skip
def test_chunks_equal_the_reference_and_the_one_step_path(
    family: str, chunk: int, temperature: float, top_p: float, tmp_path: Path
) -> None:
    path = init_checkpoint(family, "tiny", tmp_path / family, seed=1)
    items = _items(temperature, top_p)
    eng = _engine(path, chunk)
    out = eng.generate(items)
    assert eng._kept is not None and isinstance(eng._kept[1], ChunkGraph)  # the chunked path ran
    assert eng._kept[1].chunk == chunk
    _, model = load_model(path)
    finish, lengths = set(), set()
    for it, samples in zip(items, out, strict=True):
        for seed, s in zip(it.latent_seeds.tolist(), samples, strict=True):
            tokens, depths, lps = _reference(model, it, int(seed), eng.full_depth)
            assert s.tokens.tolist() == tokens, (it.work_id, seed)
            assert s.exit_depths.tolist() == depths and s.weight_version == 0
            np.testing.assert_array_equal(s.logprobs, lps)  # bit for bit
            finish.add(s.finish_reason)
            lengths.add(len(tokens))
    assert "length" in finish and len(lengths) >= 3, (finish, lengths)
    one = _engine(path, 1).generate(items)  # the 1-step look-ahead path: the same records
    for a, b in zip(out, one, strict=True):
        for sa, sb in zip(a, b, strict=True):
            assert sa.tokens.tolist() == sb.tokens.tolist()
            np.testing.assert_array_equal(sa.logprobs, sb.logprobs)
    again = eng.generate(items)  # the kept chunk graph serves the next call the same
    for a, b in zip(out, again, strict=True):
        assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]


def test_a_stop_inside_a_chunk_is_found_and_its_later_tokens_dropped(tmp_path: Path) -> None:
    """With chunks of 4 and stop tokens over a fifth of the vocabulary, completions stop at
    positions inside a chunk: each record ends at its first stop token (the reference's)."""
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    ps = prompts(4, [5, 6, 7, 8], seed=9)
    items = [work_item(p, [i, i + 100], temperature=1.0, max_tokens=12, name=f"s{i}")
             for i, p in enumerate(ps)]  # fmt: skip
    for it in items:
        it.stop_token_ids = [int(t) for t in range(0, 512, 5)]
    eng = _engine(path, 4)
    out = eng.generate(items)
    _, model = load_model(path)
    stops = []
    for it, samples in zip(items, out, strict=True):
        for seed, s in zip(it.latent_seeds.tolist(), samples, strict=True):
            tokens, _, lps = _reference(model, it, int(seed), eng.full_depth)
            assert s.tokens.tolist() == tokens
            np.testing.assert_array_equal(s.logprobs, lps)
            if s.finish_reason == "stop":
                stops.append(len(tokens))
    assert any(n % 4 not in (0, 1) for n in stops), stops  # a stop inside a chunk


def test_mixed_sampling_decodes_one_token_a_replay(tmp_path: Path) -> None:
    path = init_checkpoint("ouro", "tiny", tmp_path / "o", seed=1)
    items = _items(0.8, 0.9)
    items[1].temperature = 0.0  # a greedy item beside sampled ones
    assert uniform_sampling(_reqs(items)) is None
    eng = _engine(path, 4)
    out = eng.generate(items)
    assert eng._kept is None or not isinstance(eng._kept[1], ChunkGraph)
    one = _engine(path, 1).generate(items)
    for a, b in zip(out, one, strict=True):
        for sa, sb in zip(a, b, strict=True):
            assert sa.tokens.tolist() == sb.tokens.tolist()


def _reqs(items: list[WorkItem]) -> list:
    class R:
        def __init__(self, it: WorkItem) -> None:
            self.work = it

    return [R(it) for it in items]


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    path = init_checkpoint("ouro", "tiny", tmp_path / "o", seed=1)
    with pytest.raises(ValueError, match="decode_chunk=0: must be >= 1"):
        _engine(path, 0)
    with pytest.raises(ValueError, match="decode_chunk=4.*fixed-depth graph decode"):
        TorchEngine(path, numerics="exact", device="cpu", graph=False, decode_chunk=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunks_on_cuda_equal_the_one_step_path(tmp_path: Path) -> None:
    """The captured chunk graph (CUDA) against the 1-step graph path, exact numerics."""
    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    items = _items(0.8, 0.9)
    out = _engine(path, 4, "cuda").generate(items)
    one = _engine(path, 1, "cuda").generate(items)
    for a, b in zip(out, one, strict=True):
        for sa, sb in zip(a, b, strict=True):
            assert sa.tokens.tolist() == sb.tokens.tolist()
            np.testing.assert_array_equal(sa.logprobs, sb.logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_that_keeps_failing_decodes_eagerly_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every capture invalidated (the learner's thread beside it): the chunk graph and the
    1-step decoder warn and decode eagerly, the same tokens, instead of stopping the generator."""
    from models.engine import graph as g

    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    items = _items(0.8, 0.9)
    one = _engine(path, 1, "cuda").generate(items)

    def fail(body: object, **kw: object) -> object:
        raise g.CaptureFailed("capture invalidated 4 times: stood in")

    monkeypatch.setattr(g, "captured", fail)  # (the one capture path of both decoders)
    for chunk in (4, 1):
        eng = _engine(path, chunk, "cuda")
        out = eng.generate(items)
        kept = eng._kept[1] if eng._kept is not None else None
        assert kept is not None and kept.graphed is False, chunk
        for a, b in zip(out, one, strict=True):
            for sa, sb in zip(a, b, strict=True):
                assert sa.tokens.tolist() == sb.tokens.tolist()
                np.testing.assert_array_equal(sa.logprobs, sb.logprobs)


def test_a_cpu_engine_honours_the_key_and_a_run_config_refuses_what_cannot(
    tmp_path: Path,
) -> None:
    """On the CPU (graph None) decode_chunk > 1 selects the graph path, its steps eager; the
    run config refuses it with the vLLM engine or the tick decode, by name."""
    from models.errors import ConfigError
    from pipeline.config.run import load_config

    path = init_checkpoint("ouro", "tiny", tmp_path / "o", seed=1)
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", decode_chunk=3)
    assert eng.graph
    eng.generate(_items(1.0, 1.0))
    assert eng._kept is not None and isinstance(eng._kept[1], ChunkGraph)
    for bad in (
        ["generators.engine=vllm"],
        ["generators.engine=torch", "generators.depth_ticks=2"],
    ):
        with pytest.raises(ConfigError, match="generators.decode_chunk=4: is the torch engine's"):
            load_config(None, ["generators.decode_chunk=4", *bad])
    ok = load_config(None, ["generators.decode_chunk=4", "generators.engine=torch"])
    assert ok.generators.decode_chunk == 4


@pytest.mark.slow
def test_looprl_run_with_chunks_trains(tmp_path: Path) -> None:
    """`looprl run generators.engine=torch generators.decode_chunk=4`: the key reaches the
    generator process's engine (its log says so), the run trains and serves its versions."""
    from pipeline.core.metrics import read_metrics
    from tests.cli.test_run_llama import looprl_run

    run_dir = tmp_path / "run"
    code, err, _ = looprl_run(run_dir, "steps=4", "generators.engine=torch",
                              "generators.decode_chunk=4", timeout_s=300)  # fmt: skip
    assert code == 0, err[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["refused_total"] == 0
    log = (run_dir / "logs" / "gen0.log").read_text()
    assert "torch engine: 4 tokens a row per graph replay" in log, log[-2000:]
    assert "serving weights v1" in log


def test_a_chunk_graph_that_cannot_be_built_falls_back_to_one_token_a_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A RoPE table the model refuses (Huginn's position bound, say): logged, the call decodes
    one token a replay with the same records."""
    import generator.torch_engine.engine as engine_mod

    class Refused(ChunkGraph):
        def __init__(self, *_a: object, **_k: object) -> None:
            raise ValueError("position 70 is beyond block_size 64")

    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    items = _items(1.0, 1.0)
    want = _engine(path, 1).generate(items)
    monkeypatch.setattr(engine_mod, "ChunkGraph", Refused)
    eng = _engine(path, 4)
    with caplog.at_level("WARNING", logger="generator.torch_engine.engine"):
        out = eng.generate(items)
    assert "decode_chunk 4 not used (position 70 is beyond block_size 64)" in caplog.text
    assert eng.decode_chunk == 1
    for a, b in zip(out, want, strict=True):
        assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]


def test_a_version_swapped_in_between_two_chunks(tmp_path: Path) -> None:
    """inflight_updates on the chunked path: a version loaded during the 2nd chunk is swapped in
    before the 3rd; every token of a chunk records the version its replay ran with: the old
    weights' tokens bit for bit before, different after."""
    import threading

    from models.checkpoint import load_checkpoint
    from tests.generator.update_utils import perturbed
    from weights.digest import digest_of_state
    from weights.verified import VerifiedWeights

    path = init_checkpoint("huginn", "tiny", tmp_path / "h", seed=1)
    _, state = load_checkpoint(path)
    new = perturbed(state, seed=7)
    items = [work_item(prompts(1, [5], seed=3)[0], [21, 22], temperature=1.0, max_tokens=13,
                       name="long")]  # fmt: skip
    old_only = _engine(path, 3).generate(items)[0]
    eng = TorchEngine(path, numerics="exact", max_num_seqs=2, device="cpu", graph=True,
                      inflight_updates=True, decode_chunk=3)  # fmt: skip
    runs: list[int] = []
    real_run = ChunkGraph.run

    def counting(self: ChunkGraph) -> None:
        real_run(self)
        runs.append(eng.weight_version)
        if len(runs) == 2:
            t = threading.Thread(target=eng.load_weights,
                                 args=(VerifiedWeights.of(new, 1, digest_of_state(new)),))  # fmt: skip
            t.start()
            t.join()

    mp = pytest.MonkeyPatch()
    mp.setattr(ChunkGraph, "run", counting)
    try:
        mixed = eng.generate(items)[0]
    finally:
        mp.undo()
    assert runs[:3] == [0, 0, 1] and eng.weight_version == 1
    for s_old, s_mix in zip(old_only, mixed, strict=True):
        v = s_mix.token_versions.tolist()
        # the first token comes from the prefill, then chunks of 3: tokens 1..6 at v0
        assert v[:7] == [0] * 7 and set(v[7:]) == {1}, v
        assert s_mix.tokens[:7].tolist() == s_old.tokens[:7].tolist()
        np.testing.assert_array_equal(s_mix.logprobs[:7], s_old.logprobs[:7])
        diff = np.abs(s_mix.logprobs[7:] - s_old.logprobs[7 : len(s_mix.logprobs)])
        assert float(diff.max()) > 1e-4
