"""One paged-KV attention slot of a looped model: vLLM's kernel (fast) or fp64 (exact).

A looped model has one `SlotAttention` per (iteration, core layer) and per prelude / coda
layer, each owning a vLLM `Attention` (hence its own paged KV cache). Per call:

- fast: `Attention.forward(q, k, v)`: vLLM writes k, v at the tokens' slots, then runs its
  backend kernel (CPU_ATTN on CPU, FlashAttention & co. on GPU).
- exact: the k, v are written with vLLM's `unified_kv_cache_update` (backend-agnostic), then
  the keys / values of every request's context are gathered back from this layer's cache
  through the block table and attention runs as `models.numerics.attention(mode="exact")`
  (fp64, the order-defined recipe), so it equals the reference bit for bit.
- `write(k, v)`: only stores k, v (iterations no token of the step still runs; the cache
  must still hold every token's last-exited K/V for later queries, DESIGN contract 3,
  kv: last_exited; under kv: full every token runs every iteration and writes its own).

Cache layouts read back in exact mode (vLLM 0.32): CPU_ATTN `[blocks, kv_heads, block, 2*D]`
(each (block, head) page: the keys transposed [D, block], then the values [block, D]; this is
the "vec" ISA, fp32 on x86) and the FlashAttention-style
`[2, blocks, block, kv_heads, D]`. Each exact forward checks that the slots it just wrote read
back as the k it wrote, and raises otherwise, so an unknown layout fails loudly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from models import numerics as nx


@dataclasses.dataclass
class ExactPlan:
    """Gather indices of one forward, shared by all slots (one KV cache group)."""

    q_rows: Tensor
    """int64 [R, S] flattened token row of each (request, query) (0 where padded)."""
    q_valid: Tensor
    """bool [R, S]."""
    blocks: Tensor
    offsets: Tensor
    """int64 [R, K]: cache block and offset of each (request, key position)."""
    mask: Tensor
    """bool [R, S, K]: causal visibility (padding queries see key 0)."""
    checked: bool = False


def _split_cache(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(keys, values), each [blocks, kv_heads, block_size, D]."""
    if kv_cache.dim() == 4:  # CPU_ATTN: [nb, G, bs, 2D]; page = keys [D, bs], values [bs, D]
        nb, g, bs, two_d = kv_cache.shape
        pages = kv_cache.view(nb, g, 2, bs * (two_d // 2))
        keys = pages[:, :, 0].view(nb, g, two_d // 2, bs).transpose(2, 3)
        return keys, pages[:, :, 1].view(nb, g, bs, two_d // 2)
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:  # [2, nb, bs, G, D]
        return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    raise RuntimeError(
        f"exact numerics: unsupported KV cache layout {tuple(kv_cache.shape)}; "
        "use numerics='fast' with this attention backend"
    )


def build_plan(metadata: Any, block_size: int, device: torch.device) -> ExactPlan:
    """Gather plan of a forward from its attention metadata (query_start_loc, seq_lens,
    block_table: present in CPU_ATTN and FlashAttention metadata)."""
    qsl = metadata.query_start_loc.to("cpu", torch.int64)
    seq_lens = metadata.seq_lens.to("cpu", torch.int64)
    n_req = int(seq_lens.shape[0])
    qsl = qsl[: n_req + 1]
    q_lens = qsl[1:] - qsl[:-1]
    s_max, k_max = max(int(q_lens.max()), 1), max(int(seq_lens.max()), 1)
    j = torch.arange(s_max)
    q_valid = j[None, :] < q_lens[:, None]
    q_rows = torch.where(q_valid, qsl[:-1, None] + j[None, :], 0)
    q_pos = seq_lens[:, None] - q_lens[:, None] + j[None, :]
    t = torch.arange(k_max)
    k_valid = t[None, :] < seq_lens[:, None]
    table = metadata.block_table.to("cpu", torch.int64)[:n_req]
    page = torch.clamp(t // block_size, max=table.shape[1] - 1)
    blocks = torch.where(k_valid, table.gather(1, page.expand(n_req, -1)), 0)
    offsets = torch.where(k_valid, (t % block_size)[None, :], 0)
    mask = k_valid[:, None, :] & (t[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
    mask[..., 0] |= ~mask.any(dim=-1)
    return ExactPlan(
        q_rows.to(device),
        q_valid.to(device),
        blocks.to(device),
        offsets.to(device),
        mask.to(device),
    )


class SlotAttention(nn.Module):
    """A vLLM `Attention` plus the exact-mode path (see module doc)."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        mode: str,
        prefix: str,
        cache_config: Any,
        plans: dict[str, Any],
    ) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.heads, self.kv_heads, self.head_dim, self.mode = heads, kv_heads, head_dim, mode
        self.attn = Attention(
            heads,
            head_dim,
            1.0 / math.sqrt(head_dim),
            num_kv_heads=kv_heads,
            cache_config=cache_config,
            prefix=prefix,
        )
        self.layer_name = prefix
        self._plans = plans  # shared per model: {"plan": ExactPlan | None}

    def write(self, k: Tensor, v: Tensor) -> None:
        """Store k, v [T, G, D] at the tokens' slots without attending."""
        from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

        unified_kv_cache_update(k.contiguous(), v.contiguous(), self.layer_name)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k / v [T, G, D] -> attention output [T, H * D]."""
        n = q.shape[0]
        if self.mode != "exact":
            return self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
        from vllm.model_executor.layers.attention.attention import get_attention_context

        metadata, _, kv_cache, slot_mapping = get_attention_context(self.layer_name)
        if metadata is None or kv_cache.numel() == 0:  # profiling / dummy runs
            return q.new_zeros(n, self.heads * self.head_dim)
        self.write(k, v)
        keys, values = _split_cache(kv_cache)
        plan = self._plans.get("plan")
        if plan is None:
            plan = build_plan(metadata, keys.shape[2], q.device)
            self._plans["plan"] = plan
        if not plan.checked:
            _check_layout(keys, k, slot_mapping)
            plan.checked = True
        kk = keys[plan.blocks, :, plan.offsets]  # [R, K, G, D]
        vv = values[plan.blocks, :, plan.offsets]
        qq = q[plan.q_rows]  # [R, S, H, D]
        out = nx.attention(qq, kk, vv, plan.mask, "exact")  # [R, S, H * D]
        result = q.new_zeros(n, self.heads * self.head_dim)
        result[plan.q_rows[plan.q_valid]] = out[plan.q_valid]
        return result


def _check_layout(keys: Tensor, k: Tensor, slot_mapping: Tensor | None) -> None:
    if slot_mapping is None:
        return
    slots = slot_mapping[: k.shape[0]].to(torch.int64)
    ok = slots >= 0
    bs = keys.shape[2]
    got = keys[slots[ok] // bs, :, slots[ok] % bs]
    if not torch.equal(got, k[ok].to(got.dtype)):
        raise RuntimeError(
            "exact numerics: the KV cache does not read back as written (unknown layout); "
            "use numerics='fast' with this attention backend"
        )


__all__ = ["ExactPlan", "SlotAttention", "build_plan"]
