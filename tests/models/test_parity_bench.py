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
