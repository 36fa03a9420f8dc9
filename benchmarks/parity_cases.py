"""The workloads and the command line shared by the parity benchmarks (benchmarks/parity.py
and the pairs in parity_vllm.py, parity_megatron.py, parity_cross.py, which import this module
and nothing of each other's command lines): the families and their exit policies, `Case`,
`make_case`, the reference pair, and `cli` (one JSON line per family x pair x mode)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.base import LoopedLM  # noqa: E402
from models.config import tiny_config  # noqa: E402
from models.exits import KL, ExitPolicy, FixedDepth, OuroGate, resolve_kv  # noqa: E402
from models.reference import ReplayItem, SamplingParams, build_model, generate, replay  # noqa: E402

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
POLICIES: dict[str, ExitPolicy] = {
    "huginn": KL(0.1),
    "ouro": OuroGate(0.8),
    "nanbeige": FixedDepth(4),
    "llama": FixedDepth(1),
}
VARIANTS: dict[str, tuple[str, ExitPolicy]] = {  # name: (family, policy)
    "ouro_kv_full": ("ouro", OuroGate(0.8, kv="full")),
    "ouro_kv_last_exited": ("ouro", OuroGate(0.8, kv="last_exited")),
    "huginn_depth48": ("huginn", FixedDepth(48)),
}


@dataclass(frozen=True)
class Case:
    """The workload of one family: prompts, seeds, sampling, exit policy."""

    prompts: list[list[int]]
    seeds: list[int]
    sampling: SamplingParams
    policy: ExitPolicy


PairFn = Callable[[LoopedLM, Case, str], tuple[float, int, list[int]]]


def pair_reference(model: LoopedLM, case: Case, mode: str) -> tuple[float, int, list[int]]:
    """Sequential generate vs parallel replay of the same completions."""
    gens = generate(model, case.prompts, case.seeds, case.sampling, case.policy, mode)
    items = [
        ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
        for g in gens
    ]
    s = case.sampling
    results = replay(
        model, items, temperature=s.temperature, top_p=s.top_p, numerics=mode, kv=case.policy.kv
    )
    diff = max(float((g.logprobs - r.logprobs).abs().max()) for g, r in zip(gens, results))
    depths = [d for g in gens for d in g.exit_depths]
    return diff, sum(len(g.tokens) for g in gens), depths


def make_case(family: str, n_prompts: int, max_new_tokens: int, seed: int) -> Case:
    """`family` is one of FAMILIES or VARIANTS."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n_prompts):
        length = 3 + (5 * i) % 10
        prompts.append(torch.randint(3, 512, (length,), generator=gen).tolist())
    seeds = [int(torch.randint(0, 2**62, (1,), generator=gen)) for _ in range(n_prompts)]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=max_new_tokens)
    policy = VARIANTS[family][1] if family in VARIANTS else POLICIES[family]
    return Case(prompts, seeds, sampling, policy)


def cli(argv: list[str] | None, pairs_known: Mapping[str, PairFn], default: str, doc: str) -> int:
    """Parse ``argv`` and print one JSON line per family x pair x numerics mode."""
    PAIRS = pairs_known
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--pairs", default=default, help=f"comma list of {sorted(PAIRS)}")
    ap.add_argument("--families", default=",".join([*FAMILIES, *VARIANTS]))
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pairs = [p for p in args.pairs.split(",") if p]
    for p in pairs:
        if p not in PAIRS:
            ap.error(f"unknown pair {p!r}; known pairs: {', '.join(sorted(PAIRS))}")
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES and f not in VARIANTS:
            ap.error(f"unknown family {f!r}; known: {', '.join([*FAMILIES, *VARIANTS])}")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("exact", "fast"):
            ap.error(f"unknown numerics mode {m!r}; known: exact, fast")
    torch.set_num_threads(1)
    for family in families:
        base = VARIANTS[family][0] if family in VARIANTS else family
        model = build_model(tiny_config(base), seed=args.seed)
        case = make_case(family, args.prompts, args.max_new_tokens, args.seed)
        for pair in pairs:
            for mode in modes:
                t0 = time.perf_counter()
                diff, tokens, depths = PAIRS[pair](model, case, mode)
                line = {
                    "family": family,
                    "pair": pair,
                    "mode": mode,
                    "max_abs_logprob_diff": diff,
                    "tokens": tokens,
                    "depth_min": min(depths),
                    "depth_max": max(depths),
                    "kv": resolve_kv(case.policy, model.config),
                    "seconds": round(time.perf_counter() - t0, 3),
                }
                print(json.dumps(line), flush=True)
    return 0
