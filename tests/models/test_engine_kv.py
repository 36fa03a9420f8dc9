"""models.engine.kv (the fixed-shape tick decode's K/V writes as Triton kernels): each kernel
against the torch ops it replaces, bit for bit (pure copies), under Triton's CPU interpreter
(a subprocess: TRITON_INTERPRET is read when the kernels are decorated) and on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def check(device: str) -> dict[str, bool]:
    """Kernel vs torch on one random case: a core cache of 5 slots (depth 4 + a spare), 3
    layers, 6 rows, 9 positions, 2 kv heads of 24; rows written at their own slot and
    position; exits at depths 1..4 (4: nothing to copy), one row not exited."""
    from models.engine import kv

    g = torch.Generator().manual_seed(0)
    core = torch.randn(5, 3, 2, 6, 9, 2, 24, generator=g).to(device)
    rows = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
    pos = torch.tensor([0, 8, 3, 3, 5, 1], device=device)
    slot = torch.tensor([4, 0, 2, 3, 1, 4], device=device)
    x = torch.randn(6, 2, 24, generator=g).to(device)
    w = torch.tensor([True, True, False, True, True, True], device=device)
    exit_at = torch.tensor([1, 2, 3, 4, 3, 1], device=device)
    out = {}
    got, want = core.clone(), core.clone()
    kv.INTERPRET[0] = device == "cpu"
    kv.write_rows(got[:, 1, 0], slot, rows, pos, x)
    kv.carry_exits(got, w, exit_at, rows, pos, 4)
    kv.INTERPRET[0] = False
    if device == "cuda":
        assert kv._kernel_ok(got)
    kv.write_rows(want[:, 1, 0], slot, rows, pos, x)
    kv.carry_exits(want, w, exit_at, rows, pos, 4)
    out["equal"] = bool(torch.equal(got, want))
    out["changed"] = not bool(torch.equal(got, core))
    # the copies themselves: row 0 (exit 1) has slot 0's K/V in slots 1..3 at its position
    out["copied"] = bool(
        torch.equal(got[1:4, :, :, 0, 0], got[0:1, :, :, 0, 0].expand(3, -1, -1, -1, -1))
    )
    # row 2 did not exit: nothing copied into its slots (its layer-0 K/V, not written, as before)
    out["untouched"] = bool(torch.equal(got[:, 0, :, 2], core[:, 0, :, 2]))
    # write_kv: one layer's K and V of every row at its position (k a strided view, as a
    # compiled projection hands it over)
    layer = torch.randn(2, 6, 9, 2, 24, generator=g).to(device)
    both = torch.randn(6, 2, 2, 24, generator=g).to(device)
    k, v = both[:, 0], both[:, 1]
    got, want = layer.clone(), layer.clone()
    kv.INTERPRET[0] = device == "cpu"
    kv.write_kv(got, rows, pos, k, v)
    kv.INTERPRET[0] = False
    want[0, rows, pos] = k
    want[1, rows, pos] = v
    out["kv_equal"] = bool(torch.equal(got, want)) and not bool(torch.equal(got, layer))
    kept = torch.ones(2, 6, 9, dtype=torch.bool, device=device)
    kept[:, rows, pos] = False
    out["kv_only_those"] = bool(torch.equal(got[kept], layer[kept]))
    return out


_CHECK = """
import json
from tests.models.test_engine_kv import check
print(json.dumps(check("cpu")))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this host")
def test_kv_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"equal": True, "changed": True, "copied": True, "untouched": True,
                   "kv_equal": True, "kv_only_those": True}, res  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kv_kernels_on_cuda() -> None:
    assert check("cuda") == {"equal": True, "changed": True, "copied": True, "untouched": True,
                             "kv_equal": True, "kv_only_those": True}  # fmt: skip
