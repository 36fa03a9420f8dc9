"""The latent-noise contract (docs/CONTRACTS.md 1, docs/NOISE.md) holds for models.noise.

Noise of (latent_seed, position) must not depend on batch composition, prefill chunking,
process, CPU kernel path or compute dtype; docs/NOISE.md must describe the algorithm bit for
bit (checked by an independent plain-Python implementation of the document: CPython floats are
IEEE binary64 with one rounding per operator and no FMA contraction); the test vectors are
pinned.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models import noise
from models.noise import derive_latent_seed, latent_noise, ppnd

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "NOISE.md"

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
DOMAIN = 0x4C4F4F50524C4E5A  # b"LOOPRLNZ"
H = 64
BIG_SEED = 2**63 + 5

# docs/NOISE.md "Test vectors": float32 bit patterns of latent_noise(seed, [p], 64)[0, :8]
VECTORS = {
    (0, 0): "3f013d57 bf987026 3f1704ab bebcfb5f 3f1e6cd8 bf598dd3 bfc89fe6 3faecc28",
    (0, 1000): "3fc94cdd bef8a2de be85a767 be4dbea9 be2a001e bd246456 3e6af143 3cfb9ca3",
    (BIG_SEED, 0): "3fa89549 3fa5cde4 bfe468e3 bf1f9112 bea52e29 bfd90ec2 be173fb1 bec56875",
    (BIG_SEED, 1000): "bd8b1c46 bf13bdb6 bdcbb0e7 bf3daa5b bfab2c60 3f8efede be6a2d57 bf7a70cc",
}
# sha256 of the 64 little-endian float32 values of each row
ROW_SHA256 = {
    (0, 0): "b64e8b0e790af790c21a497b1a2161f940f20fb333ec41be2a24a2af2484b230",
    (0, 1000): "c6e6838b81a0a0df4f7b38451980d7af881d6d4eff4ea6b002d28bc5d0ce57b7",
    (BIG_SEED, 0): "75dcf1e7df2146d88c625ba66d836cb16af174a985a01fbc8344e7c47dff6cf5",
    (BIG_SEED, 1000): "8dc953877ceea114a596fc657e1ed82eaf728c48bf4679248463b82d53e2633a",
}
# single elements (seed, p, e) -> f32 bits, decided by the exact u of section 3
ELEMENTS = {(2, 316, 3468): "bd3dc07f", (3, 215, 427): "3f6e93bb", (3, 673, 4624): "3a0fb59f"}
BLOCK_SHA256 = "607d024172da30d77cbd03441873fdc886150b163af452d354f1ac70d07fd944"
SEED_VECTORS = [
    ((0, 0, 0), 9210399720123641703),
    ((1234, "prompt-1", 3), 12801600296051052877),
    ((MASK, MASK, MASK), 12585064611946549250),
]
# section 5 "Intermediate values": ppnd(v) as hex
PPND_VECTORS = {
    "0x1.61de1f985b5d7p-10": "-0x1.7fffffffffffep+1",
    "0x1.ff4f10f033d25p-1": "0x1.7fffffffffff9p+1",
    "0x1.0000000000000p-1": "0x0.0p+0",
    "0x1.0000000000000p-4": "-0x1.88bc1fbe1dabcp+0",
    "0x1.3333333333333p-4": "-0x1.7085226d3e523p+0",
    "0x1.e000000000000p-1": "0x1.88bc1fbe1dabcp+0",
    "0x1.d99999999999ap-1": "0x1.7085226d3e524p+0",
    "0x1.999999999999ap-4": "-0x1.4813c36e26d34p+0",
    "0x1.3333333333333p-2": "-0x1.0c7e39582c5fap-1",
}
# seed 0, position 0, element e: bits, u, v, ppnd(v), f32 bits
INTERMEDIATES = {
    0: ("b1958ae5c9c41f0c", "0x1.632b15cb93883p-1", "0x1.62e68b913f9b6p-1",
        "0x1.027aaded51af1p-1", "3f013d57"),
    6: ("0eac61a42f30b909", "0x1.d58c3485e6170p-5", "0x1.df569ea3ae242p-5",
        "-0x1.913fcbc26ef5fp+0", "bfc89fe6"),
    15: ("7e2f17147bba6623", "0x1.f8bc5c51eee9ap-2", "0x1.f8c1619b0f26bp-2",
         "-0x1.229155c3dd184p-6", "bc9148ab"),
    26: ("03aa7e114564c0f1", "0x1.d53f08a2b2640p-7", "0x1.001b3d867ff8dp-6",
         "-0x1.13acbdb0edee5p+1", "c009d65f"),
    29: ("f91627717f104be4", "0x1.f22c4ee2fe209p-1", "0x1.f184ee4672accp-1",
         "0x1.e81a7c91d2672p+0", "3ff40d3e"),
    42: ("fcb66d60d47afa35", "0x1.f96cdac1a8f5fp-1", "0x1.f8c076ff3f46ep-1",
         "0x1.18b191612e2bfp+1", "400c58c9"),
}  # fmt: skip

# ---- an independent implementation of docs/NOISE.md, in plain Python -------------------
# Constants: the document's hex literals, with the decimals they round (the paper's for AS241).

SCALARS = {
    "LO": ("0x1.61de1f985b5d7p-10", "0.0013498980316300946"),
    "HI": ("0x1.ff4f10f033d25p-1", "0.9986501019683699"),
    "W": ("0x1.fe9e21e067a4ap-1", "0.9973002039367398"),
    "SPLIT": ("0x1.b333333333333p-2", "0.425"),
    "R_CENTRAL": ("0x1.71eb851eb851fp-3", "0.180625"),
    "R_TAIL": ("0x1.999999999999ap+0", "1.6"),
    "SQRT_HALF": ("0x1.6a09e667f3bcdp-1", "0.70710678118654752440"),
    "LN2_HI": ("0x1.62e42fee00000p-1", "6.93147180369123816490e-01"),
    "LN2_LO": ("0x1.a39ef35793c76p-33", "1.90821492927058770002e-10"),
}
POLYS = {  # highest degree first
    "A": [("0x1.39a296f7d925ep+11", "2.5090809287301226727e+3"),
          ("0x1.052d26b2e45e4p+15", "3.3430575583588128105e+4"),
          ("0x1.06c1c55b78f20p+16", "6.7265770927008700853e+4"),
          ("0x1.66c3e869b752ap+15", "4.5921953931549871457e+4"),
          ("0x1.ad1d8cd4ee71dp+13", "1.3731693765509461125e+4"),
          ("0x1.ece5d2213c0ccp+10", "1.9715909503065514427e+3"),
          ("0x1.0a4888b1a436ep+7", "1.3314166789178437745e+2"),
          ("0x1.b18d91e9eef75p+1", "3.3871328727963666080e+0")],
    "B": [("0x1.46a7eca984b69p+12", "5.2264952788528545610e+3"),
          ("0x1.c0e457cb1ae76p+14", "2.8729085735721942674e+4"),
          ("0x1.3317caa64f4bep+15", "3.9307895800092710610e+4"),
          ("0x1.4b772d5d65266p+14", "2.1213794301586595867e+4"),
          ("0x1.512322e75c89fp+12", "5.3941960214247511077e+3"),
          ("0x1.5797efdc8b3f7p+9", "6.8718700749205790830e+2"),
          ("0x1.5281b386e1ab5p+5", "4.2313330701600911252e+1"),
          ("0x1.0000000000000p+0", "1.0")],
    "C": [("0x1.9615ac0b7ace9p-11", "7.74545014278341407640e-4"),
          ("0x1.744eb6c45ec67p-6", "2.27238449892691845833e-2"),
          ("0x1.ef2abb9b85c37p-3", "2.41780725177450611770e-1"),
          ("0x1.453cc085375b2p+0", "1.27045825245236838258e+0"),
          ("0x1.d2ecb1a3d02c4p+1", "3.64784832476320460504e+0"),
          ("0x1.713f71462256ap+2", "5.76949722146069140550e+0"),
          ("0x1.2857748cab19bp+2", "4.63033784615654529590e+0"),
          ("0x1.6c665fde9526ap+0", "1.42343711074968357734e+0")],
    "D": [("0x1.20d3f686439e4p-30", "1.05075007164441684324e-9"),
          ("0x1.1f18cbfdf2728p-11", "5.47593808499534494600e-4"),
          ("0x1.f207a7eab17bfp-7", "1.51986665636164571966e-2"),
          ("0x1.2f5123394f040p-3", "1.48103976427480074590e-1"),
          ("0x1.61292f23385c9p-1", "6.89767334985100004550e-1"),
          ("0x1.ad278e6526633p+0", "1.67638483018380384940e+0"),
          ("0x1.06cefbb46a449p+1", "2.05319162663775882187e+0"),
          ("0x1.0000000000000p+0", "1.0")],
    "LS": [(h, f"2/{2 * k + 1}") for h, k in zip(
        ["0x1.8618618618618p-4", "0x1.af286bca1af28p-4", "0x1.e1e1e1e1e1e1ep-4",
         "0x1.1111111111111p-3", "0x1.3b13b13b13b14p-3", "0x1.745d1745d1746p-3",
         "0x1.c71c71c71c71cp-3", "0x1.2492492492492p-2", "0x1.999999999999ap-2",
         "0x1.5555555555555p-1"], range(10, 0, -1))],
}  # fmt: skip

K = {name: float.fromhex(h) for name, (h, _) in SCALARS.items()}
P = {name: [float.fromhex(h) for h, _ in coefs] for name, coefs in POLYS.items()}
LO, HI, W = K["LO"], K["HI"], K["W"]


def mix(z: int) -> int:
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def polevl(x: float, coefs: list[float]) -> float:
    a = coefs[0]
    for c in coefs[1:]:
        a = a * x
        a = a + c
    return a


def spec_log(w: float) -> float:
    m, e = math.frexp(w)
    if m < K["SQRT_HALF"]:
        m, e = m + m, e - 1
    f = m - 1.0
    s = f / (m + 1.0)
    z = s * s
    t = polevl(z, P["LS"]) * z
    t = t * s
    lm = (s + s) + t
    big_e = float(e)
    return (big_e * K["LN2_HI"]) + ((big_e * K["LN2_LO"]) + lm)


def spec_ppnd(v: float) -> float:
    q = v - 0.5
    if abs(q) <= K["SPLIT"]:
        r = K["R_CENTRAL"] - (q * q)
        x = polevl(r, P["A"]) * q
        return x / polevl(r, P["B"])
    w = v if q < 0 else 1.0 - v
    r = math.sqrt(-spec_log(w))
    r = r - K["R_TAIL"]
    x = polevl(r, P["C"]) / polevl(r, P["D"])
    return -x if q < 0 else x


def spec_noise(seed: int, position: int, hidden: int) -> np.ndarray:
    row = mix(mix(seed ^ DOMAIN) ^ position)
    out = []
    for e in range(hidden):
        bits = mix(row + (e + 1) * GOLDEN)
        u = float((bits >> 11) | 1) * 2.0**-53
        x = spec_ppnd(LO + u * W)
        out.append(min(max(x, -3.0), 3.0))
    return np.array(out, dtype=np.float64).astype(np.float32)


def spec_seed(run_seed: int, prompt_id: int | str, sample_index: int) -> int:
    if isinstance(prompt_id, str):
        w = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "little")
    else:
        w = prompt_id
    s = mix(run_seed + GOLDEN)
    s = mix(s ^ mix(w + 2 * GOLDEN))
    return mix(s ^ mix(sample_index + 3 * GOLDEN))


# ---- the tests ----------------------------------------------------------------------------


def bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in t.contiguous().view(torch.int32).reshape(-1).tolist()]


def f32_hex(x: float) -> str:
    return f"{int(np.array([x], dtype=np.float32).view(np.uint32)[0]):08x}"


def test_pinned_vectors() -> None:
    for (seed, pos), expected in VECTORS.items():
        row = latent_noise(seed, [pos], H)
        assert row.dtype == torch.float32 and row.shape == (1, H)
        assert " ".join(f"{b:08x}" for b in bits(row[0, :8])) == expected, (seed, pos)
        assert hashlib.sha256(row.numpy().tobytes()).hexdigest() == ROW_SHA256[(seed, pos)]
    for (seed, pos, e), expected in ELEMENTS.items():
        assert f"{bits(latent_noise(seed, [pos], e + 1)[0, e])[0]:08x}" == expected
    block = latent_noise(3, torch.arange(1024), 5280).numpy()
    assert hashlib.sha256(block.tobytes()).hexdigest() == BLOCK_SHA256
    for args, expected in SEED_VECTORS:
        assert derive_latent_seed(*args) == expected == spec_seed(*args)


def test_pinned_intermediates() -> None:
    for v, z in PPND_VECTORS.items():
        x = float.fromhex(v)
        assert float(ppnd(np.array([x]))[0]).hex() == z == spec_ppnd(x).hex(), v
    row = mix(mix(0 ^ DOMAIN) ^ 0)
    noise_row = latent_noise(0, [0], H)[0]
    for e, (b, u, v, z, out) in INTERMEDIATES.items():
        counter = mix(row + (e + 1) * GOLDEN)
        uf = float((counter >> 11) | 1) * 2.0**-53
        vf = LO + uf * W
        zf = spec_ppnd(vf)
        assert (f"{counter:016x}", uf.hex(), vf.hex(), zf.hex(), f32_hex(zf)) == (b, u, v, z, out)
        assert f"{bits(noise_row[e])[0]:08x}" == out


def test_constants_match_document_code_and_decimals() -> None:
    doc = DOC.read_text()
    for name, (h, dec) in SCALARS.items():
        assert h in doc, f"{name} = {h} missing from docs/NOISE.md"
        assert float.fromhex(h) == float(dec), name
    for name, coefs in POLYS.items():
        for h, dec in coefs:
            assert h in doc, f"{name} coefficient {h} missing from docs/NOISE.md"
            num, _, den = dec.partition("/")
            assert float.fromhex(h) == (float(dec) if not den else int(num) / int(den))
    assert HI == 1.0 - LO and W == HI - LO
    assert int(np.array([K["LN2_HI"]]).view(np.uint64)[0]) & ((1 << 21) - 1) == 0  # e*LN2_HI exact
    assert (noise.PHI_MINUS_3, noise.LO, noise.HI, noise.WIDTH) == (LO, LO, HI, W)
    assert (noise.SPLIT, noise.R_CENTRAL, noise.R_TAIL) == (
        K["SPLIT"],
        K["R_CENTRAL"],
        K["R_TAIL"],
    )
    assert (noise.SQRT_HALF, noise.LN2_HI, noise.LN2_LO) == (
        K["SQRT_HALF"],
        K["LN2_HI"],
        K["LN2_LO"],
    )
    for name in "ABCD":
        assert list(getattr(noise, f"AS241_{name}")) == P[name], name
    assert list(noise.LOG_SERIES) == P["LS"]
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        assert float(mpmath.ncdf(-3)) == LO  # Phi(-3), correctly rounded
        assert float(mpmath.sqrt(0.5)) == K["SQRT_HALF"]
        assert abs(mpmath.mpf(K["LN2_HI"]) + mpmath.mpf(K["LN2_LO"]) - mpmath.log(2)) < 1e-25


def test_document_reproduces_the_code_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    cases = [(s, p) for s, p in VECTORS] + [
        (int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 1 << 20))) for _ in range(4)
    ]
    width = 512
    for seed, pos in cases:  # 8 rows x 512 = 4096 elements, ~15% of them in the tails
        got = latent_noise(seed, [pos], width)[0].numpy()
        assert got.tobytes() == spec_noise(seed, pos, width).tobytes(), (seed, pos)


def test_document_reproduces_ppnd_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    edges = [LO, HI, 0.5, 0.075, 0.925, 0.5 - K["SPLIT"], 0.5 + K["SPLIT"], 2.0**-4, 2.0**-9]
    edges += [float(np.nextafter(x, d)) for x in edges for d in (0.0, 1.0)]
    v = np.concatenate(
        [
            rng.uniform(LO, HI, 10_000),
            rng.uniform(LO, 0.08, 5_000),
            1.0 - rng.uniform(LO, 0.08, 5_000),
            np.clip(edges, LO, HI),
        ]
    )
    got = ppnd(v.copy())
    want = np.array([spec_ppnd(float(x)) for x in v])
    assert got.tobytes() == want.tobytes(), f"{(got != want).sum()} of {v.size} differ"


def test_ppnd_is_accurate() -> None:
    mpmath = pytest.importorskip("mpmath")
    rng = np.random.default_rng(2)
    v = np.concatenate([rng.uniform(LO, HI, 200), rng.uniform(LO, 0.08, 100), [LO, HI]])
    v = np.concatenate([v, 1.0 - v[200:302]])
    got = ppnd(v.copy())
    with mpmath.workdps(40):
        exact = [mpmath.sqrt(2) * mpmath.erfinv(2 * mpmath.mpf(float(x)) - 1) for x in v]
        worst = max(abs((g - x) / x) for g, x in zip(got.tolist(), exact, strict=True) if x)
    assert worst < 1e-14, worst
    assert float(ppnd(np.array([0.5]))[0]) == 0.0


# One run of this snippet: digests of noise rows (both tails) and of ppnd over [LO, HI].
_SNIPPET = """
import hashlib, numpy as np, torch
from models.noise import LO, HI, latent_noise, ppnd
x = latent_noise([0, 2**63 + 5, 3, 12345, 7], [0, 1000, 215, 7, 4095], 5280).numpy()
v = np.concatenate([np.linspace(LO, HI, 200_001), np.linspace(LO, 0.08, 50_001)])
result = hashlib.sha256(x.tobytes() + ppnd(v).tobytes()).hexdigest()
"""


_REPORT = """
import json
try:
    from numpy._core import _multiarray_umath as um
    on = [f for f in um.__cpu_dispatch__ if um.__cpu_features__.get(f)]
except ImportError:
    on = []
cap = torch.backends.cpu.get_cpu_capability()
print(json.dumps({"result": result, "torch": cap, "numpy": on}))
"""


def _numpy_simd_targets() -> list[str]:
    """The non-baseline SIMD targets numpy dispatches to on this host."""
    try:
        from numpy._core import _multiarray_umath as umath  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import _multiarray_umath as umath  # type: ignore[no-redef]
    found = umath.__cpu_features__
    return [f for f in umath.__cpu_dispatch__ if found.get(f) and f not in umath.__cpu_baseline__]


def _run_snippet(env_update: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(env_update)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    code = _SNIPPET + _REPORT
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("variant", ["aten-default", "numpy-baseline"])
def test_independent_of_cpu_kernel_path(variant: str) -> None:
    """torch's non-FMA kernels and numpy's baseline (no AVX/AVX2/AVX512/FMA3) loops agree."""
    ns: dict[str, object] = {}
    exec(_SNIPPET, ns)
    here = ns["result"]
    if variant == "aten-default":
        proc = _run_snippet({"ATEN_CPU_CAPABILITY": "default"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        assert child["torch"] == "DEFAULT"
    else:
        try:
            targets = _numpy_simd_targets()
        except (ImportError, AttributeError) as exc:  # pragma: no cover
            pytest.skip(f"numpy exposes no CPU dispatch info: {exc}")
        if not targets:
            pytest.skip("numpy dispatches to no SIMD target beyond its baseline on this host")
        proc = _run_snippet({"NPY_DISABLE_CPU_FEATURES": " ".join(targets)})
        if proc.returncode != 0:
            pytest.skip(f"numpy refused NPY_DISABLE_CPU_FEATURES: {proc.stderr[-500:]}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        still_on = sorted(set(child["numpy"]) & set(targets))
        if still_on:
            pytest.skip(f"numpy ignored NPY_DISABLE_CPU_FEATURES for {still_on}")
    assert child["result"] == here, variant


def test_independent_of_batch_composition() -> None:
    seeds = [0, BIG_SEED, 7, 2**64 - 1, 12345, 0]
    positions = [0, 1000, 3, 17, 0, 999]
    batch = latent_noise(seeds, positions, H)
    for i, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        assert bits(batch[i]) == bits(latent_noise(s, [p], H)[0]), i
    # the same token inside two different batches
    other = latent_noise([5, BIG_SEED, 9], [1, 1000, 2], H)
    assert bits(other[1]) == bits(batch[1])
    # seeds as an int64 tensor (two's complement) or a uint64 array mean the same
    as_tensor = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64)
    assert bits(latent_noise(as_tensor, positions, H)) == bits(batch)
    as_array = np.array(seeds, dtype=np.uint64)
    assert bits(latent_noise(as_array, torch.tensor(positions), H)) == bits(batch)


def test_independent_of_prefill_chunking() -> None:
    whole = latent_noise(BIG_SEED, list(range(130)), H)
    cuts = [0, 1, 37, 38, 64, 129, 130]
    chunks = [latent_noise(BIG_SEED, list(range(a, b)), H) for a, b in zip(cuts, cuts[1:])]
    assert bits(torch.cat(chunks)) == bits(whole)
    assert bits(latent_noise(BIG_SEED, [129, 0, 64], H)) == bits(whole[[129, 0, 64]])


def test_width_only_says_how_many_elements() -> None:
    wide = latent_noise([BIG_SEED, 0], [1000, 3], 2 * H)
    assert bits(wide[:, :H]) == bits(latent_noise([BIG_SEED, 0], [1000, 3], H))


def _child_noise(seed: int, positions: list[int], hidden: int) -> bytes:
    return latent_noise(seed, positions, hidden).numpy().tobytes()


def test_independent_of_process() -> None:
    positions = [0, 1, 2, 1000, 4095]
    here = _child_noise(BIG_SEED, positions, H)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        there = pool.apply(_child_noise, (BIG_SEED, positions, H))
    assert there == here


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_independent_of_compute_dtype(default_dtype: torch.dtype) -> None:
    reference = latent_noise(0, [0, 1000], H)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            drawn = latent_noise(0, [0, 1000], H)
    finally:
        torch.set_default_dtype(previous)
    assert drawn.dtype == torch.float32
    assert bits(drawn) == bits(reference)
    # noise then cast == the specified fp32 values then cast (never a direct fp64 -> dtype)
    spec = torch.from_numpy(np.stack([spec_noise(0, 0, H), spec_noise(0, 1000, H)]))
    cast = drawn.to(default_dtype)
    assert cast.dtype == default_dtype
    assert cast.view(-1).tolist() == spec.to(default_dtype).view(-1).tolist()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="positions must be >= 0"):
        latent_noise(0, [-1], H)
    with pytest.raises(ValueError, match="latent_seed must be an integer in \\[0, 2\\*\\*64\\)"):
        latent_noise(2**64, [0], H)
    with pytest.raises(ValueError, match="per-token seeds must have shape \\(2,\\)"):
        latent_noise([1, 2, 3], [0, 1], H)


def test_seed_and_depth_rules() -> None:
    """models.seeds and models.depths: the one owners of the seed range and wrap and of the
    contract-2 rules and layout."""
    import numpy as np
    import pytest

    from models.depths import full_depth, position_depths
    from models.seeds import check_latent_seed, seed_from_i64, seed_to_i64

    for s in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert seed_from_i64(seed_to_i64(s)) == s and -(1 << 63) <= seed_to_i64(s) < 1 << 63
    for bad in (-1, 1 << 64, True, 1.0, "3"):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            check_latent_seed(bad)
    assert full_depth([4, 1, 4, 2], 4) == 4
    for bad_d, model in (([5, 1], 4), ([0, 1], 4), ([3, 4], 4), ([], 4)):
        with pytest.raises(ValueError):
            full_depth(bad_d, model)
    assert position_depths(3, [4, 2, 1]).tolist() == [4, 4, 4, 2, 1]
    assert position_depths(1, np.array([2], np.uint8)).tolist() == [2]
