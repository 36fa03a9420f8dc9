"""A run's own steps under torch.profiler (``metrics.profile_steps: [first, last]``).

The figures a benchmark of one part gives do not say where a whole run's step goes (two parts
on one card take turns, wait for each other's host threads, or run at once). So the learner
process profiles its own steps ``first``..``last`` (the rows of those steps: started when step
``first - 1``'s row is logged, or before the first step, and stopped when step ``last``'s is)
and writes ``RUN_DIR/profile/``:

- ``trace.json.gz``: the Chrome trace (chrome://tracing, Perfetto): host ops of the learner
  process and every CUDA kernel and copy the process ran, on every stream;
- ``kernels.txt``: the window's kernels and copies by device time, then its host ops
  (``op_table``), then the kernels between two launches of the top kernel in time order
  (``repeat_view``: a decode's layer pass, kernel by kernel, by full name);
- ``summary.json``: ``window_s`` (wall seconds profiled), ``steps``, per CUDA stream its busy
  seconds (the union of its kernels' and copies' intervals), kernel count and top kernels by
  time, ``busy_s`` (the union over streams: the card doing anything), ``overlap_s`` (seconds
  during which two or more streams ran at once) and ``busy_fraction`` / ``overlap_fraction`` of
  the window; ``timeline``: per stream, the busy fraction of each ``BIN_S`` bin from the first
  device event (who had the card when: the decode beside the training, or after it);
  ``threads``: per host thread, its seconds in torch ops and waiting for the card.

A generator in a process of its own (``generators.placement=process``) is another process: its
kernels are not in this trace (its own time is the rows' ``time/generation``); with
``generators.placement=thread`` the engine runs in this process on a stream of its own, so the
trace holds both sides, and ``overlap_s`` says whether the decode and the training ran at once.
On a CPU host the trace holds host ops only (no streams). What profiling costs (the profiler's
own overhead, a large trace: keep the window to a step or two) is the window's, not the
other steps'.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of device work (torch.profiler's Kineto export)."""
BIN_S = 0.1
"""The width of ``summary.json``'s ``timeline`` bins (seconds)."""


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by ``intervals`` (start, end) in microseconds, overlaps counted once."""
    return sum(b - a for a, b in _merged(intervals)) / 1e6


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` (start, end) sorted, overlapping ones joined."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def at_least_two_s(per_stream: dict[Any, list[tuple[float, float]]]) -> float:
    """Seconds during which two or more of the streams were busy (each stream's own intervals
    merged first, so a stream overlapping itself does not count)."""
    edges: list[tuple[float, int]] = []
    for ivs in per_stream.values():
        for a, b in _merged(ivs):
            edges += [(a, 1), (b, -1)]
    edges.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    total, depth, last = 0.0, 0, 0.0
    for t, step in edges:
        if depth >= 2:
            total += t - last
        depth += step
        last = t
    return total / 1e6


def _device_work(events: list[dict[str, Any]]) -> Iterable[tuple[str, dict[str, Any]]]:
    """The trace's device spans (kernels, copies, sets), each with its stream's key
    ("device:stream")."""
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            args = e.get("args") or {}
            yield f"{args.get('device', 0)}:{args.get('stream', e.get('tid', '?'))}", e


def trace_summary(events: list[dict[str, Any]], window_s: float, top: int = 8) -> dict[str, Any]:
    """``summary.json``'s figures (module doc) from a Chrome trace's ``traceEvents``."""
    per_stream: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, dict[str, float]] = {}
    for key, e in _device_work(events):
        a = float(e["ts"])
        b = a + float(e.get("dur", 0.0))
        per_stream.setdefault(key, []).append((a, b))
        by_name = names.setdefault(key, {})
        by_name[e.get("name", "?")] = by_name.get(e.get("name", "?"), 0.0) + (b - a) / 1e6
    busy_of = {key: union_s(ivs) for key, ivs in per_stream.items()}
    streams = {}
    for key in sorted(per_stream, key=lambda k: -busy_of[k]):  # the busiest stream first
        ranked = sorted(names[key].items(), key=lambda kv: -kv[1])[:top]
        streams[key] = {"busy_s": busy_of[key], "kernels": len(per_stream[key]),
                        "top": [[name[:120], round(s, 6)] for name, s in ranked]}  # fmt: skip
    busy = union_s(iv for ivs in per_stream.values() for iv in ivs)
    overlap = at_least_two_s(per_stream)
    w = max(window_s, 1e-9)
    return {"window_s": window_s, "busy_s": busy, "overlap_s": overlap,
            "busy_fraction": busy / w, "overlap_fraction": overlap / w, "streams": streams,
            "bin_s": BIN_S, "timeline": timeline(per_stream), "threads": host_threads(events)}  # fmt: skip


def timeline(per_stream: dict[str, list[tuple[float, float]]],
             bin_s: float = BIN_S) -> dict[str, list[float]]:  # fmt: skip
    """Per stream, the fraction of each ``bin_s`` bin (from the first device event of any
    stream) its merged intervals (microseconds) cover, rounded to 0.01."""
    if not per_stream:
        return {}
    t0 = min(a for ivs in per_stream.values() for a, _ in ivs)
    width = bin_s * 1e6
    out = {}
    for key, ivs in per_stream.items():
        bins = [0.0] * (int((max(b for _, b in ivs) - t0) // width) + 1)
        for a, b in _merged(ivs):
            while a < b:
                i = int((a - t0) // width)
                end = min(b, t0 + (i + 1) * width)
                bins[i] += end - a
                a = end
        out[key] = [round(x / width, 2) for x in bins]
    return out


def host_threads(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per host thread of the trace (its name where the trace names it, else its id): the
    seconds it spent in torch ops (``op_s``: the union of its ``cpu_op`` intervals), its op
    count, and the seconds it waited for the card (``sync_s``: its ``cuda_sync`` intervals).
    A generator thread whose ops are few and short while its stream idles was waiting for the
    interpreter, not the card."""
    named = {str(e.get("tid")): str((e.get("args") or {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    ops: dict[str, list[tuple[float, float]]] = {}
    syncs: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "cuda_sync"):
            continue
        a = float(e["ts"])
        into = ops if e["cat"] == "cpu_op" else syncs
        into.setdefault(str(e.get("tid", "?")), []).append((a, a + float(e.get("dur", 0.0))))
    out = {}
    for tid in sorted(set(ops) | set(syncs), key=lambda t: -len(ops.get(t, []))):
        label = f"{named[tid]} ({tid})" if named.get(tid) else tid
        out[label] = {"op_s": union_s(ops.get(tid, [])), "ops": len(ops.get(tid, [])),
                      "sync_s": union_s(syncs.get(tid, []))}  # fmt: skip
    return out


def op_table(events: list[dict[str, Any]], rows: int = 60) -> str:
    """``kernels.txt``: the trace's device work (kernels, copies, sets) by total time, then its
    host ops (``cpu_op``, inclusive time), each name with its calls, total and mean; from the
    exported events in one pass (torch.profiler's own table took 36 s at 550,000 events, the
    process's thread stopped meanwhile; this 0.3 s: benchmarks/profile_write.py)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or (cat not in DEVICE_CATS and cat != "cpu_op"):
            continue
        kind = "host" if cat == "cpu_op" else "device"
        g = groups.setdefault((kind, str(e.get("name", "?"))), [0.0, 0.0])
        g[0] += 1
        g[1] += float(e.get("dur", 0.0))
    lines = []
    for kind in ("device", "host"):
        ranked = sorted(((n, c, t) for (k, n), (c, t) in groups.items() if k == kind),
                        key=lambda r: -r[2])[:rows]  # fmt: skip
        if not ranked:
            continue
        total = sum(t for (k, _), (_, t) in groups.items() if k == kind)
        lines.append(f"{kind} ({'kernels, copies, sets' if kind == 'device' else 'torch ops, inclusive'})"
                     f": {total / 1e6:.3f} s in all")  # fmt: skip
        lines.append(f"{'total ms':>12} {'%':>6} {'calls':>9} {'mean us':>10}  name")
        for name, calls, t in ranked:
            lines.append(f"{t / 1e3:12.3f} {100 * t / max(total, 1e-9):6.2f} {int(calls):9d} "
                         f"{t / calls:10.2f}  {name[:160]}")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def repeat_view(events: list[dict[str, Any]], rows: int = 80) -> str:
    """``kernels.txt``'s last part: what the device ran between two launches of its top kernel
    (by total time, on its busiest stream), kernel by kernel in time order: the middle such
    repeat (a decode's layer pass between two attention calls: which kernels a pass costs, by
    full name) and the longest one in the middle half of the window (the pass that also holds
    a step's end: head, sampling, ...). Each line: start offset, duration and the idle gap
    before it, in microseconds. Empty when the top kernel ran fewer than 3 times."""
    per_stream: dict[str, list[dict[str, Any]]] = {}
    for key, e in _device_work(events):
        per_stream.setdefault(key, []).append(e)
    if not per_stream:
        return ""
    key = max(per_stream, key=lambda k: sum(float(e.get("dur", 0.0)) for e in per_stream[k]))
    work = sorted(per_stream[key], key=lambda e: float(e["ts"]))
    total: dict[str, float] = {}
    for e in work:
        name = str(e.get("name", "?"))
        total[name] = total.get(name, 0.0) + float(e.get("dur", 0.0))
    top = max(total, key=lambda n: total[n])
    at = [i for i, e in enumerate(work) if str(e.get("name", "?")) == top]
    if len(at) < 3:
        return ""
    mid = len(at) // 2
    pairs = list(zip(at[len(at) // 4 : 3 * len(at) // 4], at[len(at) // 4 + 1 :], strict=False))
    longest = max(pairs, key=lambda p: float(work[p[1]]["ts"]) - float(work[p[0]]["ts"]))
    out = []
    for title, (a, b) in (("the middle repeat", (at[mid - 1], at[mid])),
                          ("the longest repeat of the middle half", longest)):  # fmt: skip
        t0 = float(work[a]["ts"])
        span = float(work[b]["ts"]) - t0
        out.append(f"{title} of {top[:80]} on stream {key}: {b - a} kernels, {span:.1f} us")
        out.append(f"{'at us':>10} {'dur us':>9} {'idle us':>8}  name")
        end = t0
        for e in work[a:b][:rows]:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            out.append(f"{ts - t0:10.1f} {dur:9.2f} {max(0.0, ts - end):8.2f}  "
                       f"{str(e.get('name', '?'))[:200]}")  # fmt: skip
            end = max(end, ts + dur)
        if b - a > rows:
            out.append(f"... {b - a - rows} more")
        out.append("")
    return "\n".join(out)


def _all_threads() -> Any:
    """Kineto's options for a process of several threads (the trainer's, a generator thread's):
    host ops of every thread, and CUDA's synchronizations (a thread waiting for the card); None
    where this torch has no such options."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except (ImportError, TypeError):
        return None


class StepProfiler:
    """Profiles the steps ``first``..``last`` of a run into ``out`` (module doc); ``observe``
    is called with the steps done before the first (0 for a fresh run, a resume's step) and
    with each logged step number."""

    def __init__(self, steps: list[int], out: Path, unit: str = "steps") -> None:
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.out = out
        self.unit = unit
        """What is counted: ``steps`` (the learner's), ``batches`` (a generator's engine
        batches); the summary's key for the window."""
        self._prof: Any = None
        self._writer: threading.Thread | None = None
        self._t0 = 0.0
        self.summary: dict[str, Any] | None = None

    @property
    def on(self) -> bool:
        return self.first >= 1

    def observe(self, step: int) -> None:
        """``step`` steps are done: open the window after ``first - 1``, close after ``last``
        (exporting the trace, the table and the summary)."""
        if not self.on:
            return
        if self._prof is None and step == self.first - 1:
            self._start()
        elif self._prof is not None and step >= self.last:
            self._stop()

    def close(self) -> None:
        """The run ends: a window still open is closed, and the files are written before this
        returns."""
        if self._prof is not None:
            self._stop()
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, experimental_config=_all_threads())
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        log.info("profile: %s %d..%d under torch.profiler", self.unit, self.first, self.last)

    def _stop(self) -> None:
        """Stop the profiler (on the thread that runs the steps: torch's stop), then write the
        files on a thread of their own so the steps go on (a learner that stops answering for
        the seconds a large trace takes to export looks gone to its generators); ``close``
        waits for it."""
        prof, self._prof = self._prof, None
        window = time.perf_counter() - self._t0
        prof.__exit__(None, None, None)
        self._writer = threading.Thread(target=self._write, args=(prof, window),
                                        name="profile-writer", daemon=True)  # fmt: skip
        self._writer.start()

    def _write(self, prof: Any, window: float) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            raw = self.out / "trace.json"
            prof.export_chrome_trace(str(raw))
            events = json.loads(raw.read_text()).get("traceEvents", [])
            with raw.open("rb") as src, gzip.open(self.out / "trace.json.gz", "wb") as dst:
                dst.write(src.read())
            raw.unlink()
            (self.out / "kernels.txt").write_text(op_table(events) + "\n" + repeat_view(events))
            summary = {self.unit: [self.first, self.last], **trace_summary(events, window)}
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            self.summary = summary
            log.info("profile: %.2f s profiled, card busy %.2f s, two streams at once %.2f s: "
                     "%s", window, summary["busy_s"], summary["overlap_s"], self.out)  # fmt: skip
        except Exception:  # a profile that cannot be written does not stop the run
            log.exception("profile: writing %s failed", self.out)


__all__ = [
    "StepProfiler",
    "at_least_two_s",
    "host_threads",
    "op_table",
    "repeat_view",
    "trace_summary",
    "union_s",
]
