"""Reference-engine decode in a CUDA graph vs eager: warm tokens/s and log-prob equality, one JSON line.

    python benchmarks/decode_graph.py                  # H200: Huginn ~1B shape, fp32, fast mode
    python benchmarks/decode_graph.py --device cpu --tiny   # CPU smoke test (no graph)

What runs. `models.engine.run_chunk` decodes one token per chunk; at a fixed depth (every
token runs `depth` core iterations: `depths` given, no exit policy) its arithmetic has no
data-dependent control flow, but the function still syncs with the host (boolean-mask writes,
`.any()` checks, `.tolist()` of rows, the CPU latent noise). `decode_step` below is that
decode path with the syncs taken out: the same module calls in the same order (`embed`, the
prelude / core / coda stacks of `qkv` -> K/V write at the position -> `numerics.attention` ->
`post`, `core_in` / `core_out`, `readout_in` / `readout_out`, `head`), K/V written with
integer indices, every row valid. What depends only on (seed, position), the RoPE rows and
Huginn's s_0 (`model.rope`, `model.initial_state`), is computed for all decode positions
before timing and copied in per step (the same in every variant). Greedy decoding: the next
token is the argmax (on the device); `logp` = its log-softmax.

Variants, each from the same prefilled cache (prompt through `run_chunk`), `--tokens` steps:
  engine   run_chunk per token (eager, the engine as it is, with its syncs)
  eager    decode_step per token, eager
  graph    decode_step captured once in a CUDA graph (torch.cuda.CUDAGraph), replayed per token
Checks: graph vs eager and eager vs engine, max |delta logp| over all tokens and rows (fp32,
target <= 1e-6), and the same greedy tokens. Timing: warm (one untimed pass of each variant
first), CUDA events around the whole loop, ms per decode step (B tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from models import numerics as nx  # noqa: E402
from models.engine import KVCache, run_chunk  # noqa: E402

SHAPES = {  # Huginn-shaped (benchmarks/trainer_gpu.py's huginn_1b), reference module in fp32
    "huginn_1b": dict(hidden=2048, heads=16, prelude=2, core=4, coda=2, ffn=5632, vocab=65536,
                      recurrence=8, backprop_depth=8, seq=512),
    "tiny": dict(hidden=64, heads=2, prelude=1, core=2, coda=1, ffn=128, vocab=512,
                 recurrence=4, backprop_depth=2, seq=64),
}  # fmt: skip


def _stack(blocks: Any, slots: Tensor, x: Tensor, rows: Tensor, pos: Tensor, rope: Tensor,
           kmask: Tensor, mode: str) -> Tensor:  # fmt: skip
    """models.engine._stack for one position per row, every row written (no boolean mask)."""
    for layer, blk in enumerate(blocks):
        q, k, v = blk.qkv(x, rope, mode)
        slots[layer, 0, rows, pos] = k
        slots[layer, 1, rows, pos] = v
        q = q.view(x.shape[0], 1, blk.n_heads, blk.head_dim)
        attn = nx.attention(q, slots[layer, 0], slots[layer, 1], kmask, mode)
        x = blk.post(x, attn.reshape(x.shape[0], -1), mode)
    return x


def decode_step(model: Any, cache: KVCache, tok: Tensor, pos: Tensor, rope: Tensor,
                s0: Tensor | None, depth: int, mode: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One decode chunk at a fixed depth without host syncs: (greedy next token [B], its
    log-prob [B]). tok, pos: [B] int64 on the device; s0: Huginn's initial state (None: the
    family's initial_state is the embedding)."""
    rows = torch.arange(tok.shape[0], device=tok.device)
    cache.filled.index_put_((rows, pos), torch.ones((), dtype=torch.bool, device=tok.device))
    key_pos = torch.arange(cache.filled.shape[1], device=tok.device)
    kmask = cache.filled[:, None, :] & (key_pos[None, None, :] <= pos[:, None, None])
    kmask[..., 0] |= ~kmask.any(dim=-1)
    e = _stack(model.prelude_blocks(), cache.prelude, model.embed(tok), rows, pos, rope, kmask,
               mode)  # fmt: skip
    state = e if s0 is None else s0
    for i in range(depth):
        x = model.core_in(state, e, mode)
        x = _stack(model.core_blocks(), cache.core[i], x, rows, pos, rope, kmask, mode)
        state = model.core_out(x, mode)
    x = _stack(model.coda_blocks(), cache.coda, model.readout_in(state, mode), rows, pos, rope,
               kmask, mode)  # fmt: skip
    logp = torch.log_softmax(model.head(model.readout_out(x, mode), mode).float(), dim=-1)
    nxt = logp.argmax(dim=-1)
    return nxt, logp.gather(-1, nxt[:, None])[:, 0]


def clone_cache(c: KVCache) -> KVCache:
    return KVCache(c.prelude.clone(), c.core.clone(), c.coda.clone(), c.filled.clone())


def restore(dst: KVCache, src: KVCache) -> None:
    for a, b in ((dst.prelude, src.prelude), (dst.core, src.core), (dst.coda, src.coda),
                 (dst.filled, src.filled)):  # fmt: skip
        a.copy_(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="huginn_1b")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per variant")
    ap.add_argument("--depth", type=int, default=None, help="default: the shape's recurrence")
    ap.add_argument("--mode", choices=("fast", "exact"), default="fast")
    a = ap.parse_args()
    from benchmarks.trainer_gpu import model_config
    from models.reference import build_model

    s = dict(SHAPES["tiny" if a.tiny else a.shape])
    if a.tiny:
        a.batch, a.prompt, a.tokens = min(a.batch, 2), min(a.prompt, 8), min(a.tokens, 4)
    depth = a.depth or s["recurrence"]
    s["recurrence"] = max(s["recurrence"], depth)
    dev = torch.device(a.device if a.device == "cpu" or torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(model_config(s), seed=0).to(dev).eval()
    build_s = time.perf_counter() - t0
    huginn = hasattr(model, "freqs_cis")
    b, p0, n_tok, mode = a.batch, a.prompt, a.tokens, a.mode
    seeds = [1 + 2 * i for i in range(b)]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, s["vocab"], (b, p0), generator=gen)
    with torch.no_grad():
        cache = KVCache.empty(model, b, p0 + n_tok + 1, depth)
        out = run_chunk(model, cache, prompt, torch.arange(p0).expand(b, p0),
                        torch.ones(b, p0, dtype=torch.bool), seeds, max_depth=depth,
                        depths=torch.full((b, p0), depth), mode=mode)  # fmt: skip
        first = out.logits[:, -1].float().argmax(dim=-1).to(dev)
        base = clone_cache(cache)
        positions = [torch.full((b,), p0 + t, dtype=torch.int64, device=dev) for t in range(n_tok)]
        ropes = [model.rope(q, mode) for q in positions]
        s0s = [model.initial_state(torch.zeros(b, s["hidden"], device=dev), q, seeds)
               if huginn else None for q in positions]  # fmt: skip

        def run_engine() -> tuple[Tensor, Tensor]:
            tok, toks, lps = first.clone(), [], []
            for t in range(n_tok):
                o = run_chunk(model, cache, tok[:, None], positions[t][:, None],
                              torch.ones(b, 1, dtype=torch.bool), seeds, max_depth=depth,
                              depths=torch.full((b, 1), depth), mode=mode)  # fmt: skip
                logp = torch.log_softmax(o.logits[:, 0].float(), dim=-1)
                tok = logp.argmax(dim=-1)
                toks.append(tok)
                lps.append(logp.gather(-1, tok[:, None])[:, 0])
            return torch.stack(toks), torch.stack(lps)

        tok_buf, pos_buf = first.clone(), positions[0].clone()
        rope_buf = ropes[0].clone()
        s0_buf = s0s[0].clone() if huginn else None

        def static() -> tuple[Tensor, Tensor]:
            nxt, lp = decode_step(model, cache, tok_buf, pos_buf, rope_buf, s0_buf, depth, mode)
            tok_buf.copy_(nxt)
            return nxt, lp

        def run_loop(step: Any) -> tuple[Tensor, Tensor]:
            tok_buf.copy_(first)
            toks, lps = [], []
            for t in range(n_tok):
                pos_buf.copy_(positions[t])
                rope_buf.copy_(ropes[t])
                if s0_buf is not None:
                    s0_buf.copy_(s0s[t])  # type: ignore[arg-type]
                nxt, lp = step()
                toks.append(nxt.clone())
                lps.append(lp.clone())
            return torch.stack(toks), torch.stack(lps)

        def timed(fn: Any) -> tuple[float, tuple[Tensor, Tensor]]:
            times = []
            res = None
            for _ in range(2):  # first pass warms up (allocator, cuBLAS handles); then timed
                restore(cache, base)
                if cuda:
                    torch.cuda.synchronize()
                t_start = time.perf_counter()
                res = fn()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t_start)
            assert res is not None
            return times[-1] / n_tok * 1e3, res

        engine_ms, (tok_e, lp_e) = timed(run_engine)
        eager_ms, (tok_s, lp_s) = timed(lambda: run_loop(static))
        res: dict[str, Any] = {}
        if cuda:
            restore(cache, base)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    static()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g_nxt, g_lp = static()

            def replay() -> tuple[Tensor, Tensor]:
                graph.replay()
                return g_nxt, g_lp

            reps = [timed(lambda: run_loop(replay)) for _ in range(3)]
            graph_ms = statistics.median(r[0] for r in reps)
            tok_g, lp_g = reps[-1][1]
            graph_diff = float((lp_g - lp_s).abs().max())
            res.update(
                graph_ms_per_step=round(graph_ms, 4),
                graph_tokens_per_s=round(b / graph_ms * 1e3, 1),
                speedup_graph_vs_eager=round(eager_ms / graph_ms, 3),
                speedup_graph_vs_engine=round(engine_ms / graph_ms, 3),
                max_abs_logp_graph_vs_eager=graph_diff,
                same_tokens_graph_vs_eager=bool(torch.equal(tok_g, tok_s)),
            )
        eng_diff = float((lp_s - lp_e).abs().max())
        ok = eng_diff <= 1e-6 and bool(torch.equal(tok_s, tok_e))
        if cuda:
            ok = ok and res["max_abs_logp_graph_vs_eager"] <= 1e-6
            ok = ok and res["same_tokens_graph_vs_eager"]
    print(json.dumps({
        "bench": "decode_graph", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "shape": s, "depth": depth, "mode": mode, "dtype": "fp32",
        "batch": b, "prompt": p0, "decode_steps": n_tok, "build_s": round(build_s, 1),
        "engine_ms_per_step": round(engine_ms, 4), "eager_ms_per_step": round(eager_ms, 4),
        "eager_tokens_per_s": round(b / eager_ms * 1e3, 1),
        "speedup_eager_vs_engine": round(engine_ms / eager_ms, 3), **res,
        "max_abs_logp_eager_vs_engine": eng_diff,
        "same_tokens_eager_vs_engine": bool(torch.equal(tok_s, tok_e)), "ok": ok,
    }))  # fmt: skip
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
