"""Rollouts -> padded training tensors, and the advantages of a step.

Order of calls in a training step (learner.trainer.Trainer.step):

    batch = build_batch(rollouts)                      # sorted, padded [B, L] tensors
    adv = group_token_advantages(batch, normalize_std)  # GRPO: from rewards and group ids
    # or, with a critic: values = critic(batch); adv, ret = gae_advantages(batch, values, ...)
    for mb in batch.micro_batches(micro_batch_size, rows=this_rank_rows): ...

Layout. Rollouts are sorted by (work_id, sample_index, rollout_id), so the batch and every
slice of it are independent of arrival order (replay of a recorded stream is bit-exact).
The rows are models.token_rows' layout (input_ids, targets, mask, exit_depths = its depths,
seq_lens, prompt_lens), plus, per token:

    position_ids[b, p]  p                            (continues on padding)
    behav_logp[b, p]    rollout.logprobs[t] at p = P-1+t (0 elsewhere)
    token_rewards[b, p] the reward at the last response token (of a conversation: its last
                        model token), 0 elsewhere
`mask` is models.token_rows' loss_mask: the response positions whose tokens the model sampled
(a conversation's environment tokens, Rollout.token_mask 0, are out of it: no loss, no
log-prob check, no token count; they are replayed at full depth like prompt positions).
Per row: latent_seeds (int64 holding the uint64 bit pattern), group_ids (index of the
work item in sorted order), rewards, weight_versions (rollout.weight_version), seq_lens
(P + T - 1, or P for an empty response), prompt_lens, truncated (finish_reason "length").

Packed micro-batches (learner.max_tokens_per_micro): the step cuts rows into micro-batches of at
most that many positions (models.token_rows.micro_spans) and marks them ``packed``; the micro-batch
keeps this padded [B, L] layout for everything the step computes (losses, advantages,
metrics), and a policy whose forward packs (learner.model_specs.looped_policy_spec) feeds the model
`packed_inputs(mb)`: the rows end to end in one row (models.token_rows.pack_rows), then spreads the
outputs back (`PackedInputs.unpack`).

No device read on the way in. A micro-batch moves to the card through pinned memory without
waiting (`to_device`) and keeps the host batch it came from (`TrainBatch.on_host`): what the
forward needs to know as numbers (the packed layout, loop counts, the rows the head reads) is
computed from that copy, so a micro-batch's forward does not stop to read the card. Each such
read waits for every kernel queued before it and leaves the card idle while the host prepares
what follows (a 1b compiled Trainer step on an H100 read the card 195 times before this, 11
after: `benchmarks/trainer_gpu.py --syncs`, docs/LEARNER.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from learner.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_advantages,
    group_baseline,
    rloo_advantages,
    whiten_tokens,
)
from models.seeds import seed_from_i64, seed_to_i64
from models.token_rows import (
    PAD_DEPTH,
    pack_order,
    pack_rows,
    response_slice,
    token_rows,
    token_shares,
)
from proto.records import Rollout

__all__ = [
    "PackedInputs",
    "TrainBatch",
    "build_batch",
    "gae_advantages",
    "group_token_advantages",
    "local_rows",
    "pack_updates",
    "packed_inputs",
    "rank_cuts",
    "sort_rollouts",
    "step_advantages",
]

_TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "targets",
    "mask",
    "behav_logp",
    "exit_depths",
    "token_rewards",
)
_ROW_FIELDS = (
    "latent_seeds",
    "group_ids",
    "rewards",
    "weight_versions",
    "seq_lens",
    "prompt_lens",
    "truncated",
)


@dataclasses.dataclass
class TrainBatch:
    """Padded training tensors (layout: module docstring); [B, L] token fields, [B] rows."""

    rollout_ids: list[str]
    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    mask: Tensor
    behav_logp: Tensor
    exit_depths: Tensor
    token_rewards: Tensor
    latent_seeds: Tensor
    group_ids: Tensor
    rewards: Tensor
    weight_versions: Tensor
    seq_lens: Tensor
    prompt_lens: Tensor
    truncated: Tensor
    """[B] bool: the completion hit the length limit (finish_reason "length")."""
    token_versions: Tensor | None = None
    """[B, L] int64: the weight version that sampled each response token (rollout.token_versions
    when weights changed mid-completion, else weight_version), 0 off the response."""
    extra: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    """[B, L] per-token tensors added by the trainer (advantages, prox_logp, ...)."""
    full_depths: Tensor | None = None
    """[B] int64: each row's full depth D (Rollout.full_depth, else exit_depths[0];
    docs/CONTRACTS.md 2): exit_depths[b, 0] is D only when the prompt has 2+ tokens."""
    packed: bool = False
    """A micro-batch the step cut by tokens (learner.max_tokens_per_micro): a forward that
    packs lays its rows end to end (`packed_inputs`); the layout of its tensors is unchanged."""
    pack_multiple: int = 1
    """The packed row's length is rounded up to a multiple of this (TrainConfig.pad_to_multiple)."""
    host: TrainBatch | None = dataclasses.field(default=None, repr=False, compare=False)
    """The host batch this one was moved from (`to`); None on the host itself."""

    @property
    def size(self) -> int:
        return len(self.rollout_ids)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def seeds(self) -> list[int]:
        """Latent seeds as Python uint64 ints."""
        return [seed_from_i64(s) for s in self.latent_seeds.tolist()]

    def rows(self, start: int, stop: int, pad_to_multiple: int = 1) -> TrainBatch:
        """Rows [start, stop), trimmed to their longest sequence rounded up to a multiple."""
        n = int(self.seq_lens[start:stop].max()) if stop > start else 1
        n = max(1, -(-n // pad_to_multiple) * pad_to_multiple)
        sl = slice(start, stop)
        fields: dict[str, Any] = {k: _fit(getattr(self, k)[sl], n, k) for k in _TOKEN_FIELDS}
        fields.update({k: getattr(self, k)[sl] for k in _ROW_FIELDS})
        extra = {k: _fit(v[sl], n, k) for k, v in self.extra.items()}
        tv = None if self.token_versions is None else _fit(self.token_versions[sl], n, "")
        fd = None if self.full_depths is None else self.full_depths[sl]
        return TrainBatch(rollout_ids=self.rollout_ids[sl], extra=extra, token_versions=tv,
                          full_depths=fd, **fields)  # fmt: skip

    def take(self, order: Tensor) -> TrainBatch:
        """The rows in ``order`` ([B] int64, a permutation of 0..B-1), every field with them."""
        fields: dict[str, Any] = {k: getattr(self, k).index_select(0, order)
                                  for k in _TOKEN_FIELDS + _ROW_FIELDS}  # fmt: skip
        extra = {k: v.index_select(0, order) for k, v in self.extra.items()}
        tv = None if self.token_versions is None else self.token_versions.index_select(0, order)
        fd = None if self.full_depths is None else self.full_depths.index_select(0, order)
        ids = [self.rollout_ids[i] for i in order.tolist()]
        return TrainBatch(rollout_ids=ids, extra=extra, token_versions=tv, full_depths=fd,
                          packed=self.packed, pack_multiple=self.pack_multiple, **fields)  # fmt: skip

    def micro_batches(
        self, size: int, start: int, stop: int, pad_to_multiple: int = 1
    ) -> Iterator[TrainBatch]:
        """Consecutive micro-batches of `size` rows over rows [start, stop)."""
        for i in range(start, stop, size):
            yield self.rows(i, min(i + size, stop), pad_to_multiple)

    def to(self, device: torch.device | str) -> TrainBatch:
        """This batch on ``device`` (`to_device`: from the host without waiting for the card),
        remembering its host copy (`on_host`)."""
        dev = torch.device(device)
        fields = {k: to_device(getattr(self, k), dev) for k in _TOKEN_FIELDS + _ROW_FIELDS}
        extra = {k: to_device(v, dev) for k, v in self.extra.items()}
        tv = None if self.token_versions is None else to_device(self.token_versions, dev)
        fd = None if self.full_depths is None else to_device(self.full_depths, dev)
        host = self.host if self.host is not None else self if self.on_cpu else None
        return TrainBatch(rollout_ids=list(self.rollout_ids), extra=extra, token_versions=tv,
                          full_depths=fd, packed=self.packed, pack_multiple=self.pack_multiple,
                          host=host, **fields)  # fmt: skip

    @property
    def on_cpu(self) -> bool:
        return self.input_ids.device.type == "cpu"

    def on_host(self) -> TrainBatch:
        """The batch's host copy: itself on the CPU, else the host batch it was moved from
        (`to`; the same values: the step does not change a micro-batch's token fields after
        the move), else one read back from the card (a sync)."""
        if self.on_cpu:
            return self
        if self.host is None:
            self.host = self.to("cpu")
        return self.host

    def mask_rows(self) -> Tensor:
        """[N] int64 on this batch's device: the flat positions b * L + p where mask > 0, in
        row-major order (the rows ``x[mask > 0]`` takes), found on the host copy."""
        return to_device(flat_index(self.on_host().mask > 0), self.mask.device)


@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """A micro-batch's model inputs in the packed layout (models.token_rows.pack_rows): one row of N
    positions, [1, N] each, on the micro-batch's device."""

    input_ids: Tensor
    exit_depths: Tensor
    positions: Tensor
    """Position within its own sequence (RoPE, latent noise); 0 on the tail padding."""
    segments: Tensor
    """Which row of the micro-batch (its latent seed, its full depth); -1 on the tail padding."""
    valid: Tensor
    """Real positions (a prefix: the padding is at the tail)."""
    head_rows: Tensor
    """mask > 0 (the response positions trained), in the same row-major order as the rows'."""
    index: Tensor
    """[N] b * L + p of each packed position in the [B, L] rows, -1 on padding."""
    rows: int
    width: int
    host: PackedInputs | None = None
    """The same inputs on the host (the forward's loop counts and checks read these)."""

    @property
    def tokens(self) -> int:
        return int((self.host or self).valid.sum())

    def unpack(self, x: Tensor) -> Tensor:
        """[1, N, ...] packed values -> [B, L, ...] rows (0 where no packed position maps)."""
        flat = x.reshape(x.shape[1], *x.shape[2:])
        index = (self.host or self).index
        src = flat_index(index >= 0)
        dst, src = to_device(index[src], flat.device), to_device(src, flat.device)
        out = flat.new_zeros((self.rows * self.width, *x.shape[2:]))
        out.index_copy_(0, dst, flat.index_select(0, src))
        return out.view(self.rows, self.width, *x.shape[2:])

    def packed_of(self, flat: Tensor) -> Tensor:
        """[M] the packed positions of ``flat`` [M], flat indices b * L + p into the [B, L]
        rows (host tensors, no sync); each must be a real position of the micro-batch."""
        index = (self.host or self).index.cpu()
        where = torch.full((self.rows * self.width,), -1, dtype=torch.int64)
        real = flat_index(index >= 0)
        where[index[real]] = real
        out = where[flat.cpu()]
        if not bool((out >= 0).all()):
            raise ValueError("packed_of: a flat index of a padded position (not packed)")
        return out


def packed_inputs(mb: TrainBatch) -> PackedInputs:
    """`mb`'s rows end to end (module docstring; models.token_rows.pack_rows), laid out on the
    host copy (`TrainBatch.on_host`) and moved to ``mb``'s device without a sync; the host
    tensors ride along (`PackedInputs.host`)."""
    h = mb.on_host()  # (the same values: the step does not write a moved micro-batch's fields)
    lay = pack_rows(h.seq_lens.numpy(), h.length, pad_to_multiple=mb.pack_multiple)
    index = torch.from_numpy(lay.index)
    keep = index >= 0
    src = index.clamp(min=0)

    def take(x: Tensor, fill: int | float) -> Tensor:
        return torch.where(keep, x.reshape(-1)[src], fill)[None]

    on_host = PackedInputs(
        input_ids=take(h.input_ids, 0), exit_depths=take(h.exit_depths, PAD_DEPTH),
        positions=torch.from_numpy(lay.positions)[None],
        segments=torch.from_numpy(lay.segment)[None], valid=keep[None],
        head_rows=take(h.mask > 0, False), index=index, rows=mb.size, width=mb.length,
    )  # fmt: skip
    dev = mb.input_ids.device
    if dev.type == "cpu":
        return dataclasses.replace(on_host, host=on_host)
    moved: dict[str, Any] = {f.name: to_device(getattr(on_host, f.name), dev)
             for f in dataclasses.fields(PackedInputs) if f.name in _PACKED_TENSORS}  # fmt: skip
    return dataclasses.replace(on_host, host=on_host, **moved)


_PACKED_TENSORS = ("input_ids", "exit_depths", "positions", "segments", "valid", "head_rows",
                   "index")  # fmt: skip


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; a host tensor goes to a CUDA device through pinned memory without
    waiting for the card (a plain ``.to`` from pageable memory waits for the stream; the
    pinned copy stays alive until the copy ends: the caching host allocator's event)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def flat_index(sel: Tensor) -> Tensor:
    """[N] int64: the flat positions where the bool ``sel`` holds, row-major (the order of
    ``x[sel]``); on ``sel``'s device (on the host: no sync)."""
    return torch.nonzero(sel.reshape(-1)).reshape(-1)


def _fit(x: Tensor, n: int, name: str) -> Tensor:
    """[B, L, ...] cut or right-padded (position_ids continue, depths 1, else 0) to L = n."""
    length = x.shape[1]
    if n <= length:
        return x[:, :n]
    pad_shape = (x.shape[0], n - length, *x.shape[2:])
    if name == "position_ids":
        pad = torch.arange(length, n, dtype=x.dtype).expand(x.shape[0], n - length)
    elif name == "exit_depths":
        pad = torch.full(pad_shape, PAD_DEPTH, dtype=x.dtype)
    else:
        pad = torch.zeros(pad_shape, dtype=x.dtype)
    return torch.cat([x, pad.to(x.device)], dim=1)


def sort_rollouts(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """Deterministic training order: by (work_id, sample_index, rollout_id); ValueError on a
    duplicate rollout_id (a rollout is trained at most once)."""
    ids = [r.rollout_id for r in rollouts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"rollouts: duplicate rollout_id(s) {dup[:5]}")
    return sorted(rollouts, key=lambda r: (r.work_id, r.sample_index, r.rollout_id))


def build_batch(rollouts: Sequence[Rollout], *, pad_to_multiple: int = 1) -> TrainBatch:
    """Sort and pad rollouts into a TrainBatch on the CPU (layout: module docstring).

    Every rollout needs a reward (ValueError naming it otherwise: the coordinator filters
    failed rewards before training). Group ids number the distinct work_ids in sorted order.
    """
    if not rollouts:
        raise ValueError("rollouts: expected at least one rollout")
    ordered = sort_rollouts(rollouts)
    for r in ordered:
        if r.reward is None:
            raise ValueError(f"rollout {r.rollout_id!r}: no reward (filter it before training)")
        if int(r.prompt_tokens.shape[0]) < 1:
            raise ValueError(f"rollout {r.rollout_id!r}: empty prompt")
    lay = token_rows([r.prompt_tokens for r in ordered], [r.tokens for r in ordered],
                     [r.exit_depths for r in ordered], pad_to_multiple=pad_to_multiple,
                     full_depths=[r.full_depth for r in ordered],
                     token_masks=[r.token_mask for r in ordered])  # fmt: skip
    assert lay.loss_mask is not None
    b, length = len(ordered), lay.length
    behav = np.zeros((b, length), dtype=np.float32)
    token_rewards = np.zeros((b, length), dtype=np.float32)
    token_versions = np.zeros((b, length), dtype=np.int64)
    sampled_exit = any(r.exit_logprobs is not None for r in ordered)
    exit_behav = np.zeros((b, length), dtype=np.float32) if sampled_exit else None
    groups: dict[str, int] = {}
    group_ids, seeds, rewards, versions = [], [], [], []
    for i, r in enumerate(ordered):
        p, t = int(lay.prompt_lens[i]), int(r.tokens.shape[0])
        if t:
            behav[i, response_slice(p, t)] = r.logprobs
            # the reward on the last model token (a conversation may end with the environment's)
            model = np.flatnonzero(r.token_mask == 1) if r.token_mask is not None else None
            last = int(model[-1]) if model is not None and model.size else t - 1
            token_rewards[i, p - 1 + last] = float(r.reward)  # type: ignore[arg-type]
            tv = r.token_versions
            token_versions[i, response_slice(p, t)] = r.weight_version if tv is None else tv
            if exit_behav is not None and r.exit_logprobs is not None:
                exit_behav[i, response_slice(p, t)] = r.exit_logprobs
        group_ids.append(groups.setdefault(r.work_id, len(groups)))
        seeds.append(seed_to_i64(int(r.latent_seed)))
        rewards.append(float(r.reward))  # type: ignore[arg-type]
        versions.append(int(r.weight_version))
    extra = {} if exit_behav is None else {"exit_behav": torch.from_numpy(exit_behav)}
    return TrainBatch(
        rollout_ids=[r.rollout_id for r in ordered],
        extra=extra,  # a sampled exit: the generator's exit log-probs (objective.exit_coef)
        input_ids=torch.from_numpy(lay.input_ids),
        position_ids=torch.arange(length, dtype=torch.int64).expand(b, length).contiguous(),
        targets=torch.from_numpy(lay.targets),
        mask=torch.from_numpy(lay.loss_mask.astype(np.float32)),  # model tokens only
        behav_logp=torch.from_numpy(behav),
        exit_depths=torch.from_numpy(lay.depths),
        token_rewards=torch.from_numpy(token_rewards),
        latent_seeds=torch.tensor(seeds, dtype=torch.int64),
        group_ids=torch.tensor(group_ids, dtype=torch.int64),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        weight_versions=torch.tensor(versions, dtype=torch.int64),
        seq_lens=torch.from_numpy(lay.seq_lens),
        prompt_lens=torch.from_numpy(lay.prompt_lens),
        truncated=torch.tensor([r.finish_reason == "length" for r in ordered], dtype=torch.bool),
        token_versions=torch.from_numpy(token_versions),
        full_depths=torch.tensor(
            [int(r.full_depth) or int(lay.depths[i, 0]) for i, r in enumerate(ordered)],
            dtype=torch.int64,
        ),
    )


def group_token_advantages(batch: TrainBatch, normalize_std: bool = True) -> Tensor:
    """GRPO advantages [B, L]: `group_advantages` over the batch's rows, spread over each
    row's response tokens (0 elsewhere). Groups are the work items."""
    adv = group_advantages(batch.rewards, batch.group_ids, normalize_std=normalize_std)
    return broadcast_to_tokens(adv, batch.mask)


def gae_advantages(
    batch: TrainBatch, values: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, L] by GAE from the token rewards and critic values [B, L]
    (V at position p is the value of the state that samples the token predicted at p)."""
    return gae(batch.token_rewards, values, batch.mask, gamma, lam)


def step_advantages(
    batch: TrainBatch,
    values: Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    normalize_std: bool = True,
    estimator: str = "grpo",
    singleton: str = "zero",
    whiten: bool = False,
    whiten_std: str = "population",
    bootstrap_truncated: bool = False,
    truncated: Tensor | None = None,
    local: Tensor | None = None,
    reduce: Callable[[Tensor], object] | None = None,
    depth_cost: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """A step's advantages [B, L] (and GAE returns with a critic, else None): every
    advantage option of the objective in one place (keywords: `ObjectiveConfig.advantage_options`).

    values given (a critic): GAE; with ``bootstrap_truncated`` the rows flagged in
    ``truncated`` [B] bool (finish_reason "length") bootstrap V after their last step with
    that step's own value (AReaL bootstraps with the state after the last token, which these
    rows do not feed: see docs/OBJECTIVES.md). Without: ``estimator`` grpo
    (`group_advantages`), rloo, reinforce_pp (discounted token returns, whitened) or
    reinforce_pp_baseline (r - group mean, whitened), singletons per ``singleton``. Then the
    rows outside ``local`` [B] bool (other data-parallel ranks') are zeroed, and ``whiten``
    (always for reinforce_pp*) whitens over the local tokens with ``whiten_std``, ``reduce``
    adding other ranks' sums. With the defaults it is, bit for bit, what both trainers did.
    ``depth_cost`` > 0 (objective.depth_cost_in advantage; a group estimator): before the
    zeroing and whitening, each row's advantage loses depth_cost x (f_i - the mean f of its
    group; 0 for a group of one), f = ``batch.extra["depth_fraction"]`` [B, L] (each row's
    learner.shaping.depth_fraction at every position), in reward units whatever
    ``normalize_std`` does to the rewards.
    """
    returns = None
    if values is not None:
        last = None
        if bootstrap_truncated:
            if truncated is None:
                raise ValueError("bootstrap_truncated: needs truncated [B] (finish_reason)")
            live = batch.mask > 0
            idx = live.float().cumsum(dim=1).argmax(dim=1)  # each row's last response step
            v_last = values.float()[torch.arange(batch.size), idx]
            last = torch.where(truncated & live.any(dim=1), v_last, 0.0)
        adv, returns = gae(batch.token_rewards, values, batch.mask, gamma, lam, last)
    elif estimator == "grpo":
        adv = broadcast_to_tokens(
            group_advantages(batch.rewards, batch.group_ids, normalize_std, singleton=singleton),
            batch.mask,
        )
    elif estimator == "rloo":
        adv = broadcast_to_tokens(rloo_advantages(batch.rewards, batch.group_ids, singleton),
                                  batch.mask)  # fmt: skip
    elif estimator == "reinforce_pp":
        adv = discounted_returns(batch.token_rewards, batch.mask, gamma)
    elif estimator == "reinforce_pp_baseline":
        adv = broadcast_to_tokens(group_baseline(batch.rewards, batch.group_ids, singleton),
                                  batch.mask)  # fmt: skip
    else:
        raise ValueError(f"estimator: unknown {estimator!r}")
    if depth_cost > 0:
        if values is not None or estimator == "reinforce_pp":
            raise ValueError("depth_cost in the advantage: needs a group estimator, no critic")
        frac = batch.extra["depth_fraction"][:, 0]  # [B, L]: one value per row
        centred = group_baseline(frac, batch.group_ids).double()
        adv = adv - broadcast_to_tokens((depth_cost * centred).float(), batch.mask)
    mask = batch.mask
    if local is not None:
        adv = torch.where(local[:, None], adv, 0.0)
        mask = torch.where(local[:, None], mask, 0.0)
    if whiten or (values is None and estimator.startswith("reinforce_pp")):
        adv = whiten_tokens(adv, mask, reduce, std=whiten_std)
    return adv, returns


def update_normalizer(batch: TrainBatch, lo: int, hi: int, aggregation: str) -> float:
    """An update's global loss denominator over rows [lo, hi): its response tokens
    (token_mean), or its sequences with tokens (the seq_* aggregations)."""
    counts = (batch.mask[lo:hi] > 0).sum(dim=1)
    if aggregation == "token_mean":
        return float(counts.sum())
    return float((counts > 0).sum())


def mask_stale_tokens(batch: TrainBatch, version: int, max_gap: int) -> float:
    """objective.max_token_version_gap: response tokens sampled with weights more than
    ``max_gap`` versions before ``version`` (the learner's) leave the mask (no loss, no
    gradient, out of every denominator, advantage and metric); returns the fraction of the
    batch's response tokens masked."""
    live = batch.mask > 0
    assert batch.token_versions is not None, "build_batch fills token_versions"
    stale = live & (version - batch.token_versions > max_gap)
    batch.mask = torch.where(stale, 0.0, batch.mask)
    return float(stale.sum()) / max(1, int(live.sum()))


def update_order(minibatches: int, epochs: int, seed: int, step: int) -> list[int]:
    """The mini-batch of every optimizer update of a step: ``epochs`` passes over the
    ``minibatches``, the first in order, later ones shuffled by (seed, step, epoch): the same
    order on every rank and in both trainer backends."""
    order = list(range(minibatches))
    for e in range(1, epochs):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + e)
        order += torch.randperm(minibatches, generator=gen).tolist()
    return order


def rank_cuts(batch: TrainBatch, g: int, u: int, ranks: int, by_tokens: bool) -> list[int]:
    """Update ``u``'s data-parallel shares: boundaries within its ``g`` rows, one share per
    rank (``by_tokens``, packed rows: shares of about equal tokens, else of equal rows)."""
    if by_tokens and ranks > 1:
        return token_shares(batch.seq_lens[u * g : (u + 1) * g].numpy(), ranks)
    share = g // ranks
    return [k * share for k in range(ranks + 1)]


def local_rows(batch: TrainBatch, g: int, ranks: int, rank: int,
               by_tokens: bool) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """Per update of ``g`` rows: (its start, stop, rank ``rank``'s start, stop)."""
    out = []
    for u in range(batch.size // g):
        cut = rank_cuts(batch, g, u, ranks, by_tokens)
        out.append((u * g, (u + 1) * g, u * g + cut[rank], u * g + cut[rank + 1]))
    return out


def pack_updates(batch: TrainBatch, g: int, ranks: int, budget: int) -> TrainBatch:
    """Packed micro-batches (``budget`` = max_tokens_per_micro > 0): every rank's share of
    every update reordered so that its consecutive token spans (models.token_rows.micro_spans) are
    first-fit-decreasing bins (models.token_rows.pack_order): fewer, fuller micro-batches than in
    training order (the same set of rows per update and per rank; every rank reorders every
    share alike, so per-row results keep one index on all ranks). ``batch`` itself when
    ``budget`` is 0 or nothing moves."""
    if not budget:
        return batch
    order = np.arange(batch.size, dtype=np.int64)
    lens = batch.seq_lens.numpy()
    for u in range(batch.size // g):
        cut = rank_cuts(batch, g, u, ranks, by_tokens=True)
        for a, b in zip(cut[:-1], cut[1:]):
            lo, hi = u * g + a, u * g + b
            order[lo:hi] = lo + pack_order(lens[lo:hi], budget)
    if (order == np.arange(batch.size)).all():
        return batch
    return batch.take(torch.from_numpy(order))
