"""Where one call's time goes on the GPU: a torch.profiler trace reduced to a few numbers.

    from benchmarks.step_profile import profile_call
    summary = profile_call(lambda: trainer.step(batch), out_dir)   # JSON-able dict

`profile_call` runs `fn` once under torch.profiler (CPU + CUDA activities, no stacks), then
from the Chrome trace: wall time, GPU busy time (the union of kernel / memcpy / memset
intervals), the idle gaps between them (the largest, each with the CPU ops that ran inside it),
device syncs (`aten::_local_scalar_dense`: `.item()` / `float()` / `bool()` of a device
tensor; `cudaStreamSynchronize` / `cudaDeviceSynchronize` calls), and the top kernels by total
time with a coarse category each. A second call with `torch.cuda.set_sync_debug_mode("warn")`
lists the Python lines that synchronised. Writes `<out_dir>/<label>_kernels.txt` (the
profiler's table) and returns the summary.
"""

from __future__ import annotations

import collections
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CATEGORIES = (  # (category, substrings of the kernel name), first match wins
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm", "norm_kernel")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "wgmma")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("triton", ("triton",)),
    ("index/scatter", ("index", "scatter", "gather", "nonzero", "masked")),
    ("copy/cast", ("copy", "memcpy", "cast", "fill", "memset")),
    ("elementwise", ("elementwise", "vectorized", "reduce")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """(total covered length, the gaps between covered stretches) of [start, end) intervals."""
    busy, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None:
            busy, end = e - s, e
        elif s > end:
            gaps.append((end, s))
            busy, end = busy + e - s, e
        elif e > end:
            busy, end = busy + e - end, e
    return busy, gaps


def summarize(trace: dict[str, Any], top: int = 25, n_gaps: int = 12) -> dict[str, Any]:
    """The summary of a Chrome trace (times in ms)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in GPU_CATS]
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    if not gpu:
        return {"error": "no GPU events"}
    t0 = min(float(e["ts"]) for e in ev)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in ev)
    busy, gaps = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
    g0 = min(float(e["ts"]) for e in gpu)
    g1 = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    big = sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:n_gaps]
    gap_rows = []
    for s, e in sorted(big):
        inside = collections.Counter()
        for c in cpu:
            cs, ce = float(c["ts"]), float(c["ts"]) + float(c.get("dur", 0))
            overlap = min(ce, e) - max(cs, s)
            if overlap > 0:
                inside[c["name"]] += overlap
        gap_rows.append({
            "at_ms": round((s - t0) / 1e3, 2), "gap_ms": round((e - s) / 1e3, 3),
            "cpu_ops": [f"{n} {v / 1e3:.2f}" for n, v in inside.most_common(6)],
        })  # fmt: skip
    per_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    per_cat: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        name = e["name"] if e.get("cat") == "kernel" else e.get("cat", "")
        per_kernel[name][0] += float(e["dur"])
        per_kernel[name][1] += 1
        per_cat[_category(name)] += float(e["dur"])
    kernels = sorted(per_kernel.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    names = collections.Counter(c["name"] for c in cpu)
    gap_hist = {
        f">{lo}ms": round(sum(e - s for s, e in gaps if e - s > lo * 1e3) / 1e3, 2)
        for lo in (0.05, 0.2, 1.0)
    }
    return {
        "wall_ms": round((t1 - t0) / 1e3, 2),
        "gpu_span_ms": round((g1 - g0) / 1e3, 2),
        "gpu_busy_ms": round(busy / 1e3, 2),
        "gpu_idle_in_span_ms": round((g1 - g0 - busy) / 1e3, 2),
        "idle_before_first_kernel_ms": round((g0 - t0) / 1e3, 2),
        "idle_after_last_kernel_ms": round((t1 - g1) / 1e3, 2),
        "idle_in_gaps_longer_than": gap_hist,
        "n_gpu_events": len(gpu),
        "syncs_item": names.get("aten::_local_scalar_dense", 0),
        "syncs_stream": names.get("cudaStreamSynchronize", 0),
        "syncs_device": names.get("cudaDeviceSynchronize", 0),
        "by_category_ms": {k: round(v / 1e3, 2) for k, v in sorted(per_cat.items(),
                                                                     key=lambda kv: -kv[1])},
        "top_kernels": [f"{v[0] / 1e3:8.2f} ms {v[1]:5d}x  {_category(k):13s} {k[:110]}"
                        for k, v in kernels],
        "largest_gaps": gap_rows,
    }  # fmt: skip


def sync_sites(fn: Callable[[], Any], top: int = 20) -> list[str]:
    """Python lines (file:line, count) that synchronised with the device during `fn()`."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return [f"{n}x {site}" for site, n in sites.most_common(top)]


def profile_call(fn: Callable[[], Any], out_dir: str | Path, label: str = "step") -> dict:
    """Profile one `fn()` (see the module docstring); writes the kernel table to out_dir."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    (out / f"{label}_kernels.txt").write_text(
        prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60), "utf-8"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text("utf-8"))
    summary = summarize(trace)
    summary["sync_sites"] = sync_sites(fn)
    return summary
