"""The torch engine's fixed-depth decode, ``chunk`` tokens a row per CUDA graph replay
(``generators.decode_chunk`` > 1; `TorchEngine`'s graph path when every request of the call
samples alike).

One token a replay (generator.torch_engine.ahead) leaves the host a turn per token: read the
positions, build the RoPE rows and the latent noise, replay, draw, copy back, file (a few dozen
torch calls and a loop over the rows). Before the look-ahead that host work left the card idle
for 1.4 s of a 4.9 s generation at 1b (docs/PERFORMANCE.md); the look-ahead hides it while the
process has the interpreter to itself, not when another thread of it wants the interpreter too
(generators.placement=thread: the learner's compiled step launches from Python), where each
of those calls can wait for the other thread. Here ``chunk`` steps run in one replay with no
host work between them:

    for each of the chunk's steps (all on the device, captured once):
        p      = min(position, length - 1)               (a row past its end stays in its row)
        rope   = the RoPE table [length] at p             (models' rope of every position, once)
        noise  = latent_noise_cuda(seed, p, check=False)  (Huginn: the spec's bits)
        logits = decode_step(token, p, rope, noise)       (models.engine.graph: the 1-step graph's)
        token, log-prob = the draw (every row, one temperature and top_p; step + 1)
        position + 1
    the chunk's tokens and log-probs [2, chunk, B] -> a pinned host buffer (async)

The host files chunk c's tokens while chunk c + 1 runs. A request that finishes inside a chunk
(a stop token, max_tokens) has its later tokens of that chunk and of the one already launched
dropped (up to 2 x chunk - 1 wasted steps for that row), so the key suits long completions; a
free slot with requests waiting ends the look-ahead for one chunk, as in the 1-step path.
Records are the 1-step path's bit for bit in exact numerics (the same decode_step, the same
draw per row, RoPE rows and noise computed per position as there: tests/generator/
test_decode_chunk.py compares the two); every token of a chunk records the version its replay
ran with (`inflight_updates` swap between replays).

Sampling: the draw runs over every row with one (temperature, top_p) (greedy: argmax of the
temperature-1 log-probs, as the 1-step path draws a greedy row); a call whose requests differ
there decodes one token a replay (`uniform_sampling`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

from generator.torch_engine.ahead import Flight, file_tokens, refill
from models.engine.chunk import KVCache, _seed_tensor
from models.engine.graph import captured_or_eager, compiled_regions, decode_step, warm_on_side
from models.kernels.draw import draw_step
from models.kernels.noise import latent_noise_cuda
from models.seeds import seed_to_i64

__all__ = ["ChunkGraph", "decode_chunks", "uniform_sampling"]


def uniform_sampling(reqs: list[Any]) -> tuple[float, float, bool] | None:
    """(temperature, top_p, greedy) every request of a call samples with, keyed as the 1-step
    draw groups rows ((1, 1) for greedy); None when they differ (or there are none)."""
    keys = {(1.0, 1.0, True) if r.work.temperature == 0
            else (float(r.work.temperature), float(r.work.top_p), False) for r in reqs}  # fmt: skip
    return keys.pop() if len(keys) == 1 else None


class ChunkGraph:
    """``chunk`` fixed-depth decode steps with the draw and the feed, over one cache, captured
    once on CUDA (eager on the CPU or with ``graph=False``: the same ops on the same buffers).
    Static inputs the host writes before a replay: ``tokens`` (each row's next input),
    ``positions`` (its position), ``keys`` / ``steps`` (its sampler key and drawn count),
    ``seeds`` (its latent seed); outputs ``out`` [2, chunk, B] float64 (tokens, log-probs)."""

    def __init__(self, model: Any, cache: KVCache, *, depth: int, chunk: int, mode: str,
                 sampling: tuple[float, float, bool], vocab: int, graph: bool | None = None,
                 compile: bool = False, warmup: int = 2) -> None:  # fmt: skip
        dev = cache.filled.device
        bsz, self.length = cache.filled.shape
        self.model, self.cache, self.depth, self.chunk, self.mode = model, cache, depth, chunk, mode
        self.sampling, self.vocab, self.warmup = sampling, vocab, warmup
        self.graphed = dev.type == "cuda" if graph is None else graph
        self.regions = compiled_regions() if compile else None
        self.tokens = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.keys = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.seeds = torch.zeros(bsz, dtype=torch.int64, device=dev)
        with torch.no_grad():  # every position's RoPE rows, as the 1-step path computes them
            self.table = model.rope(torch.arange(self.length, device=dev), mode).to(dev).clone()
        self.out = torch.zeros(2, chunk, bsz, dtype=torch.float64, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None

    def _draw(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        temp, top_p, greedy = self.sampling
        tok, picked = draw_step(logits, self.vocab, temp, top_p, self.mode,
                                None if greedy else self.keys, None if greedy else self.steps)  # fmt: skip
        self.steps.add_(1)
        return tok, picked

    def _run(self) -> None:
        tok, pos = self.tokens, self.positions
        noisy = bool(getattr(self.model, "draws_latent_noise", False))
        for j in range(self.chunk):
            p = pos.clamp(max=self.length - 1)
            noise = (latent_noise_cuda(self.seeds, p, self.model.hidden_size, check=False)
                     if noisy else None)  # fmt: skip
            out = decode_step(self.model, self.cache, tok, p, self.table[p], [0] * tok.shape[0],
                              depth=self.depth, mode=self.mode, noise=noise,
                              regions=self.regions)  # fmt: skip
            tok, lp = self._draw(out.logits[:, 0])
            self.out[0, j].copy_(tok)
            self.out[1, j].copy_(lp)
            pos = pos + 1
        self.tokens.copy_(tok)
        self.positions.copy_(pos)

    def run(self) -> None:
        """One chunk: replay the graph (captured at the first call) or run it eagerly."""
        if not self.graphed:
            self._run()
            return
        if self._graph is None:
            self._capture()
            if not self.graphed:  # (the capture failed: eager from now on)
                self._run()
                return
        assert self._graph is not None
        self._graph.replay()

    def _capture(self) -> None:
        kept = [t.clone() for t in (self.tokens, self.positions, self.steps)]

        def warm() -> None:  # each warm-up writes this chunk's K/V as the replay will
            for _ in range(self.warmup):
                self._reset(kept)
                self._run()

        def drop_compiled() -> bool:
            had, self.regions = self.regions is not None, None
            return had

        warm_on_side(self.cache.filled.device, warm, drop_compiled)
        self._reset(kept)  # the warm-ups' feed undone: the replay starts where the host put it
        got = captured_or_eager(self._run, "decode_chunk")
        self._graph = None if got is None else got[0]
        self.graphed = got is not None

    def _reset(self, kept: list[Tensor]) -> None:
        for t, k in zip((self.tokens, self.positions, self.steps), kept, strict=True):
            t.copy_(k)


def decode_chunks(eng: Any, cache: KVCache, slots: list[Any], waiting: deque[Any],
                  run: ChunkGraph) -> None:  # fmt: skip
    """Decode every request in ``slots`` and ``waiting`` (a TorchEngine's, ``eng``) on
    ``cache`` by ``run``'s chunks, one chunk ahead of the host (module docstring)."""
    bsz, dev = len(slots), eng.device
    cuda = dev.type == "cuda"
    backs = [torch.zeros(2, run.chunk, bsz, dtype=torch.float64, pin_memory=cuda)
             for _ in range(2)]  # fmt: skip
    flight: Flight | None = None
    fresh = True  # the device state is to be built from the requests
    turn = 0
    while True:
        if eng.inflight_updates:
            eng._apply_swap()  # a version loaded meanwhile: in before the next replay
        if fresh or (waiting and any(s is None for s in slots)):
            file_tokens(eng, flight, slots)  # (re)fill: the chunk in flight filed first
            flight = None
            if not refill(eng, cache, slots, waiting):
                if waiting:
                    continue
                return
            _state(run, slots)
            fresh = False
        rows = [s if s is not None and not s.finish else None for s in slots]
        if all(r is None for r in rows):
            file_tokens(eng, flight, slots)
            flight = None
            if not waiting and all(s is None for s in slots):
                return
            fresh = True
            continue
        run.run()
        back = backs[turn % 2]
        turn += 1
        back.copy_(run.out, non_blocking=cuda)
        launched = Flight.launched(rows, back, int(eng.weight_version), cuda)
        file_tokens(eng, flight, slots)  # the previous chunk's, while this one runs
        flight = launched


def _state(run: ChunkGraph, slots: list[Any]) -> None:
    """The rows' next input, position, sampler key and count, and latent seed, from the
    requests (after a refill); idle rows feed token 0 at position 0."""
    live = [s is not None for s in slots]
    tok = [s.tokens[-1] if s is not None else 0 for s in slots]
    pos = [len(s.prompt) + len(s.tokens) - 1 if s is not None else 0 for s in slots]
    keys = [seed_to_i64(int(s.key)) if s is not None else 0 for s in slots]
    steps = [len(s.tokens) if s is not None else 0 for s in slots]
    dev = run.tokens.device
    run.tokens.copy_(torch.tensor(tok, dtype=torch.int64))
    run.positions.copy_(torch.tensor(pos, dtype=torch.int64))
    run.keys.copy_(torch.tensor(keys, dtype=torch.int64))
    run.steps.copy_(torch.tensor(steps, dtype=torch.int64))
    run.seeds.copy_(_seed_tensor([s.seed if s is not None else 0 for s in slots], dev))
    assert any(live)
