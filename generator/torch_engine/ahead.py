"""The torch engine's fixed-depth graph decode one step ahead of the host (`TorchEngine`'s
graph path: a fixed depth, `models.engine.graph.GraphDecoder`).

Step by step, the host waited for each step's tokens (a device -> host read) before it
launched the next step, and the card idled while the host filed them (one request's take, its
finish, the next feed): 28% of a 1b generation's wall time on the H100 (256 rows, 512 tokens:
3.5 s of kernels in 4.9 s). Here the tokens a step draws stay on the device and are the next
step's input; the host files step t's tokens while step t + 1 runs:

    launch step t (tokens: step t - 1's draw, on the device; positions: the host's count)
    draw on the device (every row's, per (temperature, top_p) group, keyed as
        TorchEngine._sample_block keys them), copy tokens and log-probs to the host (async)
    file step t - 1's tokens (its copy done meanwhile): take, finish, free the slot

A row whose request finished at step t - 1 has run step t too (its output is dropped: the
host learns of a stop token one step late); a row that finished by length is fed at most one
position past its last, clamped into the cache (its own row, which the next prefill resets).
A free slot with requests waiting ends the look-ahead for one step: the step in flight is
filed, the prompts prefilled and their first tokens drawn as before, then the device state is
built again from the requests. Records are those of the step-by-step loop, bit for bit in exact
numerics (the draw of a row does not depend on the others: tests/generator/test_torch_engine.py
compares both against the reference); `inflight_updates` swap between two launches, each
token recording the version of the step that computed it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from models.engine.chunk import KVCache
from models.engine.graph import GraphDecoder
from models.kernels.draw import draw_step
from models.seeds import seed_to_i64

__all__ = ["Flight", "decode_ahead", "file_tokens", "refill"]


@dataclass
class _Sampler:
    """The rows' draw state on the device, built from the requests after each refill."""

    keys: torch.Tensor  # int64 [B]: each row's sampling key (u64 as two's complement)
    steps: torch.Tensor  # int64 [B]: tokens the row drew before (+1 after each draw)
    groups: list[tuple[float, float, torch.Tensor | None, torch.Tensor | None]]
    """(temperature, top_p, rows (None: every row), greedy flags of those rows (None: none))."""


@dataclass
class Flight:
    """A launched step (or chunk of steps, generator.torch_engine.chunked) whose tokens the
    host has not filed yet."""

    rows: list[Any]  # the request of each row at launch (None: idle)
    back: torch.Tensor  # float64 [2, k, B] on the host: k steps' tokens, their log-probs
    event: Any  # a CUDA event after the copy (None on the CPU: copied already)
    version: int  # the weight version of the forward

    @classmethod
    def launched(cls, rows: list[Any], back: torch.Tensor, version: int, cuda: bool) -> Flight:
        """The flight whose copies into the pinned ``back`` were just enqueued: on CUDA with
        an event recorded after them."""
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(rows, back, event, version)


def file_tokens(eng: Any, flight: Flight | None, slots: list[Any]) -> None:
    """The tokens of ``flight`` into its rows' requests, step by step; a request that
    finishes frees its slot and its later tokens are dropped (a row that finished before the
    launch is not in ``rows``: idle)."""
    if flight is None:
        return
    if flight.event is not None:
        flight.event.synchronize()
    toks, lps = flight.back.tolist()
    for b, r in enumerate(flight.rows):
        if r is None:
            continue
        for j in range(len(toks)):
            if r.finish:  # finished at an earlier step: its output dropped
                break
            r.depths.append(eng.full_depth)
            if r.take(int(toks[j][b]), lps[j][b], flight.version) and slots[b] is r:
                slots[b] = None


def refill(eng: Any, cache: KVCache, slots: list[Any], waiting: deque[Any]) -> bool:
    """Free slots take waiting requests, prefilled with their first tokens drawn; a request
    that first token finishes frees its slot again. Whether any slot holds a request."""
    bsz = len(slots)
    free = [b for b in range(bsz) if slots[b] is None][: len(waiting)]
    for b in free:
        slots[b] = waiting.popleft()
    if free:
        eng._sample_rows(slots, eng._prefill(cache, slots, free))
    for b in range(bsz):
        if slots[b] is not None and slots[b].finish:
            slots[b] = None
    return any(s is not None for s in slots)


def _sampler(slots: list[Any], device: torch.device) -> _Sampler:
    bsz = len(slots)
    keys = torch.tensor([seed_to_i64(int(s.key)) if s is not None else 0 for s in slots],
                        dtype=torch.int64)  # fmt: skip
    steps = torch.tensor([len(s.tokens) if s is not None else 0 for s in slots], dtype=torch.int64)
    by: dict[tuple[float, float], list[int]] = {}
    for b, s in enumerate(slots):
        if s is not None:
            w = s.work
            key = (1.0, 1.0) if w.temperature == 0 else (float(w.temperature), float(w.top_p))
            by.setdefault(key, []).append(b)
    groups = []
    for (temp, top_p), rows in by.items():
        flags = [slots[b].work.temperature == 0 for b in rows]
        # every row in one group: the draw runs over the whole batch (idle rows dropped)
        idx = None if len(rows) == bsz else torch.tensor(rows, dtype=torch.int64, device=device)
        greedy = None if not any(flags) else torch.tensor(flags, device=device)
        groups.append((temp, top_p, idx, greedy))
    return _Sampler(keys.to(device), steps.to(device), groups)


def _draw(eng: Any, logits: torch.Tensor, smp: _Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's token and its log-prob [B] on the device (idle rows: anything)."""
    vocab = eng.model.vocab_size
    toks = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    picked = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for temp, top_p, idx, greedy in smp.groups:
        part = logits if idx is None else logits[idx]
        keys, steps = (smp.keys, smp.steps) if idx is None else (smp.keys[idx], smp.steps[idx])
        t, p = draw_step(part, vocab, temp, top_p, eng.numerics, keys, steps, greedy)
        if idx is None:
            toks, picked = t, p
        else:
            toks[idx], picked[idx] = t, p
    smp.steps += 1
    return toks, picked


def decode_ahead(eng: Any, cache: KVCache, slots: list[Any], waiting: deque[Any],
                 decoder: GraphDecoder | None) -> GraphDecoder | None:  # fmt: skip
    """Decode every request in ``slots`` and ``waiting`` (a TorchEngine's, ``eng``; typed
    loosely: that module imports this one) on ``cache`` by the fixed-depth graph step, one step
    ahead of the host (module docstring). Returns the decoder (created on first use, kept by
    the engine for its next call)."""
    bsz, dev = len(slots), eng.device
    length = int(cache.filled.shape[1])
    cuda = dev.type == "cuda"
    backs = [torch.zeros(2, 1, bsz, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
    tok_d = torch.zeros(bsz, dtype=torch.int64, device=dev)
    pos = [0] * bsz  # the position each row is fed at next (the host's count)
    smp: _Sampler | None = None
    flight: Flight | None = None
    turn = 0
    while True:
        if eng.inflight_updates:
            eng._apply_swap()  # a version loaded meanwhile: in before the next forward
        free = [b for b in range(bsz) if slots[b] is None]
        if smp is None or (free and waiting):  # (re)fill: file the step in flight first
            file_tokens(eng, flight, slots)
            flight = None
            if not refill(eng, cache, slots, waiting):
                if waiting:
                    continue
                return decoder
            smp = _sampler(slots, dev)
            tok_d.copy_(torch.tensor([s.tokens[-1] if s is not None else 0 for s in slots]))
            pos = [len(s.prompt) + len(s.tokens) - 1 if s is not None else 0 for s in slots]
        rows = [s if s is not None and not s.finish else None for s in slots]
        if not any(r is not None for r in rows):
            file_tokens(eng, flight, slots)
            flight = None
            if not waiting and all(s is None for s in slots):
                return decoder
            smp = None  # refill
            continue
        if decoder is None:
            seeds = [s.seed if s is not None else 0 for s in slots]
            decoder = GraphDecoder(eng.model, cache, seeds, depth=eng.full_depth,
                                   mode=eng.numerics, compile=eng.compile)  # fmt: skip
            eng._kept = (cache, decoder)
        decoder.seeds = [s.seed if s is not None else 0 for s in slots]
        fed = [min(pos[b], length - 1) if rows[b] is not None else 0 for b in range(bsz)]
        out = decoder.step(tok_d, torch.tensor(fed, dtype=torch.int64))
        toks, picked = _draw(eng, out.logits[:, 0], smp)
        tok_d.copy_(toks)  # the next step's input, on the device
        back = backs[turn % 2]
        turn += 1
        back[0, 0].copy_(toks, non_blocking=cuda)
        back[1, 0].copy_(picked, non_blocking=cuda)
        launched = Flight.launched(rows, back, int(eng.weight_version), cuda)
        file_tokens(eng, flight, slots)  # the previous step's, while this one runs
        flight = launched
        for b in range(bsz):
            if rows[b] is not None:
                pos[b] += 1
