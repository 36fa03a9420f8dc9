"""models.kernels.draw: a decode step's token and behaviour log-prob in two Triton kernels,
against the spec's ops (models.reference.behaviour_logprobs, then the race of
models.sampling.draw_keys, eager: float64 exp(lp) / q): under Triton's CPU interpreter (a
subprocess: TRITON_INTERPRET is read when a kernel is decorated) and, on CUDA, at the 1b
decode's shape through `draw_step` inside fused_generation, the torch engine's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.kernels.noise import HAVE_TRITON

ROOT = Path(__file__).resolve().parents[2]

_CHECK = r"""
import json, torch
from models.kernels.draw import draw_triton
from models.reference import behaviour_logprobs
from models.sampling import draw_keys

def spec(logits, vocab, temp, keys, steps, greedy):
    lp = behaviour_logprobs(logits, vocab, temp, 1.0, "fast")
    tok = lp.argmax(-1) if keys is None else draw_keys(lp, keys, steps)
    if greedy is not None:
        tok = torch.where(greedy, lp.argmax(-1), tok)
    return tok, lp.gather(1, tok[:, None])[:, 0]

gen = torch.Generator().manual_seed(0)
out = {}
# rows, row width, vocab, temperature, splits, block, dtype
for case in [(6, 300, 290, 0.7, 3, 64, torch.bfloat16), (3, 130, 130, 1.0, None, 64, torch.float32),
             (3, 1100, 1030, 1.3, 2, 256, torch.bfloat16), (2, 77, 77, 1.0, 5, 16, torch.float32)]:
    n, width, vocab, temp, splits, block, dt = case
    logits = (torch.randn(n, width, generator=gen) * 4).to(dt)
    logits[0, 10:40] = float("-inf")  # some columns never drawn
    keys = torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=gen)
    keys[0] = -1
    steps = torch.randint(0, 1000, (n,), dtype=torch.int64, generator=gen)
    greedy = torch.zeros(n, dtype=torch.bool)
    greedy[1] = True
    got = draw_triton(logits, vocab, temp, keys, steps, greedy, block=block, splits=splits)
    want = spec(logits, vocab, temp, keys, steps, greedy)
    out[str(case[:5])] = [got[0].tolist(), want[0].tolist(), float((got[1] - want[1]).abs().max()),
                         str(got[0].dtype), str(got[1].dtype)]
# every row greedy (no keys), ties: the first index, also across splits
flat = torch.zeros(3, 200)
flat[1, 150] = flat[1, 20] = 1.0
flat[2, 199] = 2.0
g = draw_triton(flat, 200, 1.0, None, None, block=16, splits=4)
out["greedy"] = [g[0].tolist(), float((g[1] - spec(flat, 200, 1.0, None, None, None)[1]).abs().max())]
# the same row at many steps: the draws follow the distribution (the race's frequencies)
probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
rows = probs.log()[None].repeat(800, 1)
tok, _ = draw_triton(rows, 5, 1.0, torch.full((800,), 7, dtype=torch.int64),
                     torch.arange(800), block=16)
out["freq"] = torch.bincount(tok, minlength=5).tolist()
try:
    draw_triton(flat.t(), 3, 1.0, None, None)
except ValueError as e:
    out["refused"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="interpreter active"
)
def test_draw_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("(6, 300, 290, 0.7, 3)", "(3, 130, 130, 1.0, None)",
                 "(3, 1100, 1030, 1.3, 2)", "(2, 77, 77, 1.0, 5)"):  # fmt: skip
        got, want, lp_err, tdt, ldt = res[case]
        assert got == want, case  # the spec's tokens
        assert lp_err <= 1e-6 * 16, (case, lp_err)  # its log-probs, to fp32 rounding
        assert (tdt, ldt) == ("torch.int64", "torch.float32")
        assert not 10 <= got[0] < 40  # a -inf logit is never drawn
    assert res["greedy"][0] == [0, 20, 199]  # argmax, the first index on ties
    assert res["greedy"][1] <= 1e-6
    freq = res["freq"]  # 800 draws of (1/2, 1/4, 1/8, 1/16, 1/16): within 4 sigma
    for count, p in zip(freq, (0.5, 0.25, 0.125, 0.0625, 0.0625), strict=True):
        assert abs(count - 800 * p) <= 4 * (800 * p * (1 - p)) ** 0.5, freq
    assert "unit column stride" in res["refused"]


def test_draw_step_is_the_spec_off_the_card() -> None:
    """On the CPU (and wherever the kernel does not apply: top_p < 1, exact numerics) the
    engine's draw is the spec's ops themselves."""
    from models.kernels.draw import draw_step
    from models.reference import behaviour_logprobs
    from models.sampling import draw_keys

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 70, generator=gen) * 3
    keys = torch.randint(-(2**63), 2**63 - 1, (5,), dtype=torch.int64, generator=gen)
    steps = torch.arange(5)
    greedy = torch.tensor([False, True, False, False, True])
    for top_p, mode in ((1.0, "fast"), (0.8, "fast"), (1.0, "exact")):
        lp = behaviour_logprobs(logits, 64, 0.9, top_p, mode)
        want = torch.where(greedy, lp.argmax(-1), draw_keys(lp, keys, steps))
        tok, picked = draw_step(logits, 64, 0.9, top_p, mode, keys, steps, greedy)
        assert torch.equal(tok, want)
        assert torch.equal(picked, lp.gather(1, want[:, None])[:, 0])
    tok, _ = draw_step(logits, 64, 1.0, 1.0, "fast", None, None)
    assert torch.equal(tok, logits[:, :64].argmax(-1))


@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA")
def test_draw_step_on_the_card_gives_the_specs_tokens() -> None:
    """The 1b decode's draw (256 rows, vocabulary 65,536, bf16 logits) through `draw_step` in
    fused generation: the kernel's tokens are the spec's eager race's, its log-probs torch's
    log_softmax's to fp32 rounding, greedy rows the argmax."""
    from models import numerics as nx
    from models.kernels.draw import draw_step
    from models.reference import behaviour_logprobs
    from models.sampling import draw_keys

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(256, 65536, generator=gen) * 3).to(torch.bfloat16).cuda()
    keys = torch.randint(-(2**63), 2**63 - 1, (256,), dtype=torch.int64, generator=gen).cuda()
    steps = torch.randint(0, 4096, (256,), dtype=torch.int64, generator=gen).cuda()
    greedy = (torch.arange(256) % 17 == 0).cuda()
    with torch.no_grad(), nx.fused_generation():
        tok, picked = draw_step(logits, 65536, 0.8, 1.0, "fast", keys, steps, greedy)
    lp = behaviour_logprobs(logits, 65536, 0.8, 1.0, "fast")
    want = torch.where(greedy, lp.argmax(-1), draw_keys(lp, keys, steps))  # eager: the spec
    assert torch.equal(tok, want)
    err = float((picked - lp.gather(1, want[:, None])[:, 0]).abs().max())
    assert err <= 2e-5, err
