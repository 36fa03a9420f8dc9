"""Smoke test of benchmarks/parity.py: JSON lines, and a clear error for unknown pairs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("parity_bench", ROOT / "benchmarks/parity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["parity_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_parity_lines(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    assert (
        bench.main(["--families", "huginn,llama", "--max-new-tokens", "4", "--prompts", "2"]) == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["family"], x["mode"]) for x in lines] == [
        ("huginn", "exact"),
        ("huginn", "fast"),
        ("llama", "exact"),
        ("llama", "fast"),
    ]
    for x in lines:
        assert x["pair"] == "reference" and x["tokens"] == 8
        assert x["max_abs_logprob_diff"] <= (1e-6 if x["mode"] == "exact" else 1e-3)


def test_unknown_pair_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--pairs", "vllm_vs_nothing"])
    err = capsys.readouterr().err
    assert "unknown pair 'vllm_vs_nothing'; known pairs:" in err
    for pair in ("megatron_vs_reference", "reference", "vllm_vs_reference"):
        assert pair in err


def test_parity_rows_for_exit_kv_and_depth(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    fams = "ouro_kv_full,ouro_kv_last_exited,huginn_depth48"
    args = ["--families", fams, "--max-new-tokens", "6", "--prompts", "2"]
    assert bench.main(args) == 0
    lines = {
        (x["family"], x["mode"]): x for x in map(json.loads, capsys.readouterr().out.splitlines())
    }
    assert sorted(lines) == sorted((f, m) for f in fams.split(",") for m in ("exact", "fast"))
    for (_family, mode), x in lines.items():
        assert x["pair"] == "reference" and x["tokens"] == 12
        assert x["max_abs_logprob_diff"] <= (1e-6 if mode == "exact" else 1e-5), x
    assert lines[("ouro_kv_full", "exact")]["kv"] == "full"
    assert lines[("ouro_kv_last_exited", "exact")]["kv"] == "last_exited"
    deep = lines[("huginn_depth48", "exact")]
    assert deep["depth_min"] == deep["depth_max"] == 48 and deep["kv"] == "last_exited"
