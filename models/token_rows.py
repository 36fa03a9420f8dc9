"""The token-row layout of a replay: one owner for every place that feeds recorded completions
back through a model (models.reference.replay, learner.replay.make_replay_batch,
learner.batching.build_batch and through it both learner policies).

Row b holds the model input ``prompt + response[:-1]``, right-padded to L; response token t is
predicted at position p = P - 1 + t (P = prompt length):

    input_ids[b, p]  token at p                        (0 on padding)
    targets[b, p]    response[t] at p = P - 1 + t      (0 elsewhere)
    mask[b, p]       True at p = P - 1 + t             (False elsewhere)
    depths[b, p]     the depth run at p (models.depths.position_depths: the row's full
                     depth D at prompt positions 0..P-2, exit_depths[t] at P - 1 + t;
                     docs/CONTRACTS.md 2); PAD_DEPTH on padding and on every position of an
                     empty response
    seq_lens[b]      P + T - 1, or P for an empty response
    prompt_lens[b]   P
    loss_mask[b, p]  mask AND the row's token_mask (Rollout.token_mask, a multi-turn
                     conversation: 1 = model token, 0 = environment token) at P - 1 + t: the
                     positions whose tokens the model sampled, the only ones trained (= mask
                     for a row without a token_mask). Environment positions keep their depth
                     (the conversation's full depth, as recorded) and are replayed like
                     prompt positions.

Positions are 0..L-1 on every row (padding continues them); a position is valid iff p < seq_len.

Packed layout (`pack_rows`, the learner's micro-batches under learner.max_tokens_per_micro):
the valid positions of rows 0..B-1 laid end to end in one row of N = sum(seq_lens) positions
(rounded up to ``pad_to_multiple``), in row order and position order, so the row-major order of
any per-position selection (the response positions) is the same in both layouts:

    index[n]      b * L + p: where packed position n comes from in the [B, L] rows (-1: padding)
    segment[n]    b, the row (sequence) n belongs to; -1 on the tail padding
    positions[n]  p, the position within its own sequence (restarting at 0 per sequence; 0 on
                  padding): RoPE and the latent noise of docs/CONTRACTS.md 1 follow it unchanged
    starts[b]     the first packed position of row b (starts[B] = sum(seq_lens))

Attention stays within a segment (a block-diagonal causal mask), each segment's full depth is
its own row's, and its latent seed its own row's: a packed forward computes what the padded
one computes, without the padding. `micro_spans` cuts consecutive rows into micro-batches of
at most a token budget; `token_shares` cuts rows into contiguous shares of about equal tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.depths import position_depths

__all__ = [
    "PAD_DEPTH", "PackedRows", "TokenRows", "micro_spans", "pack_rows", "response_slice",
    "token_rows", "token_shares",
]  # fmt: skip

PAD_DEPTH = 1
"""The depth of a padding position (a valid depth: padding is never read by a valid position)."""


def response_slice(prompt_len: int, num_tokens: int) -> slice:
    """The positions that sampled the response tokens of a row: [P - 1, P - 1 + T)."""
    return slice(prompt_len - 1, prompt_len - 1 + num_tokens)


@dataclass(frozen=True)
class TokenRows:
    """[B, L] token arrays and [B] lengths of the layout (module docstring), numpy."""

    input_ids: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    depths: np.ndarray
    seq_lens: np.ndarray
    prompt_lens: np.ndarray
    loss_mask: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def token_rows(
    prompts: Sequence[Sequence[int] | np.ndarray],
    responses: Sequence[Sequence[int] | np.ndarray],
    exit_depths: Sequence[Sequence[int] | np.ndarray],
    *,
    pad_to_multiple: int = 1,
    full_depths: Sequence[int | None] | None = None,
    token_masks: Sequence[Sequence[int] | np.ndarray | None] | None = None,
) -> TokenRows:
    """Lay out rows (module docstring); L is the longest row rounded up to ``pad_to_multiple``
    (at least 1). A prompt must be non-empty; a response may be empty (then it has no depths).
    full_depths: each row's recorded full depth (the depth of prompt positions 0..P-2; None or
    0 = its exit_depths[0], streams recorded before `Rollout.full_depth`).
    token_masks: each row's token_mask (None: every response token is the model's)."""
    if not (len(prompts) == len(responses) == len(exit_depths)) or not prompts:
        raise ValueError("token_rows: needs as many prompts, responses and exit depths, >= 1")
    plens = [len(p) for p in prompts]
    tlens = [len(r) for r in responses]
    if min(plens) < 1:
        raise ValueError("token_rows: every row needs a non-empty prompt")
    for t, d in zip(tlens, exit_depths):
        if len(d) != t:
            raise ValueError(f"token_rows: {t} response tokens but {len(d)} exit depths")
    seq_lens = [p + t - 1 if t else p for p, t in zip(plens, tlens)]
    length = max(1, -(-max(seq_lens) // pad_to_multiple) * pad_to_multiple)
    b = len(prompts)
    input_ids = np.zeros((b, length), dtype=np.int64)
    targets = np.zeros((b, length), dtype=np.int64)
    mask = np.zeros((b, length), dtype=bool)
    loss_mask = np.zeros((b, length), dtype=bool)
    depths = np.full((b, length), PAD_DEPTH, dtype=np.int64)
    for i, (prompt, resp) in enumerate(zip(prompts, responses)):
        p, t = plens[i], tlens[i]
        seq = np.concatenate([np.asarray(prompt, np.int64), np.asarray(resp, np.int64)])
        input_ids[i, : seq_lens[i]] = seq[: seq_lens[i]]
        if t:
            at = response_slice(p, t)
            targets[i, at] = np.asarray(resp, np.int64)
            mask[i, at] = True
            tm = None if token_masks is None else token_masks[i]
            if tm is not None and len(tm) != t:
                raise ValueError(
                    f"token_rows: {t} response tokens but {len(tm)} token_mask entries"
                )
            loss_mask[i, at] = True if tm is None else np.asarray(tm) == 1
            full = None if full_depths is None else full_depths[i]
            depths[i, : p - 1 + t] = position_depths(p, exit_depths[i], full)
    return TokenRows(input_ids, targets, mask, depths, np.asarray(seq_lens, np.int64),
                     np.asarray(plens, np.int64), loss_mask)  # fmt: skip


@dataclass(frozen=True)
class PackedRows:
    """The packed layout of [B, L] rows (module docstring), numpy [N] arrays."""

    index: np.ndarray
    segment: np.ndarray
    positions: np.ndarray
    starts: np.ndarray

    @property
    def length(self) -> int:
        return int(self.index.shape[0])

    @property
    def tokens(self) -> int:
        """Real (non-padding) positions: sum(seq_lens)."""
        return int(self.starts[-1])


def pack_rows(seq_lens: Sequence[int] | np.ndarray, width: int, *,
              pad_to_multiple: int = 1) -> PackedRows:  # fmt: skip
    """The packed layout of rows of ``seq_lens`` valid positions in [B, ``width``] arrays
    (module docstring); N = sum(seq_lens) rounded up to ``pad_to_multiple`` (at least 1)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0 or (lens < 1).any() or (lens > width).any():
        raise ValueError(f"pack_rows: seq_lens must be B >= 1 lengths in [1, {width}], "
                         f"got {lens.tolist()[:8]}")  # fmt: skip
    if pad_to_multiple < 1:
        raise ValueError(f"pack_rows: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    real = int(starts[-1])
    n = max(1, -(-real // pad_to_multiple) * pad_to_multiple)
    segment = np.full(n, -1, dtype=np.int64)
    segment[:real] = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    positions = np.zeros(n, dtype=np.int64)
    positions[:real] = np.arange(real, dtype=np.int64) - np.repeat(starts[:-1], lens)
    index = np.full(n, -1, dtype=np.int64)
    index[:real] = segment[:real] * width + positions[:real]
    return PackedRows(index, segment, positions, starts)


def micro_spans(seq_lens: Sequence[int] | np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive rows [a, b) cut greedily so that each span's positions (sum of seq_lens) are
    at most ``budget``; a row longer than the budget alone forms a span (the caller bounds rows
    by the config). Rows keep their order (the training order of learner.batching)."""
    if budget < 1:
        raise ValueError(f"micro_spans: budget must be >= 1, got {budget}")
    spans: list[tuple[int, int]] = []
    a, used = 0, 0
    for i, n in enumerate(int(x) for x in seq_lens):
        if i > a and used + n > budget:
            spans.append((a, i))
            a, used = i, 0
        used += n
    if len(seq_lens):
        spans.append((a, len(seq_lens)))
    return spans


def pack_order(seq_lens: Sequence[int] | np.ndarray, budget: int) -> np.ndarray:
    """A permutation of the rows that packs them into few micro-batches of at most ``budget``
    positions: first-fit decreasing (rows by length, longest first, ties by index; each into
    the first bin it fits, else a new bin; a row longer than the budget alone), the bins in
    the order they were opened, each bin's rows in their own order. `micro_spans` over the
    permuted rows cuts exactly these bins: a row of a later bin did not fit any earlier bin
    when it was placed, and bins only fill up after. Deterministic: a function of the
    lengths alone (every rank computes the same)."""
    if budget < 1:
        raise ValueError(f"pack_order: budget must be >= 1, got {budget}")
    lens = [int(x) for x in seq_lens]
    room: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        for k, r in enumerate(room):
            if lens[i] <= r:
                room[k] -= lens[i]
                bins[k].append(i)
                break
        else:
            room.append(budget - lens[i])
            bins.append([i])
    return np.asarray([i for b in bins for i in sorted(b)], dtype=np.int64)


def token_shares(seq_lens: Sequence[int] | np.ndarray, parts: int) -> list[int]:
    """Boundaries 0 = c_0 < c_1 < ... < c_parts = B of contiguous shares of about equal tokens:
    c_k is the row boundary whose running sum of seq_lens is nearest to k / parts of the total,
    each share keeping at least one row (B >= parts)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    b = int(lens.size)
    if parts < 1 or b < parts:
        raise ValueError(f"token_shares: {b} rows cannot make {parts} shares of >= 1 row")
    cum = np.concatenate([[0], np.cumsum(lens)])  # cum[c]: the tokens of rows [0, c)
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, parts):
        c = int(np.argmin(np.abs(cum - total * k / parts)))
        c = min(max(c, cuts[-1] + 1), b - (parts - k))  # one row each, at least
        cuts.append(c)
    return cuts + [b]
