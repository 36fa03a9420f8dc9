"""TorchEngine: the reference engine (`models.engine.chunk`) behind the generator loop, without vLLM.

`generators.engine: torch` (generator config `engine`) serves a checkpoint with the same
contract as `generator.engine.LoopedEngine` (`weight_version`, `generate(items)` ->
[item][sample] `Sample`, `load_weights(weights)`, `close()`), computed by the
project's own looped engine: `models.reference.build_model` + `models.checkpoint` weights,
`models.engine.chunk.run_chunk` (prefill and adaptive-depth decode, with depth batching: an exited
token stops costing core compute, kv='last_exited'), and at a fixed depth on CUDA the CUDA-graph
decode step (`models.engine.graph.GraphDecoder`; in fast numerics its blocks' qkv / post
compiled by torch.compile, `compile`; fused CUDA RMSNorm / RoPE kernels in fast numerics,
`models.numerics.fused_generation`; the cache and the captured graph kept for the next call
of the same shape). What it is for (docs/GENERATOR.md): a
generator on hosts where vLLM does not run (the lent GPU host), the exact-numerics generator on
a GPU, and the whole system on one GPU. It does not replace vLLM (no paged KV cache, no prefix
cache, no tensor parallelism, Python-level scheduling).

Records equal `models.reference.generate`'s for the same prompt, latent seed, sampling and
exit policy (tests/generator/test_torch_engine.py: bit for bit in exact numerics): the prompt
runs the full depth D (its last position, which samples token 0, consults the policy where
`models.exits.token0_follows_policy` says so), decode follows the exit policy, behaviour log-probs are
`models.reference.behaviour_logprobs` of the sampling position (greedy, temperature 0: at
temperature 1 and top_p 1, as the plugin records them), and tokens are drawn as the reference
draws them (`models.sampling.draw`, one batched draw a step on the engine's device, keyed by
`models.reference.sampling_seed(latent_seed, offset)` (offset 0, or a conversation's turn, given
by `generate(..., sampling_offsets)`) and the token's index).

Continuous batching of requests: one request per latent seed, `max_num_seqs` slots (rows of
one KV cache of `max_model_len` positions). A slot whose request finished takes the next
waiting request at once: its prompt is prefilled in a chunk of its own (the other rows
invalid there, so they cost nothing: depth batching), then it decodes with the rest. Rows
decode at their own positions. Latent noise: drawn by `models.noise` for the rows' (seed,
position) (the spec), on the CPU, then copied to the device.

Config keys of the vLLM engine it honours too: `kv_cache_mb` (`kv_cache_bytes`) is the cache
budget: a call's cache holds min(max_num_seqs, requests, budget // one row's bytes) rows (one
row: every K/V slot, prelude + core x depth + coda, of the call's length), and a budget that
holds no row is refused naming the key (at start when `max_model_len` is set); `seed` (engine
seed) is mixed into every sampler seed (`engine_sampling_seed`: 0 = the reference's draws).

Weights: `load_weights` (generator.torch_engine.weights.TorchWeights) takes a
`weights.verified.VerifiedWeights`, whose checked state (`generator.engine.checked_state`: a
version not newer or a digest mismatch refused, `WeightsRefused`, old version kept) it copies
into the parameters in
place (`models.checkpoint.load_into`; the CUDA graph reads parameters by address), between
`generate` calls (a lock); this host's /dev/shm copy is taken first (that module's doc).
`inflight_updates=True`: a version loaded while `generate` runs is checked on the loading
thread, copied to the device and swapped in between two decode steps (in place: a captured
graph reads it); each token's `Sample.token_versions` entry is the version whose forward
computed its distribution. Not with `ticks` (a swap there waits for the batch).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from generator.config import ENGINES
from generator.engine import Sample, WeightLoadError
from generator.torch_engine.ahead import decode_ahead
from generator.torch_engine.chunked import ChunkGraph, decode_chunks, uniform_sampling
from generator.torch_engine.requests import TorchRequest
from generator.torch_engine.ticks import check_ticks, generate_by_ticks, resolve_tick_graph
from generator.torch_engine.weights import TorchWeights
from models import numerics as nx
from models.base import LoopedLM
from models.checkpoint import load_checkpoint, load_config, load_into, read_config
from models.engine.chunk import KVCache, run_chunk
from models.engine.graph import GraphDecoder
from models.engine.tickgraph import GraphTicker
from models.exits import (
    ExitPolicy,
    FixedDepth,
    is_sampled,
    resolve_kv,
    resolve_max_depth,
    token0_follows_policy,
)
from models.reference import behaviour_logprobs, build_model, sampling_seed
from models.sampling import draw_tensor
from proto.records import WorkItem

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_sampling_seed(latent_seed: int, offset: int, seed: int) -> int:
    """The sampler key (models.sampling) of a completion on a torch engine of config `seed`
    (generators.seed):
    `models.reference.sampling_seed(latent_seed, offset)` at seed 0 (the reference's tokens),
    else that value xor the seed spread by the golden-ratio multiplier (another draw per engine
    seed; the latent noise does not depend on it, contract 1)."""
    base = sampling_seed(latent_seed, offset)
    return base ^ ((int(seed) * 0x9E37_79B9_7F4A_7C15) & 0xFFFF_FFFF_FFFF_FFFF)


_log = logging.getLogger(__name__)


def check_engine(name: str) -> str:
    """`name` if it is a known generator engine, else ValueError in one line."""
    if name not in ENGINES:
        raise ValueError(f"generators.engine must be one of {ENGINES}, got {name!r}")
    return name


class TorchEngine(TorchWeights):
    """The reference engine as a generator engine (see module doc).

    dtype: 'auto' (float32; bfloat16 on CUDA when the checkpoint says so), 'float32' or
    'bfloat16' (fast numerics only). device: 'auto' (CUDA when available) or a torch device.
    graph: None = the CUDA-graph decode exactly when the policy is a fixed depth on CUDA (or
    decode_chunk > 1).
    model: an already built reference module (benchmarks, tests; `model_dir` may then be None).
    ticks: k > 0 decodes adaptive depths by ticks (generator.torch_engine.ticks; exited rows read out
    every k ticks); 0 = one `run_chunk` per decoded token. tick_graph: the ticks at one shape,
    k of them per CUDA graph replay (`models.engine.tickgraph.GraphTicker`); None = on CUDA
    where the policy decides on the device (not KL / EntropyDiff). readout_rows: with
    tick_graph, at most this many exited rows read out a step (the head and the draw on them
    alone; `GraphTicker`); None = every row of the batch. decode_chunk: k > 1 tokens a row per
    replay of the fixed-depth graph decode (generator.torch_engine.chunked; on the CPU, where
    graph None then means the graph path, its steps run eagerly); 1 = one a replay.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None,
        *,
        numerics: str = "fast",
        exit_policy: ExitPolicy | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        weight_version: int = 0,
        graph: bool | None = None,
        model: torch.nn.Module | None = None,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        compile: bool | None = None,
        ticks: int = 0,
        tick_graph: bool | None = None,
        readout_rows: int | None = None,
        inflight_updates: bool = False,
        decode_chunk: int = 1,
    ) -> None:
        nx.check_mode(numerics)
        self.numerics, self.model_dir = numerics, str(model_dir or "")
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" \
            else torch.device(device)  # fmt: skip
        hf = read_config(self.model_dir) if model_dir is not None else {}
        if model is not None and dtype == "auto":  # a built module keeps its dtype
            dtype = {v: k for k, v in _DTYPES.items()}.get(next(model.parameters()).dtype, "")
        torch_dtype = self._dtype(dtype, hf, dev)
        if model is None:
            if model_dir is None:
                raise ValueError("TorchEngine needs a checkpoint directory (or a built model)")
            model = build_model(load_config(self.model_dir))
            load_into(model, load_checkpoint(self.model_dir)[1])
        self.model: LoopedLM = cast(LoopedLM, model.to(device=dev).eval())
        for p in self.model.parameters():  # parameters only: Huginn's RoPE table stays fp32
            p.data = p.data.to(torch_dtype)
        self.device, self.dtype = dev, torch_dtype
        self.stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        """The stream current where the engine was built: its device work (generation, weight
        loads) runs there (a generator thread's own: pipeline.commands.generator_threads)."""
        self.policy = exit_policy if exit_policy is not None else FixedDepth(self.model.max_depth)
        self.sampled = is_sampled(self.policy)  # exits drawn from the gate, log-probs kept
        self.full_depth = resolve_max_depth(self.policy, self.model.max_depth)
        self.kv = resolve_kv(self.policy, self.model.config)
        self.fixed = isinstance(self.policy, FixedDepth)
        self.token0_policy = token0_follows_policy(self.policy, self.model.config)
        """Token 0's position consults the policy (contract 2; Ouro, not Huginn)."""
        chunked = int(decode_chunk) > 1  # (on the CPU the graph path runs its steps eagerly)
        self.graph = (self.fixed and (dev.type == "cuda" or chunked)) if graph is None else graph
        if self.graph and not self.fixed:
            raise ValueError("TorchEngine(graph=True) needs a FixedDepth exit policy")
        self.ticks = check_ticks(int(ticks), self.kv, self.graph)
        self.tick_graph = resolve_tick_graph(tick_graph, self.ticks, self.policy, dev)
        if readout_rows is not None and not (self.tick_graph and 1 <= readout_rows):
            raise ValueError(f"readout_rows={readout_rows}: needs tick_graph and a value >= 1 "
                             "(None: every row)")  # fmt: skip
        self.readout_rows = readout_rows
        """At most this many exited rows read out a tick-graph step (capped at the batch)."""
        self.spare_slot = int(self.tick_graph)
        """Core slots beyond the depth: the fixed-shape ticks write idle rows' K/V there."""
        graphed = self.graph or (self.tick_graph and dev.type == "cuda")
        self.compile = (graphed and numerics == "fast" and dev.type == "cuda") if compile is None \
            else compile  # fmt: skip
        if self.compile and not (graphed and numerics == "fast"):
            raise ValueError("TorchEngine(compile=True) needs a graph decode (the fixed depth's "
                             "or the ticks') in fast numerics")  # fmt: skip
        if int(decode_chunk) < 1 or (int(decode_chunk) > 1 and (not self.graph or self.ticks)):
            raise ValueError(f"decode_chunk={decode_chunk}: must be >= 1, and > 1 only on the "
                             "fixed-depth graph decode (a full-depth exit policy, depth_ticks 0, "
                             "graph not off)")  # fmt: skip
        self.decode_chunk = int(decode_chunk)
        """Tokens a row decodes per graph replay on the fixed-depth path
        (generator.torch_engine.chunked; 1: one a replay, generator.torch_engine.ahead)."""
        self._kept: tuple[KVCache, GraphDecoder | GraphTicker | ChunkGraph | None] | None = None
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_mb must be >= 1, got {kv_cache_bytes} bytes")
        self.kv_cache_bytes = kv_cache_bytes
        if not 0 <= int(seed) < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self.seed = int(seed)
        self.rows_used = 0
        """Rows of the last `generate` call's KV cache (its concurrent requests)."""
        if max_model_len is not None:  # a budget too small for one row fails at start
            self._cache_rows(max_model_len, max_num_seqs)
        self.weight_version = weight_version
        self.broken = ""
        self._unchecked = False
        """The parameters hold a refused /dev/shm copy's bytes (replaced by the next load)."""
        self._pinned: torch.Tensor | None = None  # load_staged's buffer (CUDA)
        self.stage_shm: bool | None = None
        """/dev/shm copies: read and checked into a (pinned) buffer, then loaded (True), or
        copied out of the mapping while checked (False); None: the first on a GPU."""
        self.looped = True
        if inflight_updates and ticks:
            raise ValueError("inflight_updates swaps between decode steps of the chunk decode; "
                             "the tick decode (ticks > 0) swaps between batches only")  # fmt: skip
        self.inflight_updates = inflight_updates
        """A version loaded during `generate` is swapped in between two of its decode steps
        (per-token versions) instead of waiting for the batch to end."""
        self._swap: tuple[Mapping[str, torch.Tensor], int] | None = None  # checked, not yet in
        self._swap_lock = threading.Lock()
        self.on_swapped = None
        self._lock = threading.RLock()

    def row_bytes(self, length: int) -> int:
        """Bytes of one KV-cache row of `length` positions (every prelude, core x depth and
        coda slot: K and V, kv heads x head_dim, the parameters' dtype; `filled` included)."""
        g, d = self.model.kv_shape
        slots = len(self.model.prelude_blocks()) + len(self.model.coda_blocks())
        slots += (self.full_depth + self.spare_slot) * len(self.model.core_blocks())
        return length * (slots * 2 * g * d * self.dtype.itemsize + 1)

    def _cache_rows(self, length: int, want: int) -> int:
        """Rows of a cache of `length` positions: `want`, capped by the kv_cache_mb budget;
        ValueError naming the key when not even one row fits."""
        if self.kv_cache_bytes is None:
            return want
        per_row = self.row_bytes(length)
        fit = self.kv_cache_bytes // per_row
        if fit < 1:
            raise ValueError(
                f"generators.kv_cache_mb ({self.kv_cache_bytes / 2**20:g} MiB) holds no request of "
                f"{length} positions: the torch engine's cache needs {per_row / 2**20:.1f} MiB per "
                f"request at depth {self.full_depth} ({self.dtype}); raise kv_cache_mb or lower "
                "max_model_len / rollout.max_tokens"
            )
        return min(want, fit)

    def _dtype(self, dtype: str, hf: Mapping[str, Any], dev: torch.device) -> torch.dtype:
        if dtype == "auto":
            want = str(hf.get("torch_dtype", "float32"))
            dtype = "bfloat16" if dev.type == "cuda" and want == "bfloat16" else "float32"
            if self.numerics == "exact":
                dtype = "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
        if self.numerics == "exact" and dtype != "float32":
            raise ValueError("numerics exact computes in float32 (dtype auto or float32)")
        return _DTYPES[dtype]

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, items: Sequence[WorkItem], sampling_offsets: Sequence[int] | None = None
    ) -> list[list[Sample]]:
        """Sample every item `item.n` times (one request per latent seed); results in order.
        ``sampling_offsets``: per item, its samples' sampling-seed offset (None: 0; a
        conversation's turn, generator.multiturn; `models.reference.sampling_seed`)."""
        with self._lock, self.on_stream(), torch.no_grad(), \
                nx.fused_generation(self.numerics == "fast"):  # fmt: skip
            if self.broken:
                raise WeightLoadError(self.broken)
            return self._generate(items, sampling_offsets)

    def _requests(
        self, items: Sequence[WorkItem], offsets: Sequence[int] | None = None
    ) -> list[TorchRequest]:
        if offsets is not None and len(offsets) != len(items):
            raise ValueError(f"{len(offsets)} sampling offsets for {len(items)} work items")
        reqs = []
        for i, it in enumerate(items):
            if it.stop:
                raise ValueError(
                    f"work item {it.work_id}: stop strings need detokenization, which the torch "
                    "engine does not do (use stop_token_ids, or generators.engine: vllm)"
                )
            if it.eval_depth and not (self.fixed and it.eval_depth == self.full_depth):
                raise ValueError(
                    f"work item {it.work_id}: eval_depth {it.eval_depth} needs a "
                    f"FixedDepth({it.eval_depth}) engine (generator.depth_engines routes it)"
                )
            for j, s in enumerate(int(x) for x in it.latent_seeds):
                off = int(offsets[i]) if offsets is not None else 0
                key = engine_sampling_seed(s, off, self.seed)
                reqs.append(TorchRequest(i, j, s, [int(t) for t in it.prompt_tokens], it, key))
        return reqs

    def _generate(
        self, items: Sequence[WorkItem], offsets: Sequence[int] | None = None
    ) -> list[list[Sample]]:
        reqs = self._requests(items, offsets)
        if not reqs:
            return [[] for _ in items]
        need = max(len(r.prompt) + int(r.work.max_tokens) for r in reqs)
        length = need if self.max_model_len is None else self.max_model_len
        if need > length:
            raise ValueError(f"a prompt + max_tokens of {need} exceeds max_model_len {length}")
        bsz = self._cache_rows(length, min(self.max_num_seqs, len(reqs)))
        self.rows_used = bsz
        cache, decoder = self._cache(bsz, length)
        slots: list[TorchRequest | None] = [None] * bsz
        waiting = deque(reqs)
        pending: list[tuple[list[int], torch.Tensor]] = []  # slots and their logits [M, V]
        if self.ticks:  # generator.torch_engine.ticks: every row at its own iteration of its token
            kept = decoder if isinstance(decoder, GraphTicker) else None
            ticker = generate_by_ticks(self, reqs, cache, kept)
            if isinstance(ticker, GraphTicker) and ticker.graphed:
                self._kept = (cache, ticker)  # its captured graph, for the next call
            waiting.clear()
        elif self.graph:  # the fixed-depth graph step, one step (or chunk) ahead of the host
            assert not isinstance(decoder, GraphTicker)
            sampling = uniform_sampling(reqs) if self.decode_chunk > 1 else None
            run = None
            if sampling is not None:
                run = decoder if isinstance(decoder, ChunkGraph) \
                    and decoder.sampling == sampling else None  # fmt: skip
                if run is None:
                    try:  # (a RoPE table over the cache's positions: Huginn's has a bound)
                        run = ChunkGraph(self.model, cache, depth=self.full_depth,
                                         chunk=self.decode_chunk, mode=self.numerics,
                                         sampling=sampling, vocab=self.model.vocab_size,
                                         compile=self.compile)  # fmt: skip
                    except ValueError as e:
                        _log.warning("torch engine: decode_chunk %d not used (%s); one token a "
                                     "replay", self.decode_chunk, e)  # fmt: skip
                        self.decode_chunk = 1
                    else:
                        self._kept = (cache, run)
                        _log.info("torch engine: %d tokens a row per graph replay (%d rows, "
                                  "temperature %s, top_p %s)", run.chunk, len(slots),
                                  *sampling[:2])  # fmt: skip
            if run is not None:
                decode_chunks(self, cache, slots, waiting, run)
            else:
                step = decoder if isinstance(decoder, GraphDecoder) else None
                decode_ahead(self, cache, slots, waiting, step)
        while waiting or any(s is not None for s in slots):
            done = pending[:]  # logits of the last decode: drawn as the version that made them
            version = self.weight_version
            pending.clear()
            if self.inflight_updates:
                self._apply_swap()  # a version loaded meanwhile: in before the next forward
            free = [b for b in range(bsz) if slots[b] is None][: len(waiting)]
            for b in free:
                slots[b] = waiting.popleft()
            if free:
                self._sample_rows(slots, self._prefill(cache, slots, free))
            for rows, block in done:
                self._sample_block(slots, rows, block, version)
            live = [b for b in range(bsz) if slots[b] is not None and not slots[b].finish]  # type: ignore[union-attr]
            for b in range(bsz):  # finished requests free their slot
                if slots[b] is not None and slots[b].finish:  # type: ignore[union-attr]
                    slots[b] = None
            if not live:
                continue
            out = self._decode(cache, slots, live)
            pending.append(
                (live, out if len(live) == bsz else out[torch.tensor(live).to(out.device)])
            )
        if self.inflight_updates:
            self._apply_swap()
        results: list[list[Sample]] = [[None] * it.n for it in items]  # type: ignore[list-item]
        for r in reqs:
            results[r.item][r.sample] = self._record(r)
        return results

    def _cache(self, rows: int, length: int
               ) -> tuple[KVCache, GraphDecoder | GraphTicker | ChunkGraph | None]:  # fmt: skip
        """The call's KV cache, and its captured decoder: on the graph path, the previous
        call's when the shape is the same (its `filled` cleared: the old K/V are invisible and
        overwritten), so a graph is captured once per shape, not once per call."""
        kept, self._kept = self._kept, None
        if kept is not None and tuple(kept[0].filled.shape) == (rows, length):
            kept[0].filled.zero_()
            self._kept = kept
            return kept
        del kept  # (its memory is free for the new cache)
        cache = KVCache.empty(self.model, rows, length, self.full_depth + self.spare_slot)
        return cache, None

    def _prefill(
        self, cache: KVCache, slots: list[TorchRequest | None], rows: list[int]
    ) -> dict[int, torch.Tensor]:
        """The prompts of `rows` (their slots just taken) at full depth, in one chunk; the
        logits of each row's last prompt position."""
        bsz = len(slots)
        width = max(len(slots[b].prompt) for b in rows)  # type: ignore[union-attr]
        toks = torch.zeros(bsz, width, dtype=torch.int64)
        valid = torch.zeros(bsz, width, dtype=torch.bool)
        for b in rows:
            p = slots[b].prompt  # type: ignore[union-attr]
            cache.filled[b] = False  # the slot's earlier request is gone
            toks[b, : len(p)] = torch.tensor(p)
            valid[b, : len(p)] = True
        positions = torch.arange(width).expand(bsz, -1)
        seeds = [s.seed if s is not None else 0 for s in slots]
        take = set(rows)  # (other slots may be mid-request with longer prompts: not fed here)
        last = torch.tensor([len(s.prompt) - 1 if s is not None and b in take else 0
                             for b, s in enumerate(slots)])  # fmt: skip
        if self.token0_policy:  # positions 0..P-2 at D, then P-1 decoded with the policy
            head = valid & (positions < last[:, None])
            if bool(head.any()):
                run_chunk(self.model, cache, toks, positions, head, seeds,
                          max_depth=self.full_depth, depths=torch.full(toks.shape, self.full_depth),
                          mode=self.numerics, kv=self.kv)  # fmt: skip
            one = torch.zeros(bsz, 1, dtype=torch.bool)
            one[rows] = True
            feed = toks[torch.arange(bsz), last][:, None]
            out = run_chunk(self.model, cache, feed, last[:, None], one, seeds,
                            max_depth=self.full_depth, policy=self.policy, mode=self.numerics,
                            kv=self.kv)  # fmt: skip
            depths = out.depths[:, 0].tolist()
            for b in rows:
                slots[b].depths.append(int(depths[b]))  # type: ignore[union-attr]
            self._exit_lps(slots, rows, out.exit_logprobs)
            return {b: out.logits[b, 0] for b in rows}
        out = run_chunk(self.model, cache, toks, positions, valid, seeds,
                        max_depth=self.full_depth, depths=torch.full(toks.shape, self.full_depth),
                        mode=self.numerics, kv=self.kv)  # fmt: skip
        for b in rows:
            slots[b].depths.append(self.full_depth)  # type: ignore[union-attr]
        self._exit_lps(slots, rows, None)  # token 0 ran the full depth: no exit drawn
        return {b: out.logits[b, int(last[b])] for b in rows}

    def _exit_lps(self, slots: list[TorchRequest | None], rows: list[int], elp: Any) -> None:
        """A sampled exit: file each row's exit log-prob of this forward (0.0 without one)."""
        if not self.sampled:
            return
        for b in rows:
            slots[b].exit_lps.append(0.0 if elp is None else float(elp[b, 0]))  # type: ignore[union-attr]

    def _feed(self, slots: list[TorchRequest | None]) -> tuple[torch.Tensor, torch.Tensor]:
        toks = [s.tokens[-1] if s is not None and s.tokens else 0 for s in slots]
        pos = [len(s.prompt) + len(s.tokens) - 1 if s is not None and s.tokens else 0
               for s in slots]  # fmt: skip
        return torch.tensor(toks, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)

    def _decode(
        self, cache: KVCache, slots: list[TorchRequest | None], live: list[int]
    ) -> torch.Tensor:
        toks, pos = self._feed(slots)
        valid = torch.zeros(len(slots), 1, dtype=torch.bool)
        valid[live] = True
        seeds = [s.seed if s is not None else 0 for s in slots]
        out = run_chunk(self.model, cache, toks[:, None], pos[:, None], valid, seeds,
                        max_depth=self.full_depth, policy=self.policy, mode=self.numerics,
                        kv=self.kv)  # fmt: skip
        depths = out.depths[:, 0].tolist()
        for b in live:
            slots[b].depths.append(int(depths[b]))  # type: ignore[union-attr]
        self._exit_lps(slots, live, out.exit_logprobs)
        return out.logits[:, 0]

    def _sample_rows(
        self, slots: list[TorchRequest | None], logits: dict[int, torch.Tensor]
    ) -> None:
        """Draw each row's next token from its logits (module doc) and record it."""
        if logits:
            self._sample_block(slots, list(logits), torch.stack(list(logits.values())),
                               self.weight_version)  # fmt: skip

    def _sample_block(self, slots: list[TorchRequest | None], rows: list[int],
                      logits: torch.Tensor, version: int) -> None:  # fmt: skip
        """`_sample_rows` of rows ``rows`` whose logits are ``logits`` [len(rows), V]: one
        draw per (temperature, top_p) group on the logits' device (the draw's integer bits are
        the same on every device, models.sampling), tokens and their log-probs read back once."""
        groups: dict[tuple[float, float], list[int]] = {}
        for k, b in enumerate(rows):
            w = slots[b].work  # type: ignore[union-attr]
            key = (1.0, 1.0) if w.temperature == 0 else (float(w.temperature), float(w.top_p))
            groups.setdefault(key, []).append(k)
        vocab = self.model.vocab_size
        for (temp, top_p), ks in groups.items():
            part = (
                logits if len(ks) == len(rows) else logits[torch.tensor(ks, device=logits.device)]
            )
            lp = behaviour_logprobs(part, vocab, temp, top_p, self.numerics)
            reqs = [slots[rows[k]] for k in ks]
            toks_t = draw_tensor(lp, [r.key for r in reqs], [len(r.tokens) for r in reqs],  # type: ignore[union-attr]
                                 [r.work.temperature == 0 for r in reqs])  # type: ignore[union-attr]  # fmt: skip
            picked_t = lp.gather(1, toks_t[:, None])[:, 0]
            back = torch.stack([toks_t.to(torch.float64), picked_t.to(torch.float64)]).tolist()
            for j, k in enumerate(ks):
                r = slots[rows[k]]
                assert r is not None
                r.take(int(back[0][j]), back[1][j], version)

    def _record(self, r: TorchRequest) -> Sample:
        return Sample(
            tokens=np.asarray(r.tokens, dtype=np.int32),
            logprobs=np.asarray(r.logprobs, dtype=np.float32),
            exit_depths=np.asarray(r.depths[: len(r.tokens)], dtype=np.uint8),
            latent_seed=r.seed,
            weight_version=r.versions[0] if r.versions else self.weight_version,
            token_versions=np.asarray(r.versions, np.int64) if self.inflight_updates else None,
            finish_reason=r.finish or "length",
            full_depth=self.full_depth,
            exit_logprobs=np.asarray(r.exit_lps[: len(r.tokens)], dtype=np.float32)
            if self.sampled
            else None,
        )

    def close(self) -> None:
        """Release the caches (the model is kept: closing twice is harmless)."""
        self._kept = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["TorchEngine", "check_engine"]
