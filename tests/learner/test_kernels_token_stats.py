"""learner.kernels.token_stats on a CPU host: the dispatcher, the argument checks, and the Triton
kernels themselves under Triton's CPU interpreter (TRITON_INTERPRET=1), against the PyTorch
reference `learner.vocab_ops.token_stats`.

The interpreter reads TRITON_INTERPRET when a kernel is decorated, i.e. when the module is
first imported, so the interpreter test runs in a subprocess with the variable set (a few
seconds). Small tiles (TritonConfig blocks of 64 columns) make the forward cross several
tiles and vocabulary splits, and the backward several programs per row. The GPU check of the
same kernels at full size is benchmarks/token_stats_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.kernels.token_stats import HAS_TRITON, token_stats_auto, token_stats_triton
from learner.vocab_ops import token_stats

ROOT = Path(__file__).resolve().parents[2]


def _inputs(dtype: torch.dtype, n: int = 7, v: int = 300, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    new = torch.randn(n, v, generator=gen) * 3
    old = new + 0.5 * torch.randn(n, v, generator=gen)
    old[0, :50] = float("-inf")  # truncated old support
    old[1] = float("-inf")  # empty old distribution
    new[2, 100:] = float("-inf")  # old mass where new is -inf: KL = +inf
    new[3] = float("-inf")
    old[3] = float("-inf")  # both empty
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[2] = 5
    return new.to(dtype), old.to(dtype), targets


def _loss(out) -> torch.Tensor:  # type: ignore[no-untyped-def]
    total = torch.nan_to_num(out.logp, neginf=0.0).sum() + 0.5 * out.entropy.sum()
    if out.kl is not None:
        total = total - 0.25 * torch.nan_to_num(out.kl, posinf=0.0).sum()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_old", [True, False])
def test_auto_is_the_pytorch_path_on_cpu(dtype: torch.dtype, with_old: bool) -> None:
    new, old, targets = _inputs(dtype)
    a = new.clone().requires_grad_()
    b = new.clone().requires_grad_()
    ref = token_stats(a, old if with_old else None, targets, 0.7, 64)
    got = token_stats_auto(b, old if with_old else None, targets, 0.7, 64)
    for field in ref._fields:
        x, y = getattr(ref, field), getattr(got, field)
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), field
    _loss(ref).backward()
    _loss(got).backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, b.grad)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="interpreter active"
)
def test_triton_path_refuses_cpu_tensors() -> None:
    new, old, targets = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="token_stats_auto"):
        token_stats_triton(new, old, targets)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(chunk=0), "chunk"),
        (dict(targets=torch.zeros(3, dtype=torch.long)), "targets"),
        (dict(logits_old=torch.zeros(7, 5)), "logits_old"),
    ],
)
def test_argument_errors_match_reference(kwargs: dict, match: str) -> None:
    new, old, targets = _inputs(torch.float32)
    args = dict(logits_new=new, logits_old=old, targets=targets) | kwargs
    for fn in (token_stats, token_stats_triton, token_stats_auto):
        with pytest.raises(ValueError, match=match):
            fn(**args)


_INTERPRETER_CHECK = r"""
import json, torch
from learner.kernels.token_stats import TritonConfig, token_stats_triton
from learner.vocab_ops import token_stats
from tests.learner.test_kernels_token_stats import _inputs, _loss

TritonConfig.fwd_block = TritonConfig.bwd_block = 64
out = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for with_old in (True, False):
        for temperature, n, v in ((0.7, 7, 300), (1.3, 5, 1000)):
            new, old, targets = _inputs(dtype, n, v, seed=n)
            a = new.clone().requires_grad_()
            b = new.clone().requires_grad_()
            o = old if with_old else None
            ref = token_stats(a, o, targets, temperature, 37)
            got = token_stats_triton(b, o, targets, temperature)
            _loss(ref).backward()
            _loss(got).backward()
            res = {}
            for f in ref._fields:
                x, y = getattr(ref, f), getattr(got, f)
                if x is None:
                    res[f] = None if y is None else "unexpected"
                    continue
                same_inf = bool(torch.equal(torch.isinf(x), torch.isinf(y)))
                fin = torch.isfinite(x)
                res[f] = [same_inf, float((x[fin] - y[fin]).abs().max()), str(y.dtype)]
            g = (a.grad.double() - b.grad.double()).norm() / a.grad.double().norm()
            res["grad"] = [str(b.grad.dtype), float(g), bool(torch.isnan(b.grad).any())]
            out[f"{dtype}-{with_old}-{v}"] = res
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this host")
def test_kernels_under_triton_interpreter_match_reference() -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)  # keep the caller's (GPU host)
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_CHECK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 12
    for case, res in results.items():
        tol = 1e-5 if "float32" in case else 1e-4  # fp32 math either way; inputs differ only
        for field in ("logp", "entropy", "kl", "logp_old"):
            if res[field] is None:
                assert "False" in case or field in ("logp", "entropy"), case
                continue
            same_inf, diff, dtype = res[field]
            assert same_inf, (case, field)
            assert dtype == "torch.float32", (case, field)
            assert diff < tol, (case, field, diff)
        grad_dtype, rel, has_nan = res["grad"]
        assert grad_dtype == case.split("-")[0]
        assert not has_nan, case
        assert rel < (1e-6 if "float32" in case else 1e-2), (case, rel)
