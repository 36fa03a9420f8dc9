"""A STAND-IN, not the product's path: what depth batching could cost per token with every core
iteration in a CUDA graph (the goal: 0.6x the fixed depth's time per token at mean depth
D/2). One JSON line.

    python benchmarks/depth_graphs.py --device cuda --batch 256 --depth 16     # one H200
    python benchmarks/depth_graphs.py --device cpu --tiny                       # a smoke run

The torch engine's adaptive decode is launch-bound on the GPU (docs/PERFORMANCE.md: 58,000
kernel launches for 16 tokens of 256 requests, 5x the CUDA-graph fixed-depth decode). This
measures the design meant to replace it, before it is built into the engine: decode steps of
`--batch` rows (the torch_depth.py module: Ouro-like, random weights) where

- `graph_fixed` is the product's fixed-depth decode (`models.engine.graph.GraphDecoder`, D
  iterations of every row in one graph);
- `buckets:<schedule>` runs one captured graph per (core iteration i, bucket m): the running
  rows' indices (padded to m, a multiple of batch / `--buckets`, with a scratch row whose
  cache and state absorb the padding's writes) gather the state, core_in / the core blocks /
  core_out run on m rows, their K/V are written and attention reads the gathered cache rows,
  the state is scattered back; before that every row's K/V at the step's position is carried
  from slot i - 1 into slot i (last_exited: an exited token's later slots hold its exit
  iteration's K/V; the running rows then overwrite theirs; an iteration no row runs is the carry
  alone); the prelude + initial state and the readout (coda,
  head) are one graph each, on every row.

What it leaves out (why it is a stand-in): the exit depths come from a schedule known on the
host (geometric exits of mean D/2 and D/4, as torch_depth.py's constant gate gives, drawn per
row and token), so no per-iteration device-to-host read of the running count (one ~20-50 us
sync an iteration in a real policy) and no exit policy arithmetic (gate, uniforms, exit
log-probs: a few small kernels an iteration inside the graph); no sampling or engine
bookkeeping (per step the same on both paths). Values are not compared with run_chunk here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.torch_depth import add_shape_args, build  # noqa: E402


def schedule(kind: str, rows: int, steps: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """[steps, rows] exit depths: fixed = D; half / quarter: geometric (exit chance p after
    each iteration) capped at D, p solved for a mean of D/2 or D/4."""
    if kind == "fixed":
        return torch.full((steps, rows), depth, dtype=torch.int64)
    want = depth / (2 if kind == "half" else 4)
    lo, hi = 1e-6, 1.0 - 1e-9
    for _ in range(60):  # mean of min(Geometric(p), D) = (1 - (1 - p)^D) / p
        p = (lo + hi) / 2
        if (1 - (1 - p) ** depth) / p > want:
            lo = p
        else:
            hi = p
    u = torch.rand(steps, rows, generator=gen, dtype=torch.float64)
    d = torch.floor(torch.log1p(-u) / math.log1p(-p)).to(torch.int64) + 1
    return d.clamp(1, depth)


class Buckets:
    """The per-(iteration, bucket) graphs of the module doc on one cache of batch + 1 rows."""

    def __init__(self, model: Any, batch: int, length: int, depth: int, prompt: int,
                 buckets: int, graphed: bool) -> None:  # fmt: skip
        from models.engine.chunk import KVCache

        self.model, self.b, self.depth, self.graphed = model, batch, depth, graphed
        self.rows_kernel = graphed  # CUDA: Triton's decode kernel with a row index
        self.quant = max(1, batch // buckets)
        self.cache = KVCache.empty(model, batch + 1, length, depth)
        dev = self.cache.filled.device
        self.dev = dev
        self.cache.filled[:, :prompt] = True
        with torch.no_grad():
            for t in (self.cache.prelude, self.cache.core, self.cache.coda):
                t.normal_(0.0, 0.5)
        n = batch + 1
        self.rows = torch.arange(n, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.full((n,), prompt, dtype=torch.int64, device=dev)
        h = model.hidden_size
        dt = self.cache.core.dtype
        self.e = torch.zeros(n, h, dtype=dt, device=dev)
        self.state = torch.zeros(n, h, dtype=dt, device=dev)
        self.exit_at = torch.zeros(n, dtype=torch.int64, device=dev)
        with torch.no_grad():  # RoPE rows: computed before the replays (a family's bounds
            self.rope = model.rope(self.pos, "fast").clone()  # check reads the host)
        self.idx = torch.full((depth, batch), batch, dtype=torch.int64, device=dev)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[Any, Any] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphed else None

    # ---- the captured pieces ---------------------------------------------------------------
    def _rows(self) -> Any:
        from models.engine.chunk import _key_mask, _Rows

        kmask = _key_mask(self.cache.filled, self.pos[:, None])
        return _Rows(self.b + 1, 1, self.rows, self.pos, kmask, self.rope, "fast")

    def _pre(self) -> None:
        from models.engine.chunk import _stack

        m = self.model
        self.cache.filled.index_put_((self.rows, self.pos), torch.ones((), dtype=torch.bool,
                                                                       device=self.dev))  # fmt: skip
        r = self._rows()
        x0 = m.embed(self.tokens).to(self.cache.core.dtype)
        e = _stack(m.prelude_blocks(), self.cache.prelude, x0, None, r)
        self.e.copy_(e)
        self.state.copy_(m.initial_state(e, self.pos, [0] * (self.b + 1), None).to(e.dtype))

    def _iteration(self, i: int, width: int) -> None:
        from models import numerics as nx
        from models.engine.chunk import _key_mask, _post, _qkv

        m, cache = self.model, self.cache
        if i:  # last_exited: every row's K/V of this position carried from the slot before
            cache.core[i, :, :, self.rows, self.pos] = cache.core[i - 1, :, :, self.rows, self.pos]
        if not width:  # no row runs: the carry alone (later tokens' queries read this slot)
            return
        idx = self.idx[i, :width]
        p = self.pos.index_select(0, idx)
        rope = self.rope.index_select(0, idx)
        kmask = _key_mask(cache.filled.index_select(0, idx), p[:, None])
        x = m.core_in(self.state.index_select(0, idx), self.e.index_select(0, idx), "fast")
        for layer, blk in enumerate(m.core_blocks()):
            q, k, v = _qkv(blk, x, rope, "fast")
            cache.core[i, layer, 0, idx, p] = k
            cache.core[i, layer, 1, idx, p] = v
            qv = q.view(width, 1, blk.n_heads, blk.head_dim)
            if self.rows_kernel:  # the decode kernel reads each query's cache row itself
                from models.engine.attention import decode_attention

                attn = decode_attention(qv, cache.core[i, layer, 0], cache.core[i, layer, 1],
                                        kmask, rows=idx)  # fmt: skip
            else:
                kk = cache.core[i, layer, 0].index_select(0, idx)
                vv = cache.core[i, layer, 1].index_select(0, idx)
                attn = nx.attention(qv, kk, vv, kmask, "fast")
            x = _post(blk, x, attn.reshape(width, -1), "fast")
        self.state.index_copy_(0, idx, m.core_out(x, "fast"))

    def _readout(self) -> None:
        from models.engine.chunk import _readout

        self.logits = _readout(self.model, self.cache, self.state, None, self._rows())[0]

    def _run(self, key: Any) -> None:
        fn = {"pre": self._pre, "readout": self._readout}.get(key)
        if fn is None:
            self._iteration(*key)
        else:
            fn()
        if not self.graphed:
            return
        g = self.graphs.get(key)
        if g is None:  # (the eager call above was its warm-up)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                if fn is None:
                    self._iteration(*key)
                else:
                    fn()
            self.graphs[key] = g

    def replay(self, key: Any) -> None:
        g = self.graphs.get(key) if self.graphed else None
        if g is None:
            self._run(key)
        else:
            g.replay()

    @torch.no_grad()
    def step(self, exits: torch.Tensor, position: int) -> None:
        """One decode step of every row at ``position`` with exit depths ``exits`` [batch]."""
        table = torch.full((self.depth, self.b), self.b, dtype=torch.int64)
        widths = []
        for i in range(self.depth):
            run = torch.nonzero(exits > i)[:, 0]
            if run.numel() == 0:
                widths.append(0)
                continue
            table[i, : run.numel()] = run
            widths.append(min(self.b, -(-run.numel() // self.quant) * self.quant))
        self.idx.copy_(table)
        self.exit_at[: self.b].copy_(exits)
        self.pos.fill_(position)
        self.rope.copy_(self.model.rope(self.pos, "fast"))
        self.replay("pre")
        for i, w in enumerate(widths):
            self.replay((i, w))
        self.replay("readout")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", default="auto")
    add_shape_args(ap, batch=256)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per pass")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", type=int, default=8)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" \
        else torch.device(a.device)  # fmt: skip
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = build(a, dev, dtype)
    from models import numerics as nx
    from models.engine.chunk import KVCache
    from models.engine.graph import GraphDecoder

    length = a.prompt + a.steps + 1
    gen = torch.Generator().manual_seed(7)
    scheds = {k: schedule(k, a.batch, a.steps, a.depth, gen) for k in ("fixed", "half", "quarter")}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    results: dict[str, list[float]] = {}
    with torch.no_grad(), nx.fused_generation(True):
        cache = KVCache.empty(model, a.batch, length, a.depth)
        cache.filled[:, : a.prompt] = True
        fixed = GraphDecoder(model, cache, [0] * a.batch, depth=a.depth, mode="fast",
                             graph=cuda)  # fmt: skip
        toks = torch.zeros(a.batch, dtype=torch.int64, device=dev)
        bk = Buckets(model, a.batch, length, a.depth, a.prompt, a.buckets, cuda)

        def run_fixed() -> None:
            for s in range(a.steps):
                fixed.step(toks, torch.full((a.batch,), a.prompt + s, dtype=torch.int64))

        def run_buckets(kind: str) -> None:
            for s in range(a.steps):
                bk.step(scheds[kind][s], a.prompt + s)

        runs = {"graph_fixed": run_fixed}
        for kind in scheds:
            runs[f"buckets:{kind}"] = lambda kind=kind: run_buckets(kind)
        t0 = time.perf_counter()
        for fn in runs.values():  # warm: every graph captured
            fn()
        sync()
        warm_s = time.perf_counter() - t0
        for _ in range(a.reps):
            for name, fn in runs.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                results.setdefault(name, []).append(time.perf_counter() - t)
    best = {k: min(v) / (a.steps * a.batch) * 1e3 for k, v in results.items()}
    base = best["graph_fixed"]
    rows = [dict(config=k, ms_per_token=round(v, 5), vs_graph_fixed=round(v / base, 3),
                 mean_depth=round(float(scheds[k.split(":")[1]].float().mean()), 2)
                 if ":" in k else float(a.depth))
            for k, v in best.items()]  # fmt: skip
    print(json.dumps(dict(
        bench="depth_graphs", stand_in=True, device=str(torch.cuda.get_device_name() if cuda
                                                        else "cpu"),
        dtype=str(dtype).replace("torch.", ""), batch=a.batch, depth=a.depth, steps=a.steps,
        buckets=a.buckets, graphs=len(bk.graphs), warm_s=round(warm_s, 1), rows=rows,
        command=" ".join(sys.argv),
    )), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
