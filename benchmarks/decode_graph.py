"""Reference-engine decode in a CUDA graph vs eager: warm tokens/s and output equality, one JSON line.

    python benchmarks/decode_graph.py                  # H200: Huginn ~1B shape, fp32, fast mode
    python benchmarks/decode_graph.py --device cpu --tiny   # CPU smoke test (no graph)

What runs: the product path. `models.engine.chunk.run_chunk` is the engine generate decodes with:
one token per row per chunk, with host syncs (boolean-mask K/V writes, `.any()`, `.tolist()`,
the CPU latent noise). `models.engine.graph.decode_step` is its fixed-depth decode (every
token runs `depth` core iterations: `FixedDepth`) without the syncs, the same module calls in
the same order; `models.engine.graph.GraphDecoder` owns its static inputs and captures it once
in a CUDA graph. Per step, outside the graph, it copies in the token and position, the RoPE
rows (`model.rope`) and Huginn's latent noise (`models.noise.latent_noise`, drawn on the CPU);
those costs are in every timing below, as in generate.

Step variants, each from the same prefilled cache (the prompt through `run_chunk`), `--tokens`
greedy decode steps (next token = argmax on the device, `logp` = its log-softmax):
  engine      run_chunk per token with a FixedDepth policy (generate's eager path)
  step_eager  GraphDecoder(graph=False): the product step, eager
  graph       GraphDecoder: the step captured in a CUDA graph (at the warm pass's first step)
              and replayed per token
The generate pair: `models.reference.generate(..., FixedDepth(depth), graph=False)` vs
`graph=True` (greedy, `--tokens` new tokens, prefill included; a graph call captures its own
graph, so its capture is in the timing). Checks: tokens equal and max |delta logp| <= 1e-6 for
step_eager vs engine, graph vs step_eager and generate graph vs eager (depths too); `ok` false
and exit 1 otherwise. Timing: warm (one untimed pass of each first), then the median of
`--reps` passes, host clock around the whole loop with a device sync at both ends; ms per
decode step (B tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.trainer_gpu import SHAPES as TRAINER_SHAPES  # noqa: E402
from benchmarks.trainer_gpu import model_config  # noqa: E402
from models.engine.chunk import KVCache, run_chunk  # noqa: E402
from models.engine.graph import GraphDecoder  # noqa: E402
from models.exits import FixedDepth  # noqa: E402

_MODEL_KEYS = ("hidden", "heads", "prelude", "core", "coda", "ffn", "vocab", "backprop_depth")
SHAPES = {  # trainer_gpu.py's model shapes (the reference module in fp32), decode's own r / seq
    name: {**{k: TRAINER_SHAPES[name][k] for k in _MODEL_KEYS}, **extra}
    for name, extra in (("huginn_1b", dict(recurrence=8, seq=512)),
                        ("tiny", dict(recurrence=4, seq=64)))
}  # fmt: skip


def clone_cache(c: KVCache) -> KVCache:
    return KVCache(c.prelude.clone(), c.core.clone(), c.coda.clone(), c.filled.clone())


def restore(dst: KVCache, src: KVCache) -> None:
    for a, b in ((dst.prelude, src.prelude), (dst.core, src.core), (dst.coda, src.coda),
                 (dst.filled, src.filled)):  # fmt: skip
        a.copy_(b)


def greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax token [B], its log-prob [B]) of chunk logits [B, 1, V], on the device."""
    logp = torch.log_softmax(logits[:, 0].float(), dim=-1)
    tok = logp.argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def timed(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> tuple[float, float, Any]:
    """(warm-pass seconds, median seconds of `reps` passes after it, the last result)."""
    times, res = [], None
    for _ in range(1 + reps):
        sync()
        t0 = time.perf_counter()
        res = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:]), res


@torch.no_grad()
def step_variants(model: Any, prompt: Tensor, seeds: list[int], depth: int, mode: str, n_tok: int,
                  reps: int, cuda: bool, sync: Callable[[], None]) -> tuple[dict[str, Any], bool]:  # fmt: skip
    """engine / step_eager / graph from one prefilled cache: their timings and checks."""
    b, p0 = prompt.shape
    policy = FixedDepth(depth)
    res: dict[str, Any] = {}
    positions = [torch.full((b,), p0 + t, dtype=torch.int64) for t in range(n_tok)]  # host
    cache = KVCache.empty(model, b, p0 + n_tok + 1, depth)
    out = run_chunk(model, cache, prompt, torch.arange(p0).expand(b, p0),
                    torch.ones(b, p0, dtype=torch.bool), seeds, max_depth=depth,
                    depths=torch.full((b, p0), depth), mode=mode)  # fmt: skip
    first = greedy(out.logits[:, -1:])[0]
    base = clone_cache(cache)
    live = torch.ones(b, 1, dtype=torch.bool)

    def run_engine() -> tuple[Tensor, Tensor]:
        restore(cache, base)
        tok, toks, lps = first.clone(), [], []
        for t in range(n_tok):
            o = run_chunk(model, cache, tok[:, None], positions[t][:, None], live, seeds,
                          max_depth=depth, policy=policy, mode=mode)  # fmt: skip
            tok, lp = greedy(o.logits)
            toks.append(tok)
            lps.append(lp)
        return torch.stack(toks), torch.stack(lps)

    def run_decoder(dec: GraphDecoder) -> tuple[Tensor, Tensor]:
        restore(cache, base)  # in place: the graph keeps reading the same cache tensors
        tok, toks, lps = first.clone(), [], []
        for t in range(n_tok):
            tok, lp = greedy(dec.step(tok, positions[t]).logits)
            toks.append(tok)
            lps.append(lp)
        return torch.stack(toks), torch.stack(lps)

    variants: dict[str, tuple[Tensor, Tensor]] = {}
    ms: dict[str, float] = {}

    def bench(name: str, fn: Callable[[], tuple[Tensor, Tensor]]) -> float:
        warm_s, med_s, variants[name] = timed(fn, reps, sync)
        ms[name] = med_s / n_tok * 1e3
        res[f"{name}_ms_per_step"] = round(ms[name], 4)
        res[f"{name}_tokens_per_s"] = round(b / ms[name] * 1e3, 1)
        return warm_s

    bench("engine", run_engine)
    eager_dec = GraphDecoder(model, cache, seeds, depth=depth, mode=mode, graph=False)
    bench("step_eager", lambda: run_decoder(eager_dec))
    checks = [("step_eager", "engine")]
    if cuda:
        graph_dec = GraphDecoder(model, cache, seeds, depth=depth, mode=mode, graph=True)
        warm_s = bench("graph", lambda: run_decoder(graph_dec))
        res["graph_warm_pass_s_incl_capture"] = round(warm_s, 3)
        checks.append(("graph", "step_eager"))
    res["speedup_step_eager_vs_engine"] = round(ms["engine"] / ms["step_eager"], 3)
    if cuda:
        res["speedup_graph_vs_step_eager"] = round(ms["step_eager"] / ms["graph"], 3)
        res["speedup_graph_vs_engine"] = round(ms["engine"] / ms["graph"], 3)
    ok = True
    for x, y in checks:
        diff = float((variants[x][1] - variants[y][1]).abs().max())
        same = bool(torch.equal(variants[x][0], variants[y][0]))
        res[f"max_abs_logp_{x}_vs_{y}"], res[f"same_tokens_{x}_vs_{y}"] = diff, same
        ok = ok and diff <= 1e-6 and same
    return res, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="huginn_1b")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per variant")
    ap.add_argument("--depth", type=int, default=None, help="default: the shape's recurrence")
    ap.add_argument("--mode", choices=("fast", "exact"), default="fast")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per variant (median)")
    a = ap.parse_args()
    from models.reference import SamplingParams, build_model, generate

    s = dict(SHAPES["tiny" if a.tiny else a.shape])
    if a.tiny:
        a.batch, a.prompt, a.tokens = min(a.batch, 2), min(a.prompt, 8), min(a.tokens, 4)
    depth = a.depth or s["recurrence"]
    dev = torch.device(a.device if a.device == "cpu" or torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(model_config(s), seed=0).to(dev).eval()
    build_s = time.perf_counter() - t0
    b, p0, n_tok, mode = a.batch, a.prompt, a.tokens, a.mode
    policy = FixedDepth(depth)
    seeds = [1 + 2 * i for i in range(b)]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, s["vocab"], (b, p0), generator=gen)
    res, ok = step_variants(model, prompt, seeds, depth, mode, n_tok, a.reps, cuda, sync)
    if cuda:  # the step variants' caches and graph pool, before generate allocates its own
        torch.cuda.empty_cache()
    prompts = prompt.tolist()
    sampling = SamplingParams(greedy=True, max_new_tokens=n_tok)
    gens = {}
    for graph in (False, True):  # on the CPU graph=True runs the graph's step eagerly
        name = "generate_graph" if graph else "generate_eager"
        _, med_s, gens[graph] = timed(
            lambda g=graph: generate(model, prompts, seeds, sampling, policy, mode, graph=g),
            a.reps, sync,
        )  # fmt: skip
        res[f"{name}_tokens_per_s"] = round(b * n_tok / med_s, 1)
    res["speedup_generate_graph_vs_eager"] = round(
        res["generate_graph_tokens_per_s"] / res["generate_eager_tokens_per_s"], 3
    )
    g_diff = max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(*gens.values()))
    g_same = all(x.tokens == y.tokens and x.exit_depths == y.exit_depths
                 for x, y in zip(*gens.values()))  # fmt: skip
    res["max_abs_logp_generate_graph_vs_eager"] = g_diff
    res["same_tokens_depths_generate_graph_vs_eager"] = g_same
    ok = ok and g_diff <= 1e-6 and g_same
    print(json.dumps({
        "bench": "decode_graph", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "shape": s, "depth": depth, "mode": mode, "dtype": "fp32",
        "batch": b, "prompt": p0, "decode_steps": n_tok, "reps": a.reps,
        "build_s": round(build_s, 1), **res, "ok": ok,
    }))  # fmt: skip
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
