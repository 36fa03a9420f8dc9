"""models.engine.attention.decode_attention (the torch engine's decode attention, a Triton
kernel) against the exact recipe of models.numerics.attention: under Triton's CPU interpreter
(a subprocess: TRITON_INTERPRET is read when the kernel is decorated) and, on CUDA, on the
device, through numerics.attention inside fused_generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import numerics as nx

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def _case(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """3 rows, 4 query heads over 2 kv heads, head_dim 24, 37 positions (blocks of 16: three
    blocks, the last partial); row 1 sees only positions 20..30 (its first block sees nothing),
    row 2 a sparse set."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, 24, generator=g)
    k, v = torch.randn(3, 37, 2, 24, generator=g), torch.randn(3, 37, 2, 24, generator=g)
    mask = torch.zeros(3, 1, 37, dtype=torch.bool)
    mask[0, 0, :] = True
    mask[1, 0, 20:31] = True
    mask[2, 0, ::5] = True
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                 for t in (q, k, v, mask))  # fmt: skip


_CHECK = """
import json, torch
from models.engine.attention import decode_attention
from models import numerics as nx
from tests.models.test_engine_attention import _case
out = {}
for dtype in (torch.float32, torch.bfloat16):
    q, k, v, mask = _case(dtype, "cpu")
    ref = nx.attention(q.float(), k.float(), v.float(), mask, "exact")
    got = decode_attention(q, k, v, mask, block_t=16)
    out[str(dtype)] = [float((got.float() - ref).abs().max()), str(got.dtype), list(got.shape)]
# rows: queries 0..2 read cache rows 2, 0, 2 of a cache with a 4th row (the kernel, not a gather)
q, k, v, mask = _case(torch.float32, "cpu")
k4, v4 = torch.cat([k, 9 + k[:1]]), torch.cat([v, 9 + v[:1]])
pick = torch.tensor([2, 0, 2])
m2 = mask[pick]
ref = nx.attention(q, k4[pick], v4[pick], m2, "exact")
got = decode_attention(q, k4, v4, m2, block_t=16, rows=pick)
out["rows"] = float((got - ref).abs().max())
# slots: a [3 slots, 4 rows] cache of one layer; queries read (slot, row) = (2, 1), (0, 3), (1, 1)
ks = torch.stack([k4 * (1 + j) for j in range(3)])
vs = torch.stack([v4 - j for j in range(3)])
sl, rw = torch.tensor([2, 0, 1]), torch.tensor([1, 3, 1])
ref = nx.attention(q, ks[sl, rw], vs[sl, rw], mask, "exact")
got = decode_attention(q, ks, vs, mask, block_t=16, rows=rw, slots=sl)
out["slots"] = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
# keys past a row's last visible one are never read: NaN there (a slot allocated for the
# longest row, not yet written) leaves the output as it is
q, k, v, mask = _case(torch.float32, "cpu")
ref = nx.attention(q, k, v, mask, "exact")
kn, vn = k.clone(), v.clone()
kn[1, 31:], vn[1, 31:] = float("nan"), float("nan")  # row 1 sees 20..30
kn[2, 36:], vn[2, 36:] = float("nan"), float("nan")  # row 2's last visible key is 35
got = decode_attention(q, kn, vn, mask, block_t=16)
out["past_end"] = float((got - ref).abs().max())
# the step's ends given (computed once for its layers): the same bits as computed here
from models.engine.attention import key_ends
ends = key_ends(mask)
out["ends"] = ends.tolist()
out["ends_given"] = bool(torch.equal(decode_attention(q, kn, vn, mask, block_t=16, ends=ends), got))
try:
    decode_attention(q, k, v, mask, ends=ends.long())
    out["ends_refused"] = ""
except ValueError as e:
    out["ends_refused"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this host")
def test_decode_kernel_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["torch.float32"][1:] == ["torch.float32", [3, 1, 96]]
    assert res["torch.float32"][0] <= 2e-6, res
    assert res["torch.bfloat16"][1] == "torch.bfloat16"
    assert res["torch.bfloat16"][0] <= 2e-2, res  # one bf16 rounding of values of ~1
    assert res["rows"] <= 2e-6, res  # each query read its own cache row
    assert res["slots"] <= 2e-6, res  # ... of its own slot
    assert res["past_end"] <= 2e-6, res  # NaN past a row's last key: not read (finite, equal)
    assert res["ends"] == [37, 31, 36]  # each row's last visible key + 1
    assert res["ends_given"] is True
    assert res["ends_refused"] == "ends must be int32 [3] (key_ends of the mask)"


def test_a_decode_step_computes_its_key_ends_once() -> None:
    """`_Rows.ends`: None off CUDA or with several queries a row (the fused decode does not
    run there); on CUDA computed at the first layer's call and the same tensor for the rest."""
    from models.engine.chunk import _Rows

    mask = torch.ones(2, 1, 5, dtype=torch.bool)
    rows = _Rows(2, 1, torch.arange(2), torch.zeros(2, dtype=torch.long), mask, torch.zeros(1),
                 "fast")  # fmt: skip
    assert rows.ends is None
    several = _Rows(2, 3, torch.arange(2), torch.zeros(2, dtype=torch.long),
                    torch.ones(2, 3, 5, dtype=torch.bool), torch.zeros(1), "fast")  # fmt: skip
    assert several.ends is None
    if torch.cuda.is_available():
        on = _Rows(2, 1, torch.arange(2), torch.zeros(2, dtype=torch.long), mask.cuda(),
                   torch.zeros(1), "fast")  # fmt: skip
        assert on.ends is on.ends and on.ends.tolist() == [5, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_decode_kernel_on_cuda_through_numerics() -> None:
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        q, k, v, mask = _case(dtype, "cuda")
        ref = nx.attention(q.float(), k.float(), v.float(), mask, "exact")
        with nx.fused_generation():
            got = nx.attention(q, k, v, mask, "fast")
        assert got.dtype == dtype and got.shape == (3, 1, 96)
        assert float((got.float() - ref).abs().max()) <= tol
    # each query at its own (slot, row) of a [3 slots, 4 rows] cache, on the device
    from models.engine.attention import decode_attention

    q, k, v, mask = _case(torch.float32, "cuda")
    ks = torch.stack([torch.cat([k, 9 + k[:1]]) * (1 + j) for j in range(3)])
    vs = torch.stack([torch.cat([v, 9 + v[:1]]) - j for j in range(3)])
    sl, rw = torch.tensor([2, 0, 1], device="cuda"), torch.tensor([1, 3, 1], device="cuda")
    ref = nx.attention(q, ks[sl, rw], vs[sl, rw], mask, "exact")
    got = decode_attention(q, ks, vs, mask, rows=rw, slots=sl)
    # (keys scaled up to 3x, values up to |3|: fp32 rounding relative to the outputs' size)
    assert float((got - ref).abs().max()) <= 2e-6 * max(1.0, float(ref.abs().max()))
