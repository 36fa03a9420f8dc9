"""Side channel of the looped models: per-request exit depths, behaviour log-probs, versions.

Completion token t of a request with prompt length P is sampled from the logits of position
P - 1 + t. The book files, under the request's record key (`context.RECORD_KEY`):

- depth[t]: core iterations run at position P - 1 + t (written by the forward; depth[0] is
  the last prompt position's, which follows the exit policy where the family's official code
  does: contract 2);
- version[t]: the weight version of the forward that computed that position;
- logprob[t]: the behaviour log-prob of token t (contract 4). `compute_logits` keeps, per
  request, the behaviour log-prob row of its sampling position; the token it sampled arrives
  as the input of the request's next forward (or, for the last token, with `pop`), which
  gathers logprob[t] = row[token] if the row's position is P - 1 + t.

Rows are recomputed the same way after a preemption (recompute), so entries are idempotent; a
row waits, keyed by its position, until the token it sampled is fed (a recomputed prefill in
chunks brings rows of its own in between).
The engine wrapper calls `pop` (through `LLM.collective_rpc`) once per finished request; at
most `max_requests` requests are kept (oldest dropped) so direct vLLM use cannot leak memory.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from generator.vllm_plugin.context import StepBatch


@dataclasses.dataclass
class _Entry:
    prompt_len: int
    depths: dict[int, int] = dataclasses.field(default_factory=dict)
    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, float] = dataclasses.field(default_factory=dict)
    exit_logprobs: dict[int, float] = dataclasses.field(default_factory=dict)
    """A sampled exit (SampledGate): the exit's log-prob at each sampling position."""
    pending: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    """{sampling position: its fp32 behaviour log-prob row [V]} whose token is not filed yet.
    More than one: a request preempted right after it sampled is recomputed as a prefill in
    chunks, and each chunk's last position brings a row of its own before the chunk that feeds
    the sampled token (the row it needs is the one from before the preemption)."""

    def keep(self, pos: int, row: np.ndarray) -> None:
        """Keep ``row`` of position ``pos``; drop the rows whose token is filed."""
        self.pending[pos] = row
        for p in [p for p in self.pending if p - (self.prompt_len - 1) in self.logprobs]:
            del self.pending[p]


@dataclasses.dataclass
class Record:
    """What `pop` returns for one request (lists indexed by completion token)."""

    depths: list[int]
    logprobs: list[float]
    """NaN where unknown."""
    versions: list[int]
    exit_logprobs: list[float] | None = None
    """A sampled exit: each token's exit log-prob (NaN where unknown); None otherwise."""


class RecordBook:
    """Per-request records of one model instance (see module doc)."""

    def __init__(self, max_requests: int = 65536) -> None:
        self.max_requests = max_requests
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def _entry(self, key: str, prompt_len: int) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(prompt_len)
            while len(self._entries) > self.max_requests:
                self._entries.popitem(last=False)
        return entry

    def recorded_depths(self, step: StepBatch, positions: np.ndarray) -> np.ndarray:
        """int64 [T]: the recorded depth of each token's position (0 = none recorded)."""
        out = np.zeros(positions.shape[0], dtype=np.int64)
        for rs in step.requests:
            entry = self._entries.get(rs.key)
            if entry is None or not entry.depths:
                continue
            for row in range(rs.start, rs.end):
                d = entry.depths.get(int(positions[row]) - (rs.prompt_len - 1))
                if d is not None:
                    out[row] = d
        return out

    def on_forward(
        self,
        step: StepBatch,
        positions: np.ndarray,
        tokens: np.ndarray,
        depths: np.ndarray,
        version: int,
        exit_logprobs: np.ndarray | None = None,
    ) -> None:
        """File depth / version (and a sampled exit's log-prob: NaN = not decided in this
        forward, kept) of sampling positions and the log-prob of fed tokens."""
        pos_l, tok_l, dep_l = positions.tolist(), tokens.tolist(), depths.tolist()
        elp_l = None if exit_logprobs is None else exit_logprobs.tolist()
        for rs in step.requests:
            if rs.end <= rs.start:
                continue
            first = pos_l[rs.start]
            last = first + (rs.end - rs.start) - 1
            if last < rs.prompt_len - 1:
                continue  # a prompt chunk that samples nothing
            entry = self._entry(rs.key, rs.prompt_len)
            for pos in range(max(first, rs.prompt_len - 1), last + 1):
                row = rs.start + pos - first
                t = pos - (rs.prompt_len - 1)
                entry.depths[t] = dep_l[row]
                entry.versions[t] = version
                if elp_l is not None and elp_l[row] == elp_l[row]:  # (not NaN)
                    entry.exit_logprobs[t] = elp_l[row]
                if pos >= rs.prompt_len:
                    lp = entry.pending.pop(pos - 1, None)
                    if lp is not None:
                        entry.logprobs[t - 1] = float(lp[tok_l[row]])

    def on_logits(self, step: StepBatch, positions: np.ndarray, rows: list[np.ndarray]) -> None:
        """Keep the behaviour row of every request whose last scheduled position samples."""
        pos_l = positions.tolist()
        for rs, lp in zip(step.requests, rows):
            last = pos_l[rs.end - 1]
            if last >= rs.prompt_len - 1:
                self._entry(rs.key, rs.prompt_len).keep(last, lp)

    def pop(self, key: str, tokens: list[int]) -> Record | None:
        """Remove and return the record of `key` for its final completion `tokens`."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        n = len(tokens)
        if n and (n - 1) not in entry.logprobs:
            lp = entry.pending.get(entry.prompt_len - 1 + n - 1)
            if lp is not None:
                entry.logprobs[n - 1] = float(lp[int(tokens[-1])])
        return Record(
            depths=[entry.depths.get(t, 0) for t in range(n)],
            logprobs=[entry.logprobs.get(t, float("nan")) for t in range(n)],
            versions=[entry.versions.get(t, -1) for t in range(n)],
            exit_logprobs=[entry.exit_logprobs.get(t, float("nan")) for t in range(n)]
            if entry.exit_logprobs
            else None,
        )

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def pop_records(worker: Any, requests: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """`LLM.collective_rpc` callable: pop the records of (key, final tokens) pairs.

    Returns {key: (depths, logprobs, versions, exit log-probs or None) or None} (plain lists:
    picklable)."""
    model = worker.model_runner.get_model()
    book: RecordBook = model.record_book
    out: dict[str, Any] = {}
    for key, toks in requests:
        rec = book.pop(key, toks)
        out[key] = (None if rec is None
                    else (rec.depths, rec.logprobs, rec.versions, rec.exit_logprobs))  # fmt: skip
    return out


__all__ = ["Record", "RecordBook", "pop_records"]
