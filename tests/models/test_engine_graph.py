"""The sync-free fixed-depth decode step (models.engine.graph) against run_chunk's decode, and
generate(graph=True) against generate(): the same bits on the CPU, where GraphDecoder runs the
graph's step eagerly."""

from __future__ import annotations

import pytest
import torch

from models.base import LoopedLM
from models.engine.chunk import KVCache, run_chunk
from models.engine.graph import GraphDecoder, decode_step
from models.exits import KL, ExitPolicy, FixedDepth, LatentDiff, OuroGate
from models.noise import latent_noise
from models.reference import SamplingParams, generate
from tests.models.test_reference import PROMPTS, SEEDS, model_of

FAMILIES = ["huginn", "ouro", "llama"]


def _clone(c: KVCache) -> KVCache:
    return KVCache(c.prelude.clone(), c.core.clone(), c.coda.clone(), c.filled.clone())


def _prefill(model: LoopedLM, depth: int, mode: str, steps: int) -> tuple[KVCache, torch.Tensor]:
    """PROMPTS (mixed lengths) through run_chunk at `depth`; the cache and each row's length."""
    lens = torch.tensor([len(p) for p in PROMPTS])
    bsz, width = len(PROMPTS), int(lens.max())
    toks = torch.zeros(bsz, width, dtype=torch.int64)
    for b, p in enumerate(PROMPTS):
        toks[b, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(bsz, -1)
    cache = KVCache.empty(model, bsz, width + steps, depth)
    run_chunk(model, cache, toks, positions, positions < lens[:, None], SEEDS, max_depth=depth,
              depths=torch.full(toks.shape, depth), mode=mode)  # fmt: skip
    return cache, lens


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("deeper", [0, 3], ids=["max_depth", "deeper"])
def test_decode_step_equals_run_chunk(family: str, mode: str, deeper: int) -> None:
    """generate's decode chunk (run_chunk with a FixedDepth policy) and GraphDecoder's step give
    the same logits, hidden states and K/V caches, bit for bit, over several tokens; also at a
    depth beyond the model's trained one (Huginn: > mean_recurrence)."""
    model, steps = model_of(family), 4
    depth = model.max_depth + deeper
    cache, lens = _prefill(model, depth, mode, steps)
    other = _clone(cache)
    dec = GraphDecoder(model, other, SEEDS, depth=depth, mode=mode)
    assert not dec.graphed  # the CPU: the graph's step, eagerly
    tok = torch.tensor([5, 300, 17])
    for t in range(steps):
        pos = lens + t
        live = torch.ones(3, 1, dtype=torch.bool)
        ref = run_chunk(model, cache, tok[:, None], pos[:, None], live, SEEDS, max_depth=depth,
                        policy=FixedDepth(depth), mode=mode)  # fmt: skip
        out = dec.step(tok, pos)
        assert torch.equal(out.logits, ref.logits), float((out.logits - ref.logits).abs().max())
        assert torch.equal(out.hidden, ref.hidden)
        assert out.depths.tolist() == ref.depths.tolist() == [[depth]] * 3
        lp_ref = torch.log_softmax(ref.logits[:, 0], dim=-1)
        assert float((torch.log_softmax(out.logits[:, 0], dim=-1) - lp_ref).abs().max()) <= 1e-6
        tok = lp_ref.argmax(dim=-1)
    for name in ("prelude", "core", "coda", "filled"):
        assert torch.equal(getattr(other, name), getattr(cache, name)), name


@torch.no_grad()
def test_decode_step_takes_the_latent_noise_it_is_given() -> None:
    """Huginn's s_0 comes from the `noise` argument (GraphDecoder's buffer): the rows'
    latent_noise gives the bits of the step that draws it itself; other noise other logits."""
    model, depth = model_of("huginn"), 3
    cache, lens = _prefill(model, depth, "exact", 1)
    tok, rope = torch.tensor([5, 300, 17]), model.rope(lens, "exact")
    drawn = latent_noise(SEEDS, lens, model.hidden_size)
    runs = [
        decode_step(
            model, _clone(cache), tok, lens, rope, SEEDS, depth=depth, mode="exact", noise=z
        ).logits
        for z in (None, drawn, torch.zeros_like(drawn))
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_generate_graph_equals_generate(family: str, mode: str) -> None:
    """generate(graph=True) == generate(): tokens, log-probs (bit for bit), depths, finish
    reasons; with sampling (temperature, top-p), mixed prompt lengths and a row that stops early
    (it keeps being fed in the graph path, its outputs ignored). Huginn at a depth beyond its
    mean_recurrence, the others at their default (full) depth."""
    model = model_of(family)
    policy = FixedDepth(model.max_depth + 2) if family == "huginn" else None
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10)
    first = generate(model, PROMPTS, SEEDS, sampling, policy, mode)
    stop = (first[0].tokens[3],)  # row 0 stops after 4 tokens
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, stop_token_ids=stop)
    eager = generate(model, PROMPTS, SEEDS, sampling, policy, mode)
    graphed = generate(model, PROMPTS, SEEDS, sampling, policy, mode, graph=True)
    assert eager[0].finish_reason == "stop" and len(eager[0].tokens) <= 4
    assert max(len(g.tokens) for g in eager) == 10
    for e, g in zip(eager, graphed):
        assert g.tokens == e.tokens
        assert torch.equal(g.logprobs, e.logprobs)
        assert g.exit_depths == e.exit_depths
        assert g.finish_reason == e.finish_reason


@pytest.mark.parametrize("policy", [LatentDiff(0.45), KL(0.1), OuroGate(0.8)])
def test_generate_graph_refuses_an_adaptive_exit(policy: ExitPolicy) -> None:
    model = model_of("ouro" if isinstance(policy, OuroGate) else "huginn")
    with pytest.raises(ValueError, match=r"graph=True\) needs a fixed depth \(FixedDepth\)"):
        generate(model, PROMPTS, SEEDS, SamplingParams(max_new_tokens=3), policy, graph=True)


def test_decoder_checks_its_arguments() -> None:
    model = model_of("llama")
    cache = KVCache.empty(model, 2, 8, 1)
    with pytest.raises(ValueError, match="CUDA graph needs the cache on a CUDA device"):
        GraphDecoder(model, cache, [1, 2], depth=1, graph=True)
    with pytest.raises(ValueError, match="one latent seed per row"):
        GraphDecoder(model, cache, [1], depth=1)
    with pytest.raises(ValueError, match=r"depth 2 outside \[1, 1\]"):
        GraphDecoder(model, cache, [1, 2], depth=2)
    dec = GraphDecoder(model, cache, [1, 2], depth=1)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 8\)"):
        dec.step(torch.tensor([1, 2]), torch.tensor([3, 8]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_equals_eager_step(family: str) -> None:
    """On CUDA: the captured graph replays the eager step's bits (and generate agrees)."""
    model = model_of(family).cuda()
    try:
        depth = model.max_depth
        cache, lens = _prefill(model, depth, "fast", 4)
        outs = {}
        for graph in (False, True):
            dec = GraphDecoder(model, _clone(cache), SEEDS, depth=depth, graph=graph)
            tok, lps = torch.tensor([5, 300, 17], device="cuda"), []
            for t in range(4):
                lp = torch.log_softmax(dec.step(tok, lens + t).logits[:, 0], dim=-1)
                tok = lp.argmax(dim=-1)
                lps.append(lp.gather(-1, tok[:, None]))
            outs[graph] = torch.cat(lps, dim=1)
        assert torch.equal(outs[True], outs[False])
        sampling = SamplingParams(max_new_tokens=6)
        a = generate(model, PROMPTS, SEEDS, sampling)
        b = generate(model, PROMPTS, SEEDS, sampling, graph=True)
        assert [g.tokens for g in a] == [g.tokens for g in b]
        assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    finally:
        model.cpu()


def _compiled_vs_eager(family: str, device: str) -> tuple[float, float, int]:
    """Greedy decode of 4 tokens by GraphDecoder(compile=True) and the eager step from one
    prefilled cache: (max |delta logp| of the chosen tokens, of whole rows, compiled graphs)."""
    import torch._dynamo.utils as du

    model = model_of(family).to(device)
    depth = model.max_depth
    cache, lens = _prefill(model, depth, "fast", 4)
    outs: dict[bool, list[torch.Tensor]] = {}
    before = du.counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        dec = GraphDecoder(model, _clone(cache), SEEDS, depth=depth, compile=compiled)
        tok, rows = torch.tensor([5, 300, 17], device=device), []
        for t in range(4):
            lp = torch.log_softmax(dec.step(tok, lens + t).logits[:, 0], dim=-1)
            tok = lp.argmax(dim=-1) if not compiled else outs[False][t].argmax(dim=-1)
            rows.append(lp)
        outs[compiled] = rows
    row = max(float((a - b).abs().max()) for a, b in zip(outs[False], outs[True], strict=True))
    chosen = max(
        float((a.max(-1).values - b.gather(-1, a.argmax(-1, keepdim=True))[:, 0]).abs().max())
        for a, b in zip(outs[False], outs[True], strict=True)
    )
    return chosen, row, du.counters["stats"]["unique_graphs"] - before


@torch.no_grad()
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs CUDA"))],
)  # fmt: skip
def test_compiled_regions_match_the_eager_step(device: str) -> None:
    """GraphDecoder(compile=True): the blocks' qkv / post under torch.compile (fast mode) decode
    within fp32 rounding of the eager step (same tokens fed), compiled once for every block of
    the model (not once per block); exact numerics refuse it. On CUDA: in the CUDA graph."""
    try:
        chosen, row, graphs = _compiled_vs_eager("huginn", device)
    finally:
        model_of("huginn").cpu()
    assert chosen <= 1e-5 and row <= 1e-4, (chosen, row)
    assert graphs <= 4, graphs  # qkv + post (+ a recompile for another x layout at most)
    model = model_of("llama")
    with pytest.raises(ValueError, match="fast numerics only"):
        GraphDecoder(model, KVCache.empty(model, 2, 8, 1), [1, 2], depth=1, mode="exact",
                     compile=True)  # fmt: skip


def test_the_capture_helpers_fall_back_once_and_capture_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """models.engine.graph.warm_on_side / captured, the one capture path of GraphDecoder,
    GraphTicker and the torch engine's ChunkGraph (the CUDA calls stood in for: this is the
    order and the fallback): a failing warm-up drops the compiled blocks and warms again; with
    none to drop the error is raised; the body runs inside the graph and its value comes back."""
    import contextlib

    from models.engine import graph as g

    calls: list[str] = []

    class FakeStream:
        def __init__(self, device: object = None) -> None:
            pass

        def wait_stream(self, other: object) -> None:
            calls.append("wait")

    monkeypatch.setattr(g.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(g.torch.cuda, "current_stream", lambda dev=None: FakeStream())
    monkeypatch.setattr(g.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(g.torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(g.torch.cuda, "graph", lambda graph, capture_error_mode: (
        calls.append(f"capture {capture_error_mode}") or contextlib.nullcontext()))  # fmt: skip
    compiled = {"on": True}

    def warm() -> None:
        calls.append("warm compiled" if compiled["on"] else "warm eager")
        if compiled["on"]:
            raise RuntimeError("inductor failed")

    def drop() -> bool:
        had, compiled["on"] = compiled["on"], False
        return had

    g.warm_on_side(torch.device("cpu"), warm, drop)
    assert calls == ["wait", "warm compiled", "warm eager", "wait"]
    compiled["on"] = True
    with pytest.raises(RuntimeError, match="inductor failed"):
        g.warm_on_side(torch.device("cpu"), warm, lambda: False)  # nothing to drop: raised
    calls.clear()
    graph, out = g.captured(lambda: calls.append("body") or 7)
    assert (graph, out) == ("graph", 7) and calls == ["capture thread_local", "body"]


def test_an_invalidated_capture_is_tried_again_then_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """models.engine.graph.captured (the CUDA calls stood in for: this is the retry logic): a
    capture another thread invalidated is tried again, up to its attempts, then CaptureFailed;
    an error that is not the capture's is raised at once."""
    import contextlib

    from models.engine import graph as g

    monkeypatch.setattr(g.torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(g.torch.cuda, "graph",
                        lambda graph, capture_error_mode: contextlib.nullcontext())  # fmt: skip
    monkeypatch.setattr(g.time, "sleep", lambda s: None)
    tries = {"n": 0}

    def body(fail: int, msg: str) -> object:
        tries["n"] += 1
        if tries["n"] <= fail:
            raise RuntimeError(msg)
        return "out"

    invalid = "CUDA error: operation failed due to a previous error during capture"
    assert g.captured(lambda: body(2, invalid), attempts=4) == ("graph", "out")
    assert tries["n"] == 3
    tries["n"] = 0
    with pytest.raises(g.CaptureFailed, match="invalidated 4 times"):
        g.captured(lambda: body(9, invalid), attempts=4)
    assert tries["n"] == 4
    tries["n"] = 0
    with pytest.raises(RuntimeError, match="shape mismatch") as e:
        g.captured(lambda: body(9, "shape mismatch"), attempts=4)
    assert tries["n"] == 1 and not isinstance(e.value, g.CaptureFailed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_really_invalidated_capture_recovers_on_cuda() -> None:
    """On CUDA: a capture whose first attempt makes a call the capture forbids (a device-wide
    synchronization, as another thread's can) is tried again; the graph it then gets replays
    the body's result, and the card works on."""
    from models.engine import graph as g

    x = torch.arange(8, dtype=torch.float32, device="cuda")
    y = torch.zeros_like(x)
    first = {"on": True}

    def body() -> None:
        if first["on"]:
            first["on"] = False
            torch.cuda.synchronize()  # not permitted while this thread captures
        y.copy_(x * 2 + 1)

    graph, _ = g.captured(body, pause_s=0.0)
    assert not first["on"]
    x.copy_(torch.arange(8, dtype=torch.float32, device="cuda") + 10)
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [(i + 10) * 2 + 1 for i in range(8)]
    assert (x + 1).sum().item() == sum(i + 11 for i in range(8))
