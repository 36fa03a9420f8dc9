"""The fixed-depth decode step without host syncs, and its CUDA graph.

`models.engine.chunk.run_chunk` decodes one token per row per chunk; at a fixed depth (every token
runs `depth` core iterations: `models.exits.FixedDepth`) its arithmetic has no data-dependent
control flow, yet it syncs with the host every chunk (boolean-mask K/V writes, `.any()`
checks, `.tolist()` of rows, the CPU latent noise), so it cannot be captured in a CUDA graph.
`decode_step` is that decode path with the syncs taken out: the same module calls in the same
order (`embed`, the prelude / core / coda stacks of `qkv` -> K/V write at the position ->
`numerics.attention` -> `post`, `initial_state`, `core_in` / `core_out`, `readout_in` /
`readout_out`, `head`), through the engine's own `_stack` / `_readout` / `_key_mask`, with K/V
written by integer indices and every row valid. At a fixed depth the two KV semantics
(contract 3) compute the same values (every token exits at `depth`), so one step serves both.
Its logits equal run_chunk's decode (tests/models/test_engine_graph.py: bit for bit on the
CPU in both numerics modes).

`GraphDecoder` owns the step's static inputs (token, position, RoPE rows, Huginn's latent
noise) and, on CUDA, captures the step once in a `torch.cuda.CUDAGraph` (warm-up on a side
stream first, as torch documents) and replays it per token; on the CPU (or `graph=False`) it
runs the very same step eagerly on the same buffers, so CPU tests exercise the graph's code.
What depends on (seed, position) and is not computed inside the graph, per step, before the
replay, then copied into the static buffers:

- the RoPE rows: `model.rope(positions)` on the device positions, as run_chunk computes them
  (Huginn's bounds check reads the positions on the host, and exact-mode split-half RoPE builds
  its fp64 table on the CPU: neither can live in a graph);
- Huginn's latent noise z (docs/CONTRACTS.md 1): on CUDA `models.kernels.noise.latent_noise_cuda`
  on the device positions (the spec's bits in one Triton kernel; its argument checks sync, so
  it runs before the replay, not in the graph), on the CPU `models.noise.latent_noise`, the
  spec, as run_chunk draws them; the graph computes s_0 = (z std) scale from the buffer.

The step's outputs are the graph's static output tensors: read (or clone) them before the next
step. The graph reads the cache and the parameters by address: keep the cache's tensors (write
into them in place only) and load new weights in place (`param.copy_`), or build a new
decoder. One decoder per cache; the capture happens at the first step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from models import numerics as nx
from models.engine.chunk import (
    ChunkOut,
    KVCache,
    Regions,
    _key_mask,
    _post,
    _qkv,
    _readout,
    _Rows,
    _seed_tensor,
    _stack,
)
from models.kernels.noise import latent_noise_cuda
from models.noise import latent_noise
from models.untraced import untraced

T = TypeVar("T")

if TYPE_CHECKING:
    from models.base import LoopedLM


def decode_step(
    model: LoopedLM,
    cache: KVCache,
    tokens: Tensor,
    positions: Tensor,
    rope: Tensor,
    seeds: Sequence[int],
    *,
    depth: int,
    mode: str = "fast",
    noise: Tensor | None = None,
    regions: Regions | None = None,
) -> ChunkOut:
    """One token per row at a fixed `depth`, every row valid, no host sync (see module doc).

    tokens, positions: [B] int64 on the cache's device; rope: `model.rope(positions, mode)`;
    seeds: the rows' latent seeds; noise: [B, h] the rows' `latent_noise` at `positions` (None:
    `initial_state` draws it, on the CPU: a sync, eager use only). Writes the rows' K/V at
    their positions and marks them filled, as run_chunk does for valid positions. Returns the
    chunk's logits [B, 1, V], hidden [B, 1, h] and depths [B, 1] (= depth). regions: the
    blocks' (qkv, post) compiled (`compiled_regions`), fast mode only."""
    bsz = tokens.shape[0]
    dev = cache.filled.device
    rows = torch.arange(bsz, device=dev)
    cache.filled.index_put_((rows, positions), torch.ones((), dtype=torch.bool, device=dev))
    kmask = _key_mask(cache.filled, positions[:, None])
    r = _Rows(bsz, 1, rows, positions, kmask, rope, mode, regions)
    x0 = model.embed(tokens).to(cache.core.dtype)  # the cache's (parameters') dtype
    e = _stack(model.prelude_blocks(), cache.prelude, x0, None, r)
    state = model.initial_state(e, positions, seeds, noise).to(e.dtype)  # (fp32 noise, cast)
    for i in range(depth):
        x = _stack(model.core_blocks(), cache.core[i], model.core_in(state, e, mode), None, r)
        state = model.core_out(x, mode)
    logits, hidden = _readout(model, cache, state, None, r)
    return ChunkOut(
        logits=logits.view(bsz, 1, -1),
        hidden=hidden.view(bsz, 1, -1),
        depths=torch.full((bsz, 1), depth, dtype=torch.int64, device=dev),
    )


_log = logging.getLogger(__name__)


def warm_on_side(dev: torch.device, warm: Callable[[], None],
                 drop_compiled: Callable[[], bool]) -> None:  # fmt: skip
    """``warm()`` on a side stream before a capture (as torch documents), once no other thread
    of the process traces (models.untraced); if it fails, ``drop_compiled()`` switches the
    caller to its eager blocks (False: there were none, and the error is raised), a warning is
    logged and ``warm()`` runs again. The current stream then waits for the side stream."""
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        try:
            untraced(warm)
        except Exception as exc:  # noqa: BLE001  (compilation failed: the eager blocks)
            if not drop_compiled():
                raise
            _log.warning("compiled blocks failed (%s: %s); eager blocks", type(exc).__name__,
                         exc)  # fmt: skip
            warm()
    torch.cuda.current_stream(dev).wait_stream(side)


class CaptureFailed(RuntimeError):
    """A capture invalidated every time it was tried (``captured``): the caller decodes eagerly."""


CAPTURE_ATTEMPTS = 4
"""How often ``captured`` tries a capture another thread's work invalidated."""


def _invalidated(exc: BaseException) -> bool:
    """A CUDA error of a capture sequence (``cudaErrorStreamCaptureInvalidated`` "operation
    failed due to a previous error during capture", ``...Unsupported`` "not permitted when
    stream is capturing", ...): another thread's synchronizing call, not the body's fault."""
    return "captur" in str(exc).lower()


def captured(body: Callable[[], T], *, attempts: int = CAPTURE_ATTEMPTS,
             pause_s: float = 0.2) -> tuple[torch.cuda.CUDAGraph, T]:  # fmt: skip
    """``body`` captured in a CUDA graph (once no other thread traces) and what it returned
    (its static outputs). thread_local: another thread of the process (the learner's, beside a
    generator thread) may allocate or synchronize while this one captures. Such a call can
    still invalidate the capture (a device-wide synchronization, a free: seen on an H100 with
    the learner training beside a generator thread), so an invalidated capture is tried again
    after a pause, ``attempts`` times in all; then ``CaptureFailed`` (the caller runs its body
    eagerly). A capture records and does not run, so a failed one changed no device state."""

    def capture() -> tuple[torch.cuda.CUDAGraph, T]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = body()
        return graph, out

    for i in range(1, attempts + 1):
        try:
            return untraced(capture)
        except Exception as exc:  # noqa: BLE001  (the CUDA error of an invalidated capture)
            if not _invalidated(exc):
                raise
            _log.warning("CUDA graph capture %d of %d invalidated (%s)", i, attempts,
                         str(exc).splitlines()[0][:200])  # fmt: skip
            if i == attempts:
                raise CaptureFailed(f"capture invalidated {attempts} times: {exc}") from exc
            time.sleep(pause_s * i)
    raise AssertionError("unreachable")


def captured_or_eager(body: Callable[[], T], what: str) -> tuple[torch.cuda.CUDAGraph, T] | None:
    """``captured(body)``, or None (logged, naming ``what``) when every attempt was
    invalidated: the caller then runs ``body`` eagerly from now on."""
    try:
        return captured(body)
    except CaptureFailed as e:
        _log.warning("%s: %s; eager from now on", what, e)
        return None


_REGIONS: list[Regions] = []


def compiled_regions() -> Regions:
    """The blocks' `qkv` and `post` under `torch.compile` (one pair per process, reused by every
    block and decoder: the modules' parameters are graph inputs, so blocks of one class and
    shape share the compiled code). What inductor fuses there (the RMSNorms, RoPE, residual
    adds, silu * up) rounds differently from the eager kernels: fast mode only (GraphDecoder
    refuses it in exact mode)."""
    if not _REGIONS:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _REGIONS.append((torch.compile(_qkv, dynamic=False), torch.compile(_post, dynamic=False)))
    return _REGIONS[0]


class GraphDecoder:
    """`decode_step` on static buffers: a CUDA graph replayed per token on CUDA, the same step
    eagerly on the CPU (see module doc).

    graph: None = a graph exactly when the cache is on CUDA; False = eager on any device
    (the benchmark's comparison); True = a graph (CUDA only). device_noise: Huginn's latent
    noise by `models.kernels.noise.latent_noise_cuda` on the cache's device (None: when that is not
    the CPU; the same bits as the CPU spec), else drawn on the CPU and copied. `seeds` (a list,
    one per row) may be reassigned between steps (a slot taking another request). warmup:
    eager runs of the step on a side stream before the capture (they rewrite the first step's
    K/V with the same values: the step is idempotent for the same inputs). compile: the
    blocks' qkv / post through `compiled_regions` (fast mode; the first warm-up compiles; if
    compiling fails there, a warning and the eager blocks).
    """

    def __init__(
        self,
        model: LoopedLM,
        cache: KVCache,
        seeds: Sequence[int],
        *,
        depth: int,
        mode: str = "fast",
        graph: bool | None = None,
        warmup: int = 2,
        device_noise: bool | None = None,
        compile: bool = False,
    ) -> None:
        nx.check_mode(mode)
        if compile and mode != "fast":
            raise ValueError("GraphDecoder(compile=True) is fast numerics only (exact: eager)")
        self.regions = compiled_regions() if compile else None
        dev = cache.filled.device
        bsz, self.length = cache.filled.shape
        if not 1 <= depth <= cache.core.shape[0]:
            raise ValueError(
                f"depth {depth} outside [1, {cache.core.shape[0]}] (the cache's slots)"
            )
        if len(seeds) != bsz:
            raise ValueError(f"need one latent seed per row: {len(seeds)} seeds, {bsz} rows")
        self.graphed = dev.type == "cuda" if graph is None else graph
        self.device_noise = dev.type != "cpu" if device_noise is None else device_noise
        if self.graphed and dev.type != "cuda":
            raise ValueError(f"a CUDA graph needs the cache on a CUDA device, not {dev}")
        self.model, self.cache, self.seeds = model, cache, [int(s) for s in seeds]
        self.depth, self.mode, self.warmup = depth, mode, warmup
        self.tokens = torch.zeros(bsz, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bsz, dtype=torch.int64, device=dev)
        with torch.no_grad():
            self.rope = model.rope(self.positions, mode).clone()
        self.noise = (
            torch.zeros(bsz, model.hidden_size, dtype=torch.float32, device=dev)
            if model.draws_latent_noise
            else None
        )
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: ChunkOut | None = None

    def _run(self) -> ChunkOut:
        return decode_step(
            self.model, self.cache, self.tokens, self.positions, self.rope, self.seeds,
            depth=self.depth, mode=self.mode, noise=self.noise, regions=self.regions,
        )  # fmt: skip

    def _capture(self) -> None:
        def drop_compiled() -> bool:
            had, self.regions = self.regions is not None, None
            return had

        warm_on_side(self.cache.filled.device, self._warm, drop_compiled)
        got = captured_or_eager(self._run, "GraphDecoder")
        if got is None:
            self.graphed = False
        else:
            self._graph, self._out = got

    def _warm(self) -> None:
        for _ in range(self.warmup):
            self._run()

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> ChunkOut:
        """Decode `tokens` [B] at absolute `positions` [B] (int64; positions best on the CPU,
        where the noise is drawn): fill the static buffers, then replay the graph (capturing it
        at the first call) or run the step eagerly. The outputs are overwritten by the next
        step."""
        pos = torch.as_tensor(positions, dtype=torch.int64).cpu().reshape(-1)
        if pos.shape != self.positions.shape:
            raise ValueError(
                f"positions {tuple(pos.shape)}: need one per row, {self.positions.shape}"
            )
        if int(pos.min()) < 0 or int(pos.max()) >= self.length:
            raise ValueError(f"positions must be in [0, {self.length}) (the cache's length)")
        self.tokens.copy_(torch.as_tensor(tokens, dtype=torch.int64).reshape(-1))
        self.positions.copy_(pos)
        self.rope.copy_(self.model.rope(self.positions, self.mode))
        if self.noise is not None and self.device_noise:  # the spec's bits, on the device
            seeds = _seed_tensor(self.seeds, self.noise.device)
            self.noise.copy_(latent_noise_cuda(seeds, self.positions, self.noise.shape[1]))
        elif self.noise is not None:
            self.noise.copy_(latent_noise(self.seeds, pos, self.noise.shape[1]))
        if not self.graphed:
            return self._run()
        if self._graph is None:
            self._capture()
            if not self.graphed:
                return self._run()
        assert self._graph is not None and self._out is not None
        self._graph.replay()
        return self._out


__all__ = [
    "CaptureFailed",
    "GraphDecoder",
    "captured",
    "captured_or_eager",
    "compiled_regions",
    "decode_step",
    "warm_on_side",
]
