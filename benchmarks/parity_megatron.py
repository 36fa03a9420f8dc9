"""Log-prob parity of the megatron learner's replay against the reference engine, per TP size.

    OMP_NUM_THREADS=1 python benchmarks/parity_megatron.py [--families huginn,ouro]
        [--modes exact,fast] [--tps 1,2] [--max-new-tokens 24] [--prompts 4] [--seed 0]

For every family: `models.reference.generate` in exact mode (adaptive exits: Huginn KL(0.1),
Ouro gate q=0.8, as benchmarks/parity.py), then `learner.replay.replay` of those completions
through the megatron model built from the same HF weights (`learner.hf_convert`), at each TP
size (one `torchrun --standalone` per TP size). The Llama-like families use 4 query / 2
key-value heads so that TP=2 can split them. One JSON line per (family, pair, mode, tp):
{"family", "pair", "mode", "tp", "max_abs_logprob_diff", "tokens", "depth_min", "depth_max",
"seconds"}; pair = "megatron_vs_reference".

`pair_megatron_vs_reference(model, case, mode)` is the same comparison at TP=1 in the calling
process, in the shape of benchmarks/parity.py's PAIRS (it generates in `mode` too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # first: benchmarks/learner.py must not shadow the package

from parity_cases import make_case  # noqa: E402

from models.base import LoopedLM  # noqa: E402
from models.config import LlamaConfig, ModelConfig, tiny_config  # noqa: E402
from models.reference import ReplayItem, build_model, generate  # noqa: E402

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
PAIR = "megatron_vs_reference"


def bench_config(family: str) -> ModelConfig:
    """tiny_config; Llama-like families with 4 query / 2 key-value heads (TP=2 splits them)."""
    cfg = tiny_config(family)
    if family == "huginn":
        return cfg
    assert isinstance(cfg, LlamaConfig)
    return dataclasses.replace(cfg, num_attention_heads=4, num_key_value_heads=2)


def _compare(model: LoopedLM, policy: Any, case: Any, gen_mode: str, mode: str) -> dict[str, Any]:
    from learner.replay import replay

    gens = generate(model, case.prompts, case.seeds, case.sampling, case.policy, gen_mode)
    items = [
        ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
        for g in gens
    ]
    s = case.sampling
    res = replay(policy, items, temperature=s.temperature, top_p=s.top_p, numerics=mode)
    diff = max(float((g.logprobs - r.logprobs).abs().max()) for g, r in zip(gens, res))
    depths = [d for g in gens for d in g.exit_depths]
    return dict(
        max_abs_logprob_diff=diff,
        tokens=sum(len(g.tokens) for g in gens),
        depth_min=min(depths),
        depth_max=max(depths),
    )


def pair_megatron_vs_reference(model: LoopedLM, case: Any, mode: str) -> tuple[float, int, list]:
    """benchmarks/parity.py pair: reference generate vs megatron replay at TP=1, here."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import init_distributed

    if parallel_state.model_parallel_is_initialized() and not dist.is_initialized():
        # Another pair (vLLM's cleanup) destroyed the process groups megatron still points to.
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        init_distributed(1)
    options = MegatronOptions(kv=case.policy.kv)  # the case's exit KV semantics (contract 3)
    policy = build_policy(model.config, options, hf_state=model.state_dict())
    gens = generate(model, case.prompts, case.seeds, case.sampling, case.policy, mode)
    items = [
        ReplayItem(g.prompt_tokens, g.tokens, g.latent_seed, g.exit_depths, g.full_depth)
        for g in gens
    ]
    from learner.replay import replay

    s = case.sampling
    res = replay(policy, items, temperature=s.temperature, top_p=s.top_p, numerics=mode)
    diff = max(float((g.logprobs - r.logprobs).abs().max()) for g, r in zip(gens, res))
    return diff, sum(len(g.tokens) for g in gens), [d for g in gens for d in g.exit_depths]


def worker(args: argparse.Namespace) -> int:
    """One TP group (under torchrun): rank 0 prints the JSON lines."""
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed

    info = init_distributed(args.tp)
    for family in args.families.split(","):
        cfg = bench_config(family)
        ref = build_model(cfg, seed=args.seed)
        case = make_case(family, args.prompts, args.max_new_tokens, args.seed)
        policy = build_policy(cfg, MegatronOptions(), hf_state=ref.state_dict())
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            result = _compare(ref, policy, case, "exact", mode)
            line = dict(family=family, pair=PAIR, mode=mode, tp=args.tp, **result)
            line["seconds"] = round(time.perf_counter() - t0, 3)
            if info.rank == 0:
                print(json.dumps(line), flush=True)
    destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--tps", default="1,2", help="comma list of TP sizes (one torchrun each)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args(argv)
    for f in args.families.split(","):
        if f not in FAMILIES:
            ap.error(f"unknown family {f!r}; known: {', '.join(FAMILIES)}")
    for m in args.modes.split(","):
        if m not in ("exact", "fast"):
            ap.error(f"unknown numerics mode {m!r}; known: exact, fast")
    if args.tp:
        torch.set_num_threads(1)
        return worker(args)
    passthrough = [
        f"--families={args.families}",
        f"--modes={args.modes}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--prompts={args.prompts}",
        f"--seed={args.seed}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for tp in (int(t) for t in args.tps.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={tp}", __file__, f"--tp={tp}", *passthrough]
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode:
            print(f"TP={tp} run failed with exit code {done.returncode}", file=sys.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
