"""What a looped model costs on the hardware: training FLOPs on real tokens, the bytes one
decode step reads, and the peaks of the cards they are measured against.

One shape for every family (``LoopShape.of``): ``prelude`` layers once, a ``core`` of layers
iterated ``recurrence`` times (Huginn's core block with its 2h -> h adapter in front; Ouro's
and Nanbeige's whole stack; a plain decoder is recurrence 1), ``coda`` layers once, a head of
``vocab`` x ``hidden``. A block is 4 h^2 (attention projections at full K/V width; ``kv``
narrower for grouped K/V) plus 3 h f (gated MLP).

- ``train_flops``: one optimizer step's forward + backward over the rows it trained, on their
  real tokens only (no padding): per position 2 x the parameters run without gradient (core
  iterations past the backprop depth) + 6 x those with it, attention's score and value
  products over the row's own positions (n^2 pairs, the usual convention), and the head at the
  positions that carry a response token (the head's 6 v h). What the learner's metrics row
  calls ``perf/mfu`` is this over the step's train seconds and the card's dense bf16 peak.
- ``decode_step_bytes``: what one decode step of a batch reads from memory: every weight once
  per layer pass (the core's once per iteration it runs), and the K/V of every layer pass of
  every context position of every row. The decode bound is the card's memory bandwidth over
  it, times the batch (tokens a second: one token a row a step).
- ``card_peaks``: dense bf16 FLOP/s and memory bytes/s by card name (the data sheets), None
  for a card not listed (and for CPUs): the metrics row then leaves the fractions out;
  ``Host``: this process's first CUDA card and its free memory, or a CPU host (what the
  run's ``auto`` keys are chosen for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoopShape:
    """The dimensions the costs need (module docstring)."""

    hidden: int
    ffn: int
    vocab: int
    prelude: int
    core: int
    coda: int
    recurrence: int
    kv: int
    """K/V width per layer (heads x head_dim of the keys; ``hidden`` without grouped K/V)."""
    adapter: bool = False
    """Huginn's 2h -> h injection in front of every core iteration."""
    tied: bool = True

    @classmethod
    def of(cls, cfg: Any) -> LoopShape:
        """The shape of a models.config family config."""
        if getattr(cfg, "model_type", "") == "huginn_raven":
            return cls(
                hidden=cfg.n_embd, ffn=cfg.intermediate_size,
                vocab=cfg.padded_vocab_size or cfg.vocab_size, prelude=cfg.n_layers_in_prelude,
                core=cfg.n_layers_in_recurrent_block, coda=cfg.n_layers_in_coda,
                recurrence=cfg.mean_recurrence, kv=cfg.n_embd, adapter=True,
                tied=bool(cfg.tie_embeddings),
            )  # fmt: skip
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        loops = int(getattr(cfg, "max_depth", 1) or 1)
        return cls(
            hidden=cfg.hidden_size, ffn=cfg.intermediate_size, vocab=cfg.vocab_size, prelude=0,
            core=cfg.num_hidden_layers, coda=0, recurrence=loops,
            kv=cfg.num_key_value_heads * head_dim, tied=bool(cfg.tie_word_embeddings),
        )  # fmt: skip

    @property
    def block(self) -> int:
        """Parameters of one layer: attention (q, o at h; k, v at kv) + gated MLP."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv + 3 * h * self.ffn

    @property
    def iteration(self) -> int:
        """Parameters one core iteration runs."""
        return self.core * self.block + (2 * self.hidden * self.hidden if self.adapter else 0)

    def params(self) -> int:
        """Every parameter (norms left out), the embedding once when tied."""
        head = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.prelude + self.coda) * self.block + self.iteration + head


def train_flops(shape: LoopShape, rows: Sequence[tuple[int, int]], *, depth: float = 0.0,
                backprop_depth: int = 0) -> float:  # fmt: skip
    """Forward + backward FLOPs of one update over ``rows`` of (positions, response tokens):
    ``depth`` core iterations a token (0: ``shape.recurrence``), the last ``backprop_depth``
    of them with gradient (0: all)."""
    s = shape
    r = float(depth or s.recurrence)
    k = r if backprop_depth <= 0 else min(float(backprop_depth), r)
    grad = (s.prelude + s.coda) * s.block + k * s.iteration
    nograd = (r - k) * s.iteration
    # attention's products per (query, key) pair and layer pass: 2 (scores) + 2 (values) per
    # query width, forward; x3 with backward; every pair of the row counted (the usual
    # convention, as megatron's and benchmarks/trainer_gpu.py's: a causal kernel skips half)
    att = (4 * (r - k) * s.core + 12 * (s.prelude + s.coda + k * s.core)) * s.hidden
    head = 6 * s.vocab * s.hidden
    return float(sum(n * (2 * nograd + 6 * grad) + att * n * n + head * resp for n, resp in rows))


def decode_step_bytes(shape: LoopShape, batch: int, context: float, *, depth: float = 0.0,
                      weight_bytes: int = 2, kv_bytes: int = 2) -> float:  # fmt: skip
    """Bytes one decode step of ``batch`` rows reads, each row holding ``context`` positions
    (mean) and running ``depth`` core iterations (0: ``shape.recurrence``)."""
    s = shape
    r = float(depth or s.recurrence)
    weights = ((s.prelude + s.coda) * s.block + r * s.iteration + s.vocab * s.hidden) * weight_bytes
    layer_passes = s.prelude + s.coda + r * s.core
    kv = batch * context * layer_passes * 2 * s.kv * kv_bytes
    return float(weights + kv)


def decode_bound(shape: LoopShape, batch: int, context: float, bandwidth: float, *,
                 depth: float = 0.0, weight_bytes: int = 2, kv_bytes: int = 2) -> float:  # fmt: skip
    """Tokens a second at the memory bound: ``batch`` tokens per ``decode_step_bytes``."""
    step = decode_step_bytes(shape, batch, context, depth=depth, weight_bytes=weight_bytes,
                             kv_bytes=kv_bytes)  # fmt: skip
    return batch * bandwidth / step


# (name substring, dense bf16 FLOP/s, memory bytes/s), the first match wins (data sheets;
# the H100 PCIe before the SXM's plain "H100")
_CARDS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),
    ("GH200", 989e12, 4.0e12),
    ("A100-SXM4-80GB", 312e12, 2.04e12),
    ("A100", 312e12, 1.555e12),
    ("L40S", 362e12, 0.864e12),
)


def card_peaks(name: str) -> tuple[float, float] | None:
    """(dense bf16 FLOP/s, memory bytes/s) of the card ``name`` (torch.cuda.get_device_name),
    None if it is not listed."""
    for key, flops, bandwidth in _CARDS:
        if key in name:
            return flops, bandwidth
    return None


GIB = 2**30


@dataclass(frozen=True)
class Host:
    """The device a process computes on: its first CUDA card (name, free and total bytes),
    or a CPU host."""

    cuda: bool
    card: str = ""
    free_bytes: int = 0
    total_bytes: int = 0

    @classmethod
    def here(cls) -> Host:
        """This process's first CUDA device (torch.cuda.mem_get_info), or a CPU host."""
        import torch  # local: importing this module stays free of torch

        if not torch.cuda.is_available():
            return cls(cuda=False)
        free, total = torch.cuda.mem_get_info()
        return cls(True, torch.cuda.get_device_name(), int(free), int(total))

    def describe(self) -> str:
        if not self.cuda:
            return "a CPU host"
        return f"{self.card} ({self.free_bytes / GIB:.0f} of {self.total_bytes / GIB:.0f} GiB free)"
