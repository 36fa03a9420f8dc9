"""What writing a profile costs, by part: torch.profiler's stop, the Chrome trace's export and
load, torch's own op table (``key_averages().table``, what kernels.txt was) and
pipeline.core.profiling's ``op_table`` over the exported events (what it is). A loop of small
matmuls under the profiler gives ~11 events an iteration. One JSON line.

    python benchmarks/profile_write.py                  # ~500,000 events
    python benchmarks/profile_write.py --iters 5000     # a quick look
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pipeline.core.profiling import op_table


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50_000, help="profiled loop iterations")
    a = ap.parse_args()
    x = torch.randn(64, 64)
    prof = profile(activities=[ProfilerActivity.CPU])
    prof.__enter__()
    for _ in range(a.iters):
        x = torch.tanh(x @ x * 0.01)
    t = [time.perf_counter()]
    prof.__exit__(None, None, None)
    t.append(time.perf_counter())
    with tempfile.TemporaryDirectory() as d:
        raw = Path(d) / "trace.json"
        prof.export_chrome_trace(str(raw))
        t.append(time.perf_counter())
        events = json.loads(raw.read_text()).get("traceEvents", [])
        t.append(time.perf_counter())
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
    t.append(time.perf_counter())
    op_table(events)
    t.append(time.perf_counter())
    parts = ["stop_s", "export_s", "load_s", "torch_table_s", "op_table_s"]
    res = {"bench": "profile_write", "iters": a.iters, "events": len(events),
           **{k: round(t[i + 1] - t[i], 3) for i, k in enumerate(parts)}}  # fmt: skip
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
