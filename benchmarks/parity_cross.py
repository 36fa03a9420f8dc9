"""The "megatron_vs_vllm" pair: vLLM plugin generations replayed by the megatron learner.

    OMP_NUM_THREADS=1 python benchmarks/parity_cross.py [--families huginn,ouro]
        [--modes exact,fast] [--tps 1,2] [--max-new-tokens 24] [--prompts 4] [--seed 0]

For every family and numerics mode: the model (parity_megatron.bench_config, so that TP=2
splits the Llama-like families' 4 query / 2 key-value heads) is served by
`generator.engine.LoopedEngine` exactly as benchmarks/parity_vllm.py does (the case of
benchmarks/parity.py: its prompts, latent seeds, sampling and exit policy, Huginn KL(0.1),
Ouro gate q=0.8), and the completions it sampled (tokens, latent seeds, the exit depths vLLM
recorded) are replayed by `learner.replay.replay` through the megatron model built from the
same HF weights, at every TP size (one `torchrun --standalone` per TP size, gloo on a CPU
host; the completions travel in a temporary file). The figure is max |behaviour log-prob
recorded by vLLM - megatron replay log-prob|. One JSON line per (family, pair, mode, tp):
{"family", "pair", "mode", "tp", "max_abs_logprob_diff", "tokens", "depth_min", "depth_max",
"seconds"}; pair = "megatron_vs_vllm"; seconds = vLLM generation (engine start included) +
megatron policy build and replay at that TP size (torchrun start-up excluded).

The depth-1 Llama is served by vLLM's own LlamaForCausalLM, whose log-probs come from vLLM's
sampler, not from the reference recipe: exact mode is not bit-identical there (~5e-7).

`pair_megatron_vs_vllm(model, case, mode)` is the same comparison in the shape of
benchmarks/parity.py's PAIRS: it returns the largest difference over TP=1 and TP=2 (that
format has no "tp" field; the per-TP lines are this script's). A model whose heads TP=2
cannot split (the tiny Llama-like families: 2 query / 1 key-value head) is replaced by the
same config with 4 / 2 heads, built with `build_model(seed=0)` (parity.py's default seed),
so that one generation is replayed at both TP sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # first: benchmarks/learner.py must not shadow the package

from parity_cases import make_case  # noqa: E402
from parity_megatron import bench_config  # noqa: E402
from parity_vllm import vllm_samples  # noqa: E402

from models.base import LoopedLM  # noqa: E402
from models.config import HuginnConfig, LlamaConfig, ModelConfig  # noqa: E402
from models.reference import ReplayItem, build_model  # noqa: E402

FAMILIES = ("huginn", "ouro", "nanbeige", "llama")
PAIR = "megatron_vs_vllm"
TPS = (1, 2)


@dataclasses.dataclass
class Job:
    """One vLLM generation (a family in one numerics mode) to replay at every TP size."""

    family: str
    mode: str
    config: ModelConfig
    state: dict[str, torch.Tensor]
    items: list[ReplayItem]
    """prompt, completion tokens, latent seed and exit depths, as vLLM sampled them."""
    logprobs: list[torch.Tensor]
    """fp32 [T] behaviour log-probs vLLM recorded, per item."""
    temperature: float
    top_p: float
    gen_seconds: float
    kv: str | None = None
    """The exit policy's KV semantics (docs/CONTRACTS.md 3; None = the family's default)."""


def splits(config: ModelConfig, tp: int) -> bool:
    """Whether megatron's TP=tp can split the query and key/value heads of `config`."""
    if isinstance(config, HuginnConfig):
        return config.n_heads % tp == 0
    return config.num_attention_heads % tp == 0 and config.num_key_value_heads % tp == 0


def splittable_model(model: LoopedLM, tps: Sequence[int], seed: int = 0) -> LoopedLM:
    """`model`, or (Llama-like heads TP cannot split) its config with 4 query / 2 key-value
    heads built from `seed` (parity_megatron.bench_config's widening)."""
    cfg = model.config
    if all(splits(cfg, tp) for tp in tps):
        return model
    assert isinstance(cfg, LlamaConfig), "Huginn heads are split as they are"
    wide = dataclasses.replace(cfg, num_attention_heads=4, num_key_value_heads=2)
    if not all(splits(wide, tp) for tp in tps):
        raise ValueError(f"TP sizes {list(tps)} do not split 4 query / 2 key-value heads")
    return build_model(wide, seed=seed)


def vllm_generate(model: LoopedLM, case: Any, mode: str, family: str) -> Job:
    """Serve `model` with LoopedEngine (numerics `mode`, the case's exit policy) and sample
    every prompt once with its latent seed, as parity_vllm.pair_vllm_vs_reference does."""

    t0 = time.perf_counter()
    s = case.sampling
    samples = vllm_samples(model, case, mode)
    items = [
        ReplayItem(
            list(p),
            x.tokens.tolist(),
            int(x.latent_seed),
            [int(d) for d in x.exit_depths],
            x.full_depth or None,
        )
        for p, x in zip(case.prompts, samples)
    ]
    return Job(
        family=family,
        mode=mode,
        config=model.config,
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        items=items,
        logprobs=[torch.from_numpy(x.logprobs.astype("float32")) for x in samples],
        temperature=s.temperature,
        top_p=s.top_p,
        gen_seconds=time.perf_counter() - t0,
        kv=case.policy.kv,
    )


def megatron_replay(jobs: Sequence[Job], tp: int) -> list[tuple[list[torch.Tensor], float]]:
    """Replay every job's completions through the megatron model at TP=tp (one torchrun):
    per job, (replay log-probs per item, seconds of policy build + replay)."""
    with tempfile.TemporaryDirectory() as tmp:
        payload, out = Path(tmp) / "jobs.pt", Path(tmp) / "out.pt"
        keys = ("mode", "config", "state", "temperature", "top_p", "kv")
        specs = [dict({k: getattr(j, k) for k in keys}, items=j.items) for j in jobs]
        torch.save(specs, payload)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={tp}", __file__, f"--tp={tp}"]
        cmd += [f"--worker={payload}", f"--out={out}"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode:
            raise RuntimeError(f"megatron replay at TP={tp} failed (exit {done.returncode})")
        return torch.load(out, weights_only=False)


def worker(tp: int, payload: str, out: str) -> int:
    """Under torchrun: replay the jobs of `payload`; rank 0 writes the results to `out`."""
    from learner.megatron.model import build_policy
    from learner.megatron.options import MegatronOptions
    from learner.parallel import destroy_distributed, init_distributed
    from learner.replay import replay

    specs = torch.load(payload, weights_only=False)
    info = init_distributed(tp)
    results = []
    for spec in specs:
        t0 = time.perf_counter()
        options = MegatronOptions(kv=spec["kv"])
        policy = build_policy(spec["config"], options, hf_state=spec["state"])
        res = replay(
            policy,
            spec["items"],
            temperature=spec["temperature"],
            top_p=spec["top_p"],
            numerics=spec["mode"],
        )
        results.append(([r.logprobs for r in res], time.perf_counter() - t0))
    if info.rank == 0:
        torch.save(results, out)
    destroy_distributed()
    return 0


def compare(job: Job, replayed: list[torch.Tensor]) -> dict[str, Any]:
    """max |vLLM behaviour log-prob - megatron replay log-prob| and the counts of a job."""
    diff = max(float((a - b).abs().max()) for a, b in zip(job.logprobs, replayed, strict=True))
    depths = [d for it in job.items for d in it.exit_depths]
    return dict(
        max_abs_logprob_diff=diff,
        tokens=sum(len(it.completion_tokens) for it in job.items),
        depth_min=min(depths),
        depth_max=max(depths),
    )


def run_cross(
    model: LoopedLM, case: Any, mode: str, tps: Sequence[int] = TPS, seed: int = 0
) -> tuple[Job, list[dict[str, Any]]]:
    """One family in one mode: vLLM generation, megatron replay at every TP size; the job and
    its JSON-line dicts (one per TP size)."""
    model = splittable_model(model, tps, seed)
    job = vllm_generate(model, case, mode, model.config.family_name)
    lines = []
    for tp in tps:
        ((replayed, secs),) = megatron_replay([job], tp)
        line = dict(family=job.family, pair=PAIR, mode=mode, tp=tp, **compare(job, replayed))
        lines.append(dict(line, seconds=round(job.gen_seconds + secs, 3)))
    return job, lines


def pair_megatron_vs_vllm(model: LoopedLM, case: Any, mode: str) -> tuple[float, int, list[int]]:
    """benchmarks/parity.py pair: vLLM generation vs megatron replay, max over TP=1 and 2."""
    job, lines = run_cross(model, case, mode)
    depths = [d for it in job.items for d in it.exit_depths]
    return max(x["max_abs_logprob_diff"] for x in lines), lines[0]["tokens"], depths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--tps", default="1,2", help="comma list of TP sizes (one torchrun each)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # payload file
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)  # results file
    args = ap.parse_args(argv)
    if args.tp:
        torch.set_num_threads(1)
        return worker(args.tp, args.worker, args.out)
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            ap.error(f"unknown family {f!r}; known: {', '.join(FAMILIES)}")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("exact", "fast"):
            ap.error(f"unknown numerics mode {m!r}; known: exact, fast")
    tps = [int(t) for t in args.tps.split(",") if t]
    torch.set_num_threads(1)
    jobs = []
    for family in families:
        model = build_model(bench_config(family), seed=args.seed)
        case = make_case(family, args.prompts, args.max_new_tokens, args.seed)
        jobs += [vllm_generate(model, case, mode, family) for mode in modes]
    replays = {tp: megatron_replay(jobs, tp) for tp in tps}
    for i, job in enumerate(jobs):
        for tp in tps:
            replayed, secs = replays[tp][i]
            line = dict(family=job.family, pair=PAIR, mode=job.mode, tp=tp)
            line.update(compare(job, replayed), seconds=round(job.gen_seconds + secs, 3))
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
