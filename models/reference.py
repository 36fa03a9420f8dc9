"""Reference generation and replay: the numerical spec vLLM and megatron are tested against.

`generate` decodes token by token with a KV cache per (iteration, layer) and an exit policy;
`replay` recomputes the same completions in one parallel forward per iteration from the
recorded `exit_depths`. In `exact` numerics replay reproduces generation's behaviour
log-probs bit for bit; in `fast` numerics the difference is small and measured
(benchmarks/parity.py).

Behaviour log-probs (docs/CONTRACTS.md 4) of a position with fp32 logits l (the first
`vocab_size` entries; padded rows are dropped):

    z  = l / temperature                                  (fp32 division)
    z  = top_p_filter(z, top_p)                           (only if top_p < 1)
    lp = log_softmax(z)                                   (fp32; exact: fp64 then fp32)

top_p_filter follows vLLM's rule: sort z ascending (stable), p = softmax(sorted z),
c = cumsum(p); drop entries with c <= 1 - top_p, never the largest; dropped entries become
-inf, so their log-prob is -inf and the rest renormalise over the nucleus (the distribution
actually sampled from). Greedy decoding takes argmax(lp) (first index on ties) and still
reports lp of that token. Sampling draws q ~ Exp(1)^V, counter-based from the key
`sampling_seed(latent_seed, offset)` (`latent_seed ^ SAMPLING_SALT` at offset 0; a
conversation's turn k uses offset k, so its turns do not reuse one another's numbers) and the
token's index t (models.sampling), and takes argmax(exp(lp) / q): reproducible per (latent
seed, offset), independent of batch composition. Entropy = -sum_{lp > -inf} exp(lp) lp.

Depths (contract 2): the prompt runs the full depth D (the policy's max depth, which may
exceed the model's trained depth up to 255), except its last position, which samples token 0
and consults the exit policy where the family's official code does
(`models.exits.token0_follows_policy`: Ouro, not Huginn); the position that samples completion
token t exited after `exit_depths[t]` iterations. `Generation.full_depth` is D; replay takes it
from `ReplayItem.full_depth` (None = `exit_depths[0]`: completions generated before token 0
followed the policy ran D there). Where token 0 follows the policy the prompt is fed as two
chunks (positions 0..P-2 at D, then position P-1 as a decoded position with the policy), which
in exact numerics computes what one chunk does. KV semantics of exited tokens (contract 3): the
policy's `kv` (None = the family's default, `models.exits.default_kv`); replay takes the same
`kv`. With kv='full' every position runs D iterations and samples from its state after
`exit_depths[t]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from models import numerics as nx
from models.base import LoopedLM
from models.config import HuginnConfig, LlamaConfig, ModelConfig, NanbeigeConfig, OuroConfig
from models.depths import full_depth
from models.engine.chunk import KVCache, run_chunk
from models.engine.graph import GraphDecoder
from models.exits import (
    ExitPolicy,
    FixedDepth,
    SampledGate,
    check_kv,
    is_sampled,
    resolve_kv,
    resolve_max_depth,
    token0_follows_policy,
)
from models.sampling import draw
from models.seeds import check_latent_seed
from models.token_rows import response_slice, token_rows
from proto.records import MAX_DEPTH

SAMPLING_SALT = 0x5341_4D50_4C45_5253  # b"SAMPLERS"
_MASK64 = (1 << 64) - 1


def sampling_seed(latent_seed: int, offset: int = 0) -> int:
    """The sampler's key (models.sampling) for a completion of ``latent_seed`` started
    with sampling-seed offset ``offset`` (a multi-turn conversation's model turn: 0, 1, ...;
    generator.multiturn): ``latent_seed ^ SAMPLING_SALT`` at offset 0 (every single-turn
    completion), else that value and the offset mixed by splitmix64's finaliser, so each turn
    of one conversation draws its own random numbers. The latent noise is not affected: it
    stays a function of (latent_seed, absolute position) alone (contract 1)."""
    base = (int(latent_seed) ^ SAMPLING_SALT) & _MASK64
    if offset == 0:
        return base
    if offset < 0:
        raise ValueError(f"sampling-seed offset {offset}: must be >= 0")
    z = (base + int(offset) * 0x9E37_79B9_7F4A_7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from the behaviour distribution."""

    temperature: float = 1.0
    """Logits are divided by this (> 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 = no filter."""
    max_new_tokens: int = 16
    """Completion length limit (>= 1)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after sampling one of these (the stop token is kept)."""
    greedy: bool = False
    """argmax instead of sampling."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class Generation:
    """One completion."""

    prompt_tokens: list[int]
    tokens: list[int]
    """Completion token ids (ends with the stop token if one was sampled)."""
    logprobs: Tensor
    """[n] fp32 behaviour log-probs of `tokens`."""
    exit_depths: list[int]
    """[n] iterations run at the position that sampled each token (token 0 included)."""
    latent_seed: int
    finish_reason: str
    """'stop' or 'length'."""
    full_depth: int = 0
    """D: the iterations the prompt's other positions ran (the policy's max depth)."""
    exit_logprobs: Tensor | None = None
    """[n] fp32 log-probability of each token's sampled exit (a SampledGate policy), else
    None (the exit was not an action)."""


@dataclasses.dataclass(frozen=True)
class ReplayItem:
    """One recorded completion to recompute."""

    prompt_tokens: Sequence[int]
    completion_tokens: Sequence[int]
    latent_seed: int
    exit_depths: Sequence[int]
    full_depth: int | None = None
    """D, the depth the prompt ran (`Generation.full_depth`); None = exit_depths[0] (older
    completions, whose token 0 ran D)."""


@dataclasses.dataclass
class ReplayResult:
    """Recomputed values of one completion."""

    logprobs: Tensor
    """[n] fp32 behaviour log-probs of the completion tokens."""
    entropies: Tensor
    """[n] fp32 entropy of each sampled-from distribution."""
    hidden: Tensor
    """[n, h] hidden state the head read at each sampling position (for a value head)."""
    exit_logprobs: Tensor | None = None
    """[n] fp32 log-probability of each token's recorded exit under a SampledGate
    (``replay(exit_policy=...)``), else None."""


def top_p_filter(z: Tensor, top_p: float, mode: str = "fast") -> Tensor:
    """Set logits outside the nucleus to -inf (vLLM's rule; see module doc)."""
    if top_p >= 1.0:
        return z
    vals, idx = z.sort(dim=-1, descending=False, stable=True)
    dt = torch.float64 if mode == "exact" else torch.float32
    cum = torch.softmax(vals.to(dt), dim=-1).cumsum(dim=-1)
    drop = cum <= torch.tensor(1.0, dtype=dt) - torch.tensor(top_p, dtype=dt)
    drop[..., -1] = False
    vals = vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(-1, idx, vals)


def behaviour_logprobs(
    logits: Tensor, vocab_size: int, temperature: float, top_p: float, mode: str = "fast"
) -> Tensor:
    """[N, V] fp32 log-probs of the distribution sampled from (see module doc)."""
    z = logits[..., :vocab_size].float() / torch.tensor(temperature, dtype=torch.float32)
    return nx.log_softmax(top_p_filter(z, top_p, mode), mode)


def entropy(logprobs: Tensor) -> Tensor:
    """-sum exp(lp) lp over the finite entries, fp32."""
    p = logprobs.exp()
    return -torch.where(torch.isfinite(logprobs), p * logprobs, 0.0).sum(dim=-1)


def _check_seed(seed: int) -> int:
    return check_latent_seed(seed, "latent seeds")


@torch.no_grad()
def generate(
    model: LoopedLM,
    prompts: Sequence[Sequence[int]],
    latent_seeds: Sequence[int],
    sampling: SamplingParams,
    exit_policy: ExitPolicy | None = None,
    numerics: str = "fast",
    *,
    graph: bool = False,
    sampling_offsets: Sequence[int] | None = None,
) -> list[Generation]:
    """Decode every prompt token by token (batched; see module doc). Default policy: full
    depth. ``sampling_offsets``: per prompt, the sampling-seed offset (`sampling_seed`; None:
    all 0, a single-turn completion).

    graph=True (fixed depth only: `FixedDepth` or the default policy) decodes through
    `models.engine.graph.GraphDecoder`: one CUDA graph replayed per token on CUDA, the same
    sync-free step eagerly on the CPU. Finished rows keep being fed (their outputs ignored).
    Prefill and sampling are the same; tokens, log-probs and depths equal graph=False's."""
    nx.check_mode(numerics)
    if graph and exit_policy is not None and not isinstance(exit_policy, FixedDepth):
        raise ValueError(
            f"generate(graph=True) needs a fixed depth (FixedDepth), not "
            f"{type(exit_policy).__name__}: an adaptive exit decides per token on the device's "
            "values, control flow a CUDA graph cannot hold; use graph=False"
        )
    if len(prompts) != len(latent_seeds) or not prompts:
        raise ValueError("need one latent seed per prompt and at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must not be empty")
    seeds = [_check_seed(s) for s in latent_seeds]
    policy = exit_policy if exit_policy is not None else FixedDepth(model.max_depth)
    depth = resolve_max_depth(policy, model.max_depth)
    kv = resolve_kv(policy, model.config)
    bsz, lens = len(prompts), [len(p) for p in prompts]
    cache = KVCache.empty(model, bsz, max(lens) + sampling.max_new_tokens, depth)
    offsets = list(sampling_offsets) if sampling_offsets is not None else [0] * len(seeds)
    if len(offsets) != len(seeds):
        raise ValueError(f"{len(offsets)} sampling offsets for {len(seeds)} prompts")
    keys = [sampling_seed(s, o) for s, o in zip(seeds, offsets)]
    toks = torch.zeros(bsz, max(lens), dtype=torch.int64)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
    last = torch.tensor(lens) - 1
    if token0_follows_policy(policy, model.config):
        # token 0 follows the policy (contract 2): positions 0..P-2 at D, then the last one
        if max(lens) > 1:
            head = toks[:, : max(lens) - 1]
            positions = torch.arange(head.shape[1]).expand(bsz, -1)
            run_chunk(model, cache, head, positions, positions < last[:, None], seeds,
                      max_depth=depth, depths=torch.full(head.shape, depth), mode=numerics,
                      kv=kv)  # fmt: skip
        feed = toks[torch.arange(bsz), last][:, None]
        out = run_chunk(model, cache, feed, last[:, None], torch.ones(bsz, 1, dtype=torch.bool),
                        seeds, max_depth=depth, policy=policy, mode=numerics, kv=kv)  # fmt: skip
        logits = out.logits[:, 0]
        step_depths = out.depths[:, 0].tolist()
        step_elp = out.exit_logprobs
    else:
        step_elp = None
        positions = torch.arange(max(lens)).expand(bsz, -1)
        valid = positions < torch.tensor(lens)[:, None]
        out = run_chunk(
            model,
            cache,
            toks,
            positions,
            valid,
            seeds,
            max_depth=depth,
            depths=torch.full(toks.shape, depth),
            mode=numerics,
            kv=kv,
        )
        logits = out.logits[torch.arange(bsz), last]
        step_depths = [depth] * bsz
    tokens: list[list[int]] = [[] for _ in range(bsz)]
    lps: list[list[float]] = [[] for _ in range(bsz)]
    deps: list[list[int]] = [[] for _ in range(bsz)]
    elps: list[list[float]] = [[] for _ in range(bsz)]
    sampled = is_sampled(policy)
    finish = [""] * bsz
    decoder = GraphDecoder(model, cache, seeds, depth=depth, mode=numerics) if graph else None
    for step in range(sampling.max_new_tokens):
        lp = behaviour_logprobs(
            logits, model.vocab_size, sampling.temperature, sampling.top_p, numerics
        )
        drawn = draw(lp, keys, [step] * bsz, sampling.greedy)  # models.sampling
        for b in range(bsz):
            if finish[b]:
                continue
            tok = drawn[b]
            tokens[b].append(tok)
            lps[b].append(float(lp[b, tok]))
            deps[b].append(step_depths[b])
            if sampled:  # token 0 of a family whose prompt ignores the policy: no action
                elps[b].append(0.0 if step_elp is None else float(step_elp[b, 0]))
            if tok in sampling.stop_token_ids:
                finish[b] = "stop"
            elif len(tokens[b]) == sampling.max_new_tokens:
                finish[b] = "length"
        if all(finish) or step + 1 == sampling.max_new_tokens:
            break
        live = torch.tensor([not f for f in finish])
        feed = torch.tensor([t[-1] if t else 0 for t in tokens])[:, None]
        pos = torch.tensor([lens[b] + len(tokens[b]) - 1 for b in range(bsz)])[:, None]
        if decoder is not None:  # finished rows are fed too (their outputs are ignored)
            out = decoder.step(feed[:, 0], pos[:, 0])
        else:
            out = run_chunk(
                model, cache, feed, pos, live[:, None], seeds, max_depth=depth, policy=policy,
                mode=numerics, kv=kv,
            )  # fmt: skip
        logits = out.logits[:, 0]
        step_depths = out.depths[:, 0].tolist()
        step_elp = out.exit_logprobs
    return [
        Generation(
            prompt_tokens=list(prompts[b]),
            tokens=tokens[b],
            logprobs=torch.tensor(lps[b], dtype=torch.float32),
            exit_depths=deps[b],
            latent_seed=seeds[b],
            finish_reason=finish[b] or "length",
            full_depth=depth,
            exit_logprobs=torch.tensor(elps[b], dtype=torch.float32) if sampled else None,
        )
        for b in range(bsz)
    ]


def _check_item(item: ReplayItem) -> int:
    n = len(item.completion_tokens)
    if n == 0 or len(item.exit_depths) != n or not item.prompt_tokens:
        raise ValueError("a replay item needs a prompt, >= 1 completion token, one depth each")
    full = full_depth(item.exit_depths, MAX_DEPTH, item.full_depth)
    _check_seed(item.latent_seed)
    return full


@torch.no_grad()
def replay(
    model: LoopedLM,
    items: Sequence[ReplayItem],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    numerics: str = "fast",
    kv: str | None = None,
    exit_policy: ExitPolicy | None = None,
) -> list[ReplayResult]:
    """Recompute completions in one parallel forward per iteration (mixed lengths padded).
    kv: the KV semantics they were generated with (None = the family's default, or the
    exit policy's). exit_policy: the policy they were generated with; a SampledGate also
    recomputes each token's exit log-probability (`ReplayResult.exit_logprobs`)."""
    nx.check_mode(numerics)
    if kv is None:
        kv = resolve_kv(exit_policy, model.config)
    kv = check_kv(kv)
    if not items:
        return []
    fulls = [_check_item(it) for it in items]
    lay = token_rows([it.prompt_tokens for it in items], [it.completion_tokens for it in items],
                     [it.exit_depths for it in items], full_depths=fulls)  # fmt: skip
    bsz, length = len(items), lay.length
    positions = torch.arange(length).expand(bsz, -1)
    valid = positions < torch.from_numpy(lay.seq_lens)[:, None]
    cache = KVCache.empty(model, bsz, length, max(fulls))
    out = run_chunk(
        model,
        cache,
        torch.from_numpy(lay.input_ids),
        positions,
        valid,
        [it.latent_seed for it in items],
        max_depth=max(fulls),
        depths=torch.from_numpy(lay.depths),
        mode=numerics,
        kv=kv,
        row_depths=fulls if kv == "full" else None,
        exit_lp=(exit_policy.min_depth, fulls) if isinstance(exit_policy, SampledGate) else None,
    )
    token0 = token0_follows_policy(exit_policy, model.config)
    results = []
    for b, it in enumerate(items):
        rows = response_slice(len(it.prompt_tokens), len(it.completion_tokens))
        lp = behaviour_logprobs(out.logits[b, rows], model.vocab_size, temperature, top_p, numerics)
        target = torch.tensor([int(t) for t in it.completion_tokens], dtype=torch.int64)
        results.append(
            ReplayResult(
                logprobs=lp.gather(-1, target[:, None].to(lp.device))[:, 0],
                entropies=entropy(lp),
                hidden=out.hidden[b, rows],
                exit_logprobs=None
                if out.exit_logprobs is None
                else _exit_lps(out.exit_logprobs[b, rows], token0),
            )
        )
    return results


def _exit_lps(elp: Tensor, token0: bool) -> Tensor:
    """fp32 exit log-probs of a completion; token 0's is 0 where the prompt ignored the policy."""
    out = elp.to(torch.float32).clone()
    if not token0:
        out[0] = 0.0
    return out


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoopedLM:
    """The reference module of `config`'s family, deterministically initialised from `seed`
    (std: Huginn's init_values['std']; others 'initializer_range' if given, else 0.02).
    Parameters are cast to `dtype`; Huginn's `freqs_cis` buffer stays fp32."""
    from models.huginn import HuginnForCausalLM
    from models.llama import LlamaForCausalLM
    from models.nanbeige import NanbeigeLoopedForCausalLM
    from models.ouro import OuroForCausalLM

    model: LoopedLM
    if isinstance(config, HuginnConfig):
        model, std = HuginnForCausalLM(config), config.init_std
    else:
        std = float(dict(config.hf_extra).get("initializer_range", 0.02))
        if isinstance(config, OuroConfig):
            model = OuroForCausalLM(config)
        elif isinstance(config, NanbeigeConfig):
            model = NanbeigeLoopedForCausalLM(config)
        elif isinstance(config, LlamaConfig):
            model = LlamaForCausalLM(config)
        else:
            raise TypeError(f"not a model config: {type(config).__name__}")
    model.init_weights(seed, std)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


__all__ = [
    "SAMPLING_SALT",
    "sampling_seed",
    "Generation",
    "ReplayItem",
    "ReplayResult",
    "SamplingParams",
    "behaviour_logprobs",
    "build_model",
    "entropy",
    "generate",
    "replay",
    "top_p_filter",
]
