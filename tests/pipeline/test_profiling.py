"""pipeline.core.profiling's arithmetic: a stream's busy seconds (its intervals' union), the
seconds two or more streams ran at once, and the summary of a Chrome trace's device events."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from pipeline.config.run import load_config
from pipeline.core.profiling import at_least_two_s, host_threads, trace_summary, union_s


def test_union_counts_overlaps_once() -> None:
    assert union_s([]) == 0.0
    assert union_s([(0, 1e6)]) == pytest.approx(1.0)
    # nested, overlapping, touching and disjoint intervals (microseconds)
    ivs = [(0, 10), (2, 5), (8, 15), (15, 20), (30, 40)]
    assert union_s(ivs) == pytest.approx(30 / 1e6)


def test_two_streams_at_once() -> None:
    # stream a busy 0-10 and 20-30, b busy 5-25: both at once 5-10 and 20-25
    assert at_least_two_s({"a": [(0, 10), (20, 30)], "b": [(5, 25)]}) == pytest.approx(10e-6)
    # a stream overlapping itself is one stream
    assert at_least_two_s({"a": [(0, 10), (5, 15)]}) == 0.0
    # touching ends do not overlap
    assert at_least_two_s({"a": [(0, 10)], "b": [(10, 20)]}) == 0.0
    # three streams: seconds with >= 2 busy
    assert at_least_two_s({"a": [(0, 30)], "b": [(10, 20)], "c": [(15, 40)]}) == pytest.approx(
        20e-6
    )


def _kernel(stream: int, ts: float, dur: float, name: str = "k", cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream}}  # fmt: skip


def test_trace_summary_per_stream() -> None:
    events = [
        _kernel(7, 0, 400_000, "gemm"), _kernel(7, 500_000, 100_000, "gemm"),
        _kernel(13, 300_000, 400_000, "decode_attention"),
        _kernel(13, 800_000, 50_000, "copy", cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900_000},  # host: not counted
    ]  # fmt: skip
    s = trace_summary(events, window_s=1.0)
    assert set(s["streams"]) == {"0:7", "0:13"}
    assert s["streams"]["0:7"]["busy_s"] == pytest.approx(0.5)
    assert s["streams"]["0:13"]["busy_s"] == pytest.approx(0.45)
    assert s["streams"]["0:7"]["kernels"] == 2
    assert s["streams"]["0:7"]["top"][0] == ["gemm", pytest.approx(0.5)]
    assert s["busy_s"] == pytest.approx(0.75)  # 0-0.7 and 0.8-0.85 (the memcpy)
    assert s["overlap_s"] == pytest.approx(0.2)  # 0.3-0.4 and 0.5-0.6
    assert s["busy_fraction"] == pytest.approx(0.75) and s["overlap_fraction"] == pytest.approx(0.2)
    assert list(s["streams"])[0] == "0:7"  # the busiest stream first


def test_host_threads() -> None:
    events = [
        {"ph": "M", "name": "thread_name", "tid": 11, "args": {"name": "gen0"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 11, "ts": 0, "dur": 100_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "tid": 11, "ts": 50_000, "dur": 100_000},
        {"ph": "X", "cat": "cuda_sync", "name": "Event Sync", "tid": 11, "ts": 200_000, "dur": 300_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 22, "ts": 0, "dur": 10_000},
        _kernel(7, 0, 400_000),  # device work: not a thread's
    ]  # fmt: skip
    th = host_threads(events)
    assert list(th) == ["gen0 (11)", "22"]  # named where the trace names it; most ops first
    assert th["gen0 (11)"] == {"op_s": pytest.approx(0.15), "ops": 2, "sync_s": pytest.approx(0.3)}
    assert th["22"] == {"op_s": pytest.approx(0.01), "ops": 1, "sync_s": 0.0}
    assert trace_summary(events, window_s=1.0)["threads"] == th


@pytest.mark.parametrize("bad", ["[3, 2]", "[0, 2]", "[2]", "[1, 2, 3]"])
def test_bad_windows_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.profile_steps.*1 <= first <= last"):
        load_config(None, [f"metrics.profile_steps={bad}"])
    with pytest.raises(ConfigError, match=r"metrics\.profile_steps.*Integer"):
        load_config(None, ["metrics.profile_steps=[true, 2]"])


def test_timeline_bins_each_streams_busy_fraction() -> None:
    """summary.json's ``timeline``: per stream, the busy fraction of each 0.1 s bin from the
    first device event (overlapping kernels of one stream counted once; a kernel across a bin
    edge split between the bins)."""
    events = [
        _kernel(7, 0, 150_000, "gemm"), _kernel(7, 50_000, 50_000, "gemm"),  # inside the first
        _kernel(13, 120_000, 30_000, "decode"), _kernel(13, 250_000, 10_000, "decode"),
    ]  # fmt: skip
    s = trace_summary(events, window_s=0.3)
    assert s["bin_s"] == 0.1
    assert s["timeline"] == {"0:7": [1.0, 0.5], "0:13": [0.0, 0.3, 0.1]}
    assert trace_summary([], window_s=1.0)["timeline"] == {}


def test_op_table_ranks_device_work_then_host_ops() -> None:
    from pipeline.core.profiling import op_table

    events = [
        _kernel(7, 0, 300, "gemm"), _kernel(7, 400, 100, "gemm"),
        _kernel(13, 0, 600, "decode_attention"), _kernel(13, 700, 50, "copy", cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 2_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 10},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},  # not a span: left out
    ]  # fmt: skip
    lines = op_table(events).splitlines()
    assert lines[0] == "device (kernels, copies, sets): 0.001 s in all"
    body = [ln.split() for ln in lines[2:5]]
    # by total: the attention (600 us), the two gemms (400 us, mean 200), the copy (50 us)
    assert [r[-1] for r in body] == ["decode_attention", "gemm", "copy"]
    assert body[1][:4] == ["0.400", "38.10", "2", "200.00"]
    host = lines.index("host (torch ops, inclusive): 0.002 s in all")
    assert lines[host + 2].split()[-1] == "aten::mm" and lines[host + 3].split()[-1] == "aten::add"
    assert "instant" not in op_table(events)
    assert op_table([]) == ""


def test_repeat_view_lists_a_layer_pass_kernel_by_kernel() -> None:
    """Six layer passes of (attention 100 us, norm 5, gemm 20) on stream 7, the fourth
    followed by a step's end (head 50, sample 30) after an idle 8 us; a busier-by-count but
    lighter stream 9 is not the one shown."""
    from pipeline.core.profiling import repeat_view

    events, t = [], 0.0
    for i in range(6):
        for name, dur, idle in (("attention", 100, 0), ("norm", 5, 1), ("gemm", 20, 0)):
            t += idle
            events.append(_kernel(7, t, dur, name))
            t += dur
        if i == 3:
            events += [_kernel(7, t + 8, 50, "head"), _kernel(7, t + 58, 30, "sample")]
            t += 88
    events += [_kernel(9, 5.0 * j, 1, "tiny") for j in range(40)]
    text = repeat_view(events)
    mid, longest = text.split("\n\n")[:2]
    head = mid.splitlines()
    assert head[0] == "the middle repeat of attention on stream 0:7: 3 kernels, 126.0 us"
    assert [ln.split()[-1] for ln in head[2:]] == ["attention", "norm", "gemm"]
    assert head[3].split()[:3] == ["101.0", "5.00", "1.00"]  # at, dur, idle before it
    rows = longest.splitlines()
    assert rows[0].startswith("the longest repeat of the middle half of attention")
    assert "5 kernels, 214.0 us" in rows[0]
    assert [ln.split()[-1] for ln in rows[2:]] == ["attention", "norm", "gemm", "head", "sample"]
    assert rows[5].split()[2] == "8.00"  # the idle gap before the head
    assert repeat_view(events[:6]) == ""  # the top kernel twice: no repeat to show
    assert repeat_view([]) == ""


def test_a_window_is_written_off_the_steps_thread(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The steps' thread stops the profiler and goes on; the files come from a thread of their
    own, and ``close`` returns once they are written."""
    import json
    import threading

    import torch

    from pipeline.core.profiling import StepProfiler

    prof = StepProfiler([1, 1], tmp_path / "p", unit="batches")
    prof.observe(0)  # opens before batch 1
    x = torch.randn(32, 32)
    for _ in range(200):
        x = torch.tanh(x @ x)
    prof.observe(1)  # closes: the writer runs on
    writer = prof._writer
    assert writer is not None and writer is not threading.current_thread()
    prof.close()
    assert not writer.is_alive()
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary["batches"] == [1, 1] and summary == prof.summary
    table = (tmp_path / "p" / "kernels.txt").read_text()
    assert "aten::mm" in table and table.startswith("host (torch ops, inclusive)")
    assert (tmp_path / "p" / "trace.json.gz").exists() and not (
        tmp_path / "p" / "trace.json"
    ).exists()
