"""The torch generator engine at adaptive exit depths, end to end: what a generated
token costs at a mean exit depth of ~D/2 and ~D/4 against the fixed depth D, decoding one chunk
per token (`TorchEngine(ticks=0)`: the deepest row sets every row's iterations, depth batching
computes only the running rows) or by ticks (`ticks=k`: every row at its own iteration of its
own token, exited rows read out every k ticks; generator/torch_engine/ticks.py; on CUDA at one shape,
k ticks per CUDA graph replay: models/engine/tickgraph.py, `tick_graph` in the rows). One JSON
line.

    python benchmarks/torch_depth.py --device cuda --batch 256 --depth 16 --ticks 1,4   # a GPU
    python benchmarks/torch_depth.py --device cpu --tiny                               # a smoke run

What runs: an Ouro module (random weights, std 0.02; `--hidden --layers --heads --ffn --vocab`,
looped `--depth` times; `--tiny`: hidden 64, 2 layers) in `--dtype` on `--device`,
`TorchEngine.generate` of `--batch` requests (x `--queue`: more requests than slots, freed
slots refilled) (greedy; `--temperature T`: sampled, the draw on
the device) of `--prompt` random tokens and `--tokens`
new tokens, max_num_seqs = batch (every request in the cache at once at --queue 1): the call,
prefill, decode, host sampling and records included. Exits: SampledGate(max_depth D, kv
last_exited) with the exit gate set to a constant (weight 0, bias b: every token exits after
each iteration with probability sigmoid(b), drawn from its latent seed's exit uniform), b solved
for a mean exit depth of D/2 (`half`) and D/4 (`quarter`), b = -30 (`gate_fixed`: every token
runs D iterations through the exit loop); `fixed` = an engine under FixedDepth(D) (on a GPU its
CUDA-graph decode, the torch engine's fixed-depth path; `fixed_eager`: the same without the
graph). Timing: a warm call of every configuration, then `--reps` rounds over all of them
(interleaved), the median per configuration, device-synchronised. The decode time per generated
token = (a call of `--tokens` new tokens - a call of 1) / (batch x (tokens - 1)): the prefill
(the prompt at full depth, whatever the exits) and the call's fixed costs cancel;
`vs_fixed` = that / the fastest fixed-depth configuration's; `s_per_call` / `tokens_per_s`: the
whole call of `--tokens`; `mean_depth` from the records (every row's exits: the same in every
path, checked: `same_as_chunk`); `depth_sum_max_over_mean`: the deepest request's summed decode
depths over the mean request's (a one-batch call lasts as long as its longest row's ticks).
`--profile fixed,half:chunk`: after the timing, one call of each named configuration with the
engine's stages timed (prefill, decode, graph step, sampling, the ticker's; a device sync around
each) and one under torch.profiler (top ops by host and by device time), under
`profiles` in the JSON line. `--readout-rows 128`: each tick row again as `name:ticksKr128`,
the tick graph's readout (head, draw) on at most 128 rows a step (`GraphTicker`'s readout_rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.depth_batching import random_weights  # noqa: E402
from benchmarks.depth_batching_plugin import gate_bias  # noqa: E402


def add_shape_args(ap: argparse.ArgumentParser, batch: int) -> None:
    """The module's shape flags `build` reads (and the batch / prompt), shared with
    benchmarks/depth_graphs.py."""
    ap.add_argument("--tiny", action="store_true", help="a smoke run's shape (CPU tests)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--prompt", type=int, default=16)


def build(a: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> Any:
    """The Ouro module at the flags' shape, random weights on ``dev`` (norms 1)."""
    from models.config import OuroConfig
    from models.ouro import OuroForCausalLM

    h, layers, heads, ffn, vocab = ((64, 2, 2, 128, 512) if a.tiny else
                                    (a.hidden, a.layers, a.heads, a.ffn, a.vocab))  # fmt: skip
    cfg = OuroConfig.from_hf_dict(dict(
        model_type="ouro", vocab_size=vocab, hidden_size=h, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=h // heads, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, total_ut_steps=a.depth, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ))  # fmt: skip
    with torch.device(dev):
        model = OuroForCausalLM(cfg)
    return random_weights(model, dev, dtype)


STAGES = ("_prefill", "_decode", "_sample_block", "_feed")
"""TorchEngine methods a profile times (device-synchronised around each call; the fixed-depth
graph path's steps run in generator.torch_engine.ahead, one step ahead of the host, and are
not timed apart: a sync around them would undo what they overlap)."""


def _tick_stages() -> list[tuple[type, str]]:
    from models.engine.tickgraph import GraphTicker
    from models.engine.ticks import Ticker

    return [(GraphTicker, "advance"), (GraphTicker, "feed"), (GraphTicker, "_replay"),
            (Ticker, "_read_out"), (Ticker, "_start")]  # fmt: skip


def profile(call: Any, eng: Any, sync: Any) -> dict[str, Any]:
    """Where one `generate` call's time goes: (1) the engine's stages (STAGES) timed with a
    device sync around each call, beside the whole call; (2) the same call under torch.profiler:
    the top ops by host (self CPU) time and by device time, and the device's busy seconds."""
    spent: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    for name in STAGES:
        setattr(eng, name, timed(name, getattr(eng, name)))
    patched = [(cls, name, cls.__dict__[name]) for cls, name in _tick_stages()]
    for cls, name, fn in patched:  # the ticker's stages (nested: advance holds the others)
        setattr(cls, name, timed(f"{cls.__name__}.{name}", fn))
    try:
        t0 = time.perf_counter()
        call()
        whole = time.perf_counter() - t0
    finally:
        for name in STAGES:
            delattr(eng, name)  # the class's methods again
        for cls, name, fn in patched:
            setattr(cls, name, fn)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        call()
    ev = prof.key_averages()
    dev_us = [(e.key, float(getattr(e, "self_device_time_total", 0.0) or 0.0)) for e in ev]
    top_host = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "call_s": round(whole, 4),
        "stages_s": {k: round(v, 4) for k, v in sorted(spent.items())},
        "device_busy_s": round(sum(us for _, us in dev_us) / 1e6, 4),
        "top_host_ms": [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top_host],
        "top_device_ms": [
            (k, round(us / 1e3, 2)) for k, us in sorted(dev_us, key=lambda x: -x[1])[:10]
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    add_shape_args(ap, batch=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ticks", default="1,4", help="readout_every values of the tick rows")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests")
    ap.add_argument(
        "--profile",
        default="",
        help="configs (e.g. fixed,half:chunk) to profile "
        "after the timing: one call each, the engine's stages timed, then torch.profiler",
    )
    ap.add_argument("--schedules", default="gate_fixed,half,quarter")
    ap.add_argument(
        "--queue",
        type=int,
        default=1,
        help="requests = queue x batch in batch slots: freed slots take the next request",
    )
    ap.add_argument(
        "--readout-rows",
        default="",
        help="values n: each tick row again with the tick graph's readout on at most n rows a "
        "step (config suffix rN)",
    )
    ap.add_argument(
        "--skip-eager",
        action="store_true",
        help="no fixed_eager row (the fixed depth without its CUDA graph)",
    )
    ap.add_argument(
        "--skip-chunk",
        action="store_true",
        help="no chunk-decode rows (slow on a GPU; same_as_chunk then null)",
    )
    a = ap.parse_args()
    if a.depth < 2 or a.batch < 1 or a.tokens < 2 or a.queue < 1:
        raise SystemExit("--depth >= 2, --batch >= 1, --tokens >= 2 and --queue >= 1 are needed")
    ticks = [int(k) for k in a.ticks.split(",") if k]
    if any(k < 1 for k in ticks):
        raise SystemExit(f"--ticks: values >= 1, got {a.ticks!r}")
    readout = [int(n) for n in a.readout_rows.split(",") if n]
    if any(not 1 <= n <= a.batch for n in readout):
        raise SystemExit(f"--readout-rows: values in [1, --batch], got {a.readout_rows!r}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" \
        else torch.device(a.device)  # fmt: skip
    dtype = torch.bfloat16 if (a.dtype == "bfloat16" or (a.dtype == "auto" and dev.type == "cuda")) \
        else torch.float32  # fmt: skip
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from generator.torch_engine.engine import TorchEngine
    from models.exits import FixedDepth, SampledGate
    from proto.records import WorkItem

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build(a, dev, dtype)
    build_s = time.perf_counter() - t0
    vocab = int(model.vocab_size)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=gen).numpy().astype(np.int32)
               for _ in range(a.batch * a.queue)]  # fmt: skip

    def items_of(n_new: int) -> list[Any]:
        return [WorkItem(work_id=f"w{i}", prompt_id=str(i), prompt_tokens=p,
                         latent_seeds=np.asarray([i + 1], dtype=np.uint64),
                         temperature=a.temperature,
                         max_tokens=n_new) for i, p in enumerate(prompts)]  # fmt: skip

    calls = {a.tokens: items_of(a.tokens), 1: items_of(1)}  # decode = the difference
    gate_w, gate_b = model.model.early_exit_gate.weight, model.model.early_exit_gate.bias
    base = dict(numerics="fast", model=model, max_num_seqs=a.batch, device=str(dev))
    engines: dict[str, tuple[Any, float | None]] = {
        "fixed": (TorchEngine(None, exit_policy=FixedDepth(a.depth), **base), None),  # type: ignore[arg-type]
    }
    if cuda and not a.skip_eager:  # the graph decode is the fixed path on a GPU; eager beside
        engines["fixed_eager"] = (TorchEngine(None, exit_policy=FixedDepth(a.depth), graph=False,
                                              **base), None)  # type: ignore[arg-type]  # fmt: skip
    biases = {"gate_fixed": -30.0, "half": gate_bias(a.depth, a.depth / 2),
              "quarter": gate_bias(a.depth, a.depth / 4)}  # fmt: skip
    sampled = SampledGate(max_depth=a.depth, kv="last_exited")
    for name in a.schedules.split(","):
        for k in ([] if a.skip_chunk else [0]) + ticks:
            eng = TorchEngine(None, exit_policy=sampled, ticks=k, **base)  # type: ignore[arg-type]
            engines[f"{name}:{'chunk' if k == 0 else f'ticks{k}'}"] = (eng, biases[name])
            for n in readout if k else []:  # the compacted readout (the tick graph's)
                eng = TorchEngine(None, exit_policy=sampled, ticks=k, tick_graph=True,  # type: ignore[arg-type]
                                  readout_rows=n, **base)  # fmt: skip
                engines[f"{name}:ticks{k}r{n}"] = (eng, biases[name])

    def run(key: str, n_new: int) -> list[Any]:
        eng, bias = engines[key]
        if bias is not None:  # the gate constant: every token's exit chance sigmoid(bias)
            with torch.no_grad():
                gate_w.zero_()
                gate_b.fill_(bias)
        out = eng.generate(calls[n_new])
        sync()
        return out

    records: dict[str, list[Any]] = {}
    first: dict[str, float] = {}
    for key in engines:  # warm: graph capture, first shapes
        t = time.perf_counter()
        records[key] = run(key, a.tokens)
        first[key] = time.perf_counter() - t
        run(key, 1)
        print(f"warm {key}: {first[key]:.3f} s", file=sys.stderr, flush=True)
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in engines for n in calls}
    for r in range(a.reps):
        for key in engines:
            for n_new in calls:
                t = time.perf_counter()
                run(key, n_new)
                times[(key, n_new)].append(time.perf_counter() - t)
                print(f"round {r + 1} {key} {n_new} tokens: {times[(key, n_new)][-1]:.3f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    whole = {k: statistics.median(times[(k, a.tokens)]) for k in engines}
    n_req = a.batch * a.queue
    dec = {k: max(1e-9, (whole[k] - statistics.median(times[(k, 1)])) / (n_req * (a.tokens - 1)))
           for k in engines}  # fmt: skip
    best_fixed = min(v for k, v in dec.items() if k.startswith("fixed"))
    profiles = {key: profile(lambda key=key: run(key, a.tokens), engines[key][0], sync)
                for key in a.profile.split(",") if key}  # fmt: skip
    n = n_req * a.tokens
    rows = []
    for key in engines:
        depths = np.concatenate([s[0].exit_depths[1:] for s in records[key]]).astype(float)
        # the batch's tail: the deepest request's summed decode depths over the mean request's
        # (a call of one batch lasts as long as its longest row's ticks; 1.0 at a fixed depth)
        sums = np.asarray([float(s[0].exit_depths[1:].sum()) for s in records[key]])
        tail = round(float(sums.max() / sums.mean()), 3) if sums.size and sums.mean() else None
        name = key.split(":")[0]
        chunk = records.get(f"{name}:chunk")
        same = None
        if chunk is not None and ":" in key:
            same = all(x[0].tokens.tolist() == y[0].tokens.tolist()
                       and x[0].exit_depths.tolist() == y[0].exit_depths.tolist()
                       for x, y in zip(records[key], chunk, strict=True))  # fmt: skip
        rows.append(dict(config=key, decode_ms_per_token=round(dec[key] * 1e3, 4),
                         vs_fixed=round(dec[key] / best_fixed, 3), s_per_call=round(whole[key], 4),
                         tokens_per_s=round(n / whole[key], 1),
                         mean_depth=round(float(depths.mean()), 2) if depths.size else None,
                         depth_sum_max_over_mean=tail,
                         first_call_s=round(first[key], 2), same_as_chunk=same,
                         tick_graph=bool(getattr(engines[key][0], "tick_graph", False)),
                         readout_rows=getattr(engines[key][0], "readout_rows", None)))  # fmt: skip
    print(json.dumps(dict(
        bench="torch_depth", device=str(torch.cuda.get_device_name() if cuda else "cpu"),
        dtype=str(dtype).replace("torch.", ""), tiny=a.tiny, depth=a.depth, batch=a.batch,
        queue=a.queue,
        prompt=a.prompt, tokens=a.tokens, temperature=a.temperature, reps=a.reps,
        build_s=round(build_s, 1),
        params=sum(p.numel() for p in model.parameters()), rows=rows, profiles=profiles,
        command=" ".join(sys.argv),
    )), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
