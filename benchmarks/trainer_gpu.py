"""The real learner's `Trainer.step` on synthetic rollouts: tokens/s, MFU, memory, one JSON line.

    python benchmarks/trainer_gpu.py --shape huginn_1b         # ~1B Huginn shape, r = 4
    python benchmarks/trainer_gpu.py --shape huginn_0125       # Huginn-0125: r = 32, k = 8
    python benchmarks/trainer_gpu.py --shape ouro_1b --tp 2    # Ouro-1.4B shape (torchrun, 2 GPUs)
    python benchmarks/trainer_gpu.py --device cpu --tiny       # CPU smoke test (tests/learner)
    python benchmarks/trainer_gpu.py --device cpu --shape small --exit-depths uniform [--no-compact]
                                            # a learned exit's depths: depth batching vs masked
    python benchmarks/trainer_gpu.py --shape huginn_0125 --compile --layout packed --batch 16
                                            # packed rows on responses U(256, 4096)
    torchrun --nproc-per-node 2 benchmarks/trainer_gpu.py ...   # DP = 2 (or --tp 2)

The Trainer is built exactly as `looprl learner` builds it: a RunConfig (`--set key=value`
overrides on top of the flags) through `pipeline.backends.megatron_adapter.build_learner_trainer` (the
run-config mapping: megatron DDP + DistributedOptimizer, the GRPO objective, global batch =
prompts_per_step x n, micro-batching, critic off, `learner.*` precision / backprop depth /
recompute / compile). Weights: Huginn's own init (`init_state`: truncated normal with
the config's init std, out projections std / sqrt(2 x effective depth), norms 1, biases 0),
drawn on the device. Rollouts: groups of `n` completions of one random prompt, every position
at the full depth r (fixed recurrence, as the seed's recipe), random tokens, behaviour
log-probs ~ -log V + U(-0.5, 0.5) (near the random init's), rewards 0/1; new ones each step.

Learning rate: each shape's realistic rate (`--lr`; 1e-6 at Huginn-0125's 3.5B, 1e-5 at ~1B),
not the run config's small-model default (3e-3 collapses the compiled Huginn-0125 run). The line
carries the loss and gradient-norm trajectory and a `health` verdict (benchmarks/health.py: collapse =
a constant loss or a vanishing gradient norm for 3 steps in a row; spikes; diverging;
nonfinite; ok).

Timed: `--steps` calls of `trainer.step` after `--warmup` calls (compilation, allocator), each
synchronised, wall clock (the CPU side of the step is part of it). FLOPs per token (state what
counts; matmuls only, norms and element-wise ops omitted):
    2 x P_nograd + 6 x P_grad + 6 x V x h x R / seq + attention,
    P_grad = (prelude + coda) x block + k x (core x block + adapter), P_nograd = (r - k) x
             (core x block + adapter), V x h: the head, which runs at the R = seq - prompt + 1
             response positions of a row only (`mfu_head_every_position`: at all seq, as the
             benchmark counted before the head skipped the prompt rows),
    block = 4 h^2 + 3 h f (qkv, proj, SwiGLU), adapter = 2 h^2,
    attention = (4 x L_nograd + 12 x L_grad) x seq x h (QK^T and AV as full s x s products),
    L_grad = prelude + coda + k x core, L_nograd = (r - k) x core.
No-grad iterations count as forward only. MFU = FLOP/s / (989e12 x GPUs) (H100/H200 dense
bf16 datasheet; the learner.py stand-in used the same); tokens/s counts all ranks' tokens. k = min(backprop depth, r) (0 = all = r).

Layouts (`--layout`): `full` (the default, above: every row `seq` positions);
`padded`: a realistic length spread, responses uniform in [--resp-min, --resp-max] tokens
(default 256-4,096) after the shape's prompt, today's rows padded to the longest of each
micro-batch (`--micro` rows); `packed` (`--packed`): the same spread, learner.
max_tokens_per_micro = `--budget` (default micro x seq) positions per forward/backward,
packed rows. For the spread layouts the FLOPs are counted per sequence on its real tokens only
(attention per sequence: (4 L_nograd + 12 L_grad) x n x h per token of a length-n sequence;
the head at its response positions), so `mfu` is MFU on real tokens; `padding_fraction` is
the share of the positions the model computed that were padding (from the same micro-batches
the step cuts). `process_cpu_s_median`: the process's CPU seconds a step (all its threads; on a
shared CPU host a steadier figure than the wall clock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.health import health  # noqa: E402

PEAK_BF16 = 989e12

SHAPES: dict[str, dict[str, Any]] = {
    "huginn_1b": dict(hidden=2048, heads=16, prelude=2, core=4, coda=2, ffn=5632, vocab=65536,
                      recurrence=4, backprop_depth=8, seq=2048, batch=16, n=4, micro=4, lr=1e-5),
    "huginn_0125": dict(hidden=5280, heads=55, prelude=2, core=4, coda=2, ffn=17920,
                        vocab=65536, recurrence=32, backprop_depth=8, seq=2048, batch=4, n=2,
                        micro=2, lr=1e-6),
    "ouro_1b": dict(family="ouro", hidden=2048, heads=16, prelude=0, core=24, coda=0,
                    ffn=5632, vocab=49152, recurrence=4, backprop_depth=0, seq=2048, batch=8,
                    n=4, micro=1, lr=1e-5),
    "small": dict(hidden=256, heads=4, prelude=1, core=2, coda=1, ffn=768, vocab=2048,
                  recurrence=4, backprop_depth=2, seq=512, batch=16, n=4, micro=4, lr=1e-4),
    "ouro_small": dict(family="ouro", hidden=256, heads=4, prelude=0, core=4, coda=0, ffn=768,
                       vocab=2048, recurrence=4, backprop_depth=0, seq=512, batch=16, n=4,
                       micro=4, lr=1e-4),
    "tiny": dict(hidden=64, heads=2, prelude=1, core=2, coda=1, ffn=128, vocab=512,
                 recurrence=4, backprop_depth=2, seq=32, batch=4, n=2, micro=2, lr=1e-4),
}  # fmt: skip


def model_config(s: dict[str, Any]) -> Any:
    """The shape's HuginnConfig, or an OuroConfig (family ouro: core = its layers, looped
    `recurrence` times)."""
    from models.config import HuginnConfig, OuroConfig

    if s.get("family") == "ouro":
        return OuroConfig.from_hf_dict(
            dict(
                model_type="ouro", vocab_size=s["vocab"], hidden_size=s["hidden"],
                intermediate_size=s["ffn"], num_hidden_layers=s["core"],
                num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                head_dim=s["hidden"] // s["heads"], rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=max(4096, s["seq"]), total_ut_steps=s["recurrence"],
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            )
        )  # fmt: skip

    return HuginnConfig.from_hf_dict(
        dict(
            model_type="huginn_raven", n_embd=s["hidden"], n_heads=s["heads"],
            n_layers=s["prelude"] + s["core"] + s["coda"], n_layers_in_prelude=s["prelude"],
            n_layers_in_recurrent_block=s["core"], n_layers_in_coda=s["coda"],
            mean_recurrence=s["recurrence"], mean_backprop_depth=s["backprop_depth"],
            vocab_size=s["vocab"], padded_vocab_size=s["vocab"], intermediate_size=s["ffn"],
            block_size=max(4096, s["seq"]), rope_base=50000.0, norm_eps=1e-6, qk_bias=True,
            tie_embeddings=True, bos_token_id=1, eos_token_id=2,
        )
    )  # fmt: skip


def init_state(c: Any, device: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """HF-named full state with Huginn's init (module doc; other families: std 0.02 for every
    matrix), drawn on `device`, stored on the CPU in `dtype` (Huginn's RoPE table fp32)."""
    import torch

    from models.config import HuginnConfig
    from models.huginn import HuginnForCausalLM, precompute_freqs_cis
    from models.ouro import OuroForCausalLM

    huginn = isinstance(c, HuginnConfig)
    with torch.device("meta"):
        meta = HuginnForCausalLM(c) if huginn else OuroForCausalLM(c)
        shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    std, out_std = (c.init_std, c.init_values["out_proj"]) if huginn else (0.02, 0.02)
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, Any] = {}
    for name, shape in sorted(shapes.items()):
        if "norm" in name or name.endswith("ln_f.weight") or len(shape) == 1 and "bias" not in name:
            t = torch.ones(shape, device=device)
        elif name.endswith("qk_bias") or name.endswith(".bias"):
            t = torch.zeros(shape, device=device)
        else:
            s = out_std if name.endswith("proj.weight") else std
            t = torch.randn(shape, device=device, generator=gen).mul_(s).clamp_(-3 * s, 3 * s)
        state[name] = t.to(dtype).cpu()
    if huginn:
        state["freqs_cis"] = precompute_freqs_cis(c.head_dim, c.block_size, c.rope_base)
    return state


def rollouts(s: dict[str, Any], step: int, version: int, seed: int,
             exits: str = "full") -> list[Any]:  # fmt: skip
    """Full-length rollouts: every row prompt + response[:-1] = the shape's seq positions."""
    import numpy as np

    t = s["seq"] - prompt_len(s) + 1  # the model sees prompt + completion[:-1]: seq positions
    rng = np.random.default_rng(seed * 1000 + step)
    return _rollouts(s, step, version, rng, lambda _: t, exits)


def spread_rollouts(s: dict[str, Any], step: int, version: int, seed: int, lo: int,
                    hi: int, exits: str = "full") -> list[Any]:  # fmt: skip
    """`rollouts` with response lengths uniform in [lo, hi] (the realistic spread)."""
    import numpy as np

    rng = np.random.default_rng(seed * 1000 + step + 7)
    return _rollouts(s, step, version, rng, lambda r: int(r.integers(lo, hi + 1)), exits)


def _rollouts(s: dict[str, Any], step: int, version: int, rng: Any,
              length: Callable[[Any], int], exits: str = "full") -> list[Any]:  # fmt: skip
    """batch / n groups of n rollouts of random tokens, each response ``length(rng)`` long
    (drawn before the row's other draws), rewards alternating 0/1; every token at the full
    depth r (``exits`` "full"), or each response token's exit depth uniform in 1..r
    ("uniform": a learned exit's spread, mean (r + 1) / 2; drawn after the row's others)."""
    import numpy as np

    from proto.records import Rollout

    plen, n = prompt_len(s), s["n"]
    out = []
    for g in range(s["batch"] // n):
        prompt = rng.integers(3, s["vocab"], size=plen).astype(np.int32)
        for i in range(n):
            t = length(rng)
            out.append(Rollout(
                rollout_id=f"s{step}-{g}/{i}", work_id=f"s{step}-{g}", prompt_id=f"p{g}",
                sample_index=i, generator_id="bench",
                latent_seed=int(rng.integers(0, 2**63)) * 2 + 1, prompt_tokens=prompt,
                tokens=rng.integers(3, s["vocab"], size=t).astype(np.int32),
                logprobs=(-np.log(s["vocab"]) + rng.uniform(-0.5, 0.5, t)).astype(np.float32),
                exit_depths=np.full(t, s["recurrence"], dtype=np.uint8),
                weight_version=version, reward=float((i + g) % 2),
            ))  # fmt: skip
            if exits == "uniform":
                r = s["recurrence"]
                out[-1].exit_depths[:] = rng.integers(1, r + 1, size=t).astype(np.uint8)
    return out


def layout_positions(seq_lens: list[int], layout: str, micro: int, budget: int,
                     multiple: int = 1) -> int:  # fmt: skip
    """Positions the model computes for rows of ``seq_lens`` (the step's sorted order, one
    update, one rank): padded micro-batches of ``micro`` rows at their longest, or packed
    micro-batches (models.token_rows.micro_spans) of their summed lengths, rounded up, in the
    first-fit-decreasing order the learner's step packs them in (learner.batching.pack_updates,
    models.token_rows.pack_order)."""
    from models.token_rows import micro_spans, pack_order

    def up(n: int) -> int:
        return -(-n // multiple) * multiple

    if layout == "packed":
        lens = [seq_lens[i] for i in pack_order(seq_lens, budget)]
        return sum(up(sum(lens[a:b])) for a, b in micro_spans(lens, budget))
    return sum(up(max(seq_lens[a : a + micro])) * len(seq_lens[a : a + micro])
               for a in range(0, len(seq_lens), micro))  # fmt: skip


def real_flops(s: dict[str, Any], k: int, seq_lens: list[int], resp: list[int]) -> float:
    """FLOPs of a step on real tokens only (module doc): per sequence n x (2 P_nograd + 6
    P_grad) + attention over its own n positions + the head at its response positions."""
    h, v, r = s["hidden"], s["vocab"], s["recurrence"]
    fc = flop_counts(dict(s, seq=1), k)  # attention per unit length, head rows dropped below
    k = fc["backprop_depth_used"]
    l_grad, l_nograd = s["prelude"] + s["coda"] + k * s["core"], (r - k) * s["core"]
    per_tok = fc["flops_per_token_head_every_position"] - 6 * v * h
    per_tok -= (4 * l_nograd + 12 * l_grad) * h  # the seq=1 attention term
    att = (4 * l_nograd + 12 * l_grad) * h
    return float(sum(n * per_tok + att * n * n + 6 * v * h * t
                     for n, t in zip(seq_lens, resp, strict=True)))  # fmt: skip


def flop_counts(s: dict[str, Any], k: int) -> dict[str, Any]:
    h, f, v, r, seq = s["hidden"], s["ffn"], s["vocab"], s["recurrence"], s["seq"]
    block = 4 * h * h + 3 * h * f
    adapter = 0 if s.get("family") == "ouro" else 2 * h * h
    k = r if k <= 0 else min(k, r)
    it = s["core"] * block + adapter
    p_grad = (s["prelude"] + s["coda"]) * block + k * it
    p_nograd = (r - k) * it
    l_grad, l_nograd = s["prelude"] + s["coda"] + k * s["core"], (r - k) * s["core"]
    attn = (4 * l_nograd + 12 * l_grad) * seq * h
    rows = (seq - prompt_len(s) + 1) / seq  # head rows per position
    body = 2 * p_nograd + 6 * p_grad + attn
    return dict(
        backprop_depth_used=k,
        params_grad_per_token=p_grad + v * h,
        params_nograd_per_token=p_nograd,
        head_rows_per_position=round(rows, 5),
        flops_per_token=body + 6 * v * h * rows,
        flops_per_token_head_every_position=body + 6 * v * h,
    )


def prompt_len(s: dict[str, Any]) -> int:
    """Prompt tokens of the synthetic rollouts (the head skips all but the last one's row)."""
    return min(64, s["seq"] // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="huginn_1b")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke test)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--backprop-depth", type=int, default=None, help="default: the shape's")
    ap.add_argument("--recurrence", type=int, default=None, help="default: the shape's")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="rollouts per step (global batch)")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch size")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after timing, profile one more step (benchmarks/step_profile.py): "
                    "DIR/<label>_profile.json and DIR/<label>_kernels.txt")  # fmt: skip
    ap.add_argument("--loop-weighting", default="last",
                    help="objective.loop_weighting (per-loop credit, docs/OBJECTIVES.md)")  # fmt: skip
    ap.add_argument("--lr", type=float, default=None,
                    help="optimizer.lr (default: the shape's realistic rate, 1e-6 at the "
                    "Huginn-0125 shape, 1e-5 at ~1B)")  # fmt: skip
    ap.add_argument("--layout", choices=("full", "padded", "packed"), default="full",
                    help="full-length rows (default), or responses U(--resp-min, --resp-max) "
                    "in padded or packed rows (module doc)")  # fmt: skip
    ap.add_argument("--packed", action="store_true", help="= --layout packed")
    ap.add_argument("--resp-min", type=int, default=256)
    ap.add_argument("--resp-max", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=None,
                    help="learner.max_tokens_per_micro of --layout packed (default micro x seq)")  # fmt: skip
    ap.add_argument("--pack-multiple", type=int, default=1,
                    help="round each packed row up to a multiple (fewer compiled shapes)")  # fmt: skip
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="RunConfig keys")
    ap.add_argument("--exit-depths", choices=("full", "uniform"), default="full",
                    help="response tokens' exit depths: all r (fixed recurrence), or uniform "
                    "in 1..r (a learned exit's spread; the MFU fields are then left out: "
                    "their formula counts r iterations a token)")  # fmt: skip
    ap.add_argument(
        "--no-compact",
        action="store_true",
        help="the policy without depth batching (MegatronOptions.compact off: "
        "every position through every core iteration, masked), to compare",
    )
    ap.add_argument("--syncs", action="store_true",
                    help="one more step under torch's CUDA sync debug mode: how many times the "
                    "step read the card, and where (`syncs`, `sync_sites`)")  # fmt: skip
    a = ap.parse_args()
    if a.packed:
        a.layout = "packed"
    if a.device == "cpu":  # before torch is imported: the learner picks CUDA when it sees it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from learner.parallel import init_distributed
    from learner.replay import unwrap
    from pipeline.backends.megatron_adapter import build_learner_trainer
    from pipeline.config.run import load_config

    s = dict(SHAPES["tiny" if a.tiny else a.shape])
    for key in ("recurrence", "seq", "batch", "micro", "backprop_depth"):
        if getattr(a, key) is not None:
            s[key] = getattr(a, key)
    if a.tiny:
        a.steps, a.warmup = min(a.steps, 2), min(a.warmup, 1)
    spread = a.layout != "full"
    if spread:  # rows up to the prompt + the longest response; RoPE / positions must hold it
        if a.tiny:  # the tiny shape's positions: a spread below its seq
            a.resp_max = min(a.resp_max, s["seq"] - prompt_len(s) + 1)
            a.resp_min = min(a.resp_min, max(1, a.resp_max // 8))
        s["seq"] = max(s["seq"], prompt_len(s) + a.resp_max - 1)
    budget = a.budget or s["micro"] * s["seq"]
    info = init_distributed(a.tp, seed=0)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    c = model_config(s)
    overrides = [
        f"rollout.n={s['n']}", f"rollout.prompts_per_step={s['batch'] // s['n']}",
        f"tp={a.tp}", f"learner.precision={a.precision}",
        f"learner.backprop_depth={s['backprop_depth']}",
        f"learner.micro_batch_size={0 if a.layout == 'packed' else s['micro']}",
        f"learner.max_tokens_per_micro={budget if a.layout == 'packed' else 0}",
        *([f"rollout.max_tokens={a.resp_max}"] if spread else []),
        f"learner.compile={a.compile}", f"learner.recompute={a.recompute}",
        f"objective.loop_weighting={a.loop_weighting}",
        f"optimizer.lr={a.lr if a.lr is not None else s['lr']}", *a.set,
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    t0 = time.perf_counter()
    trainer = build_learner_trainer(cfg, c, init_state(c, dev, dtype))
    if a.pack_multiple > 1:  # not a run-config key: the step's TrainConfig.pad_to_multiple
        import dataclasses

        trainer.cfg = dataclasses.replace(trainer.cfg, pad_to_multiple=a.pack_multiple)
    build_s = time.perf_counter() - t0
    policy = unwrap(trainer.policy_model)
    if a.no_compact:  # not a run-config key: the policy's MegatronOptions
        import dataclasses

        policy.options = dataclasses.replace(policy.options, compact=False)
    from learner.batching import build_batch

    real, computed, step_flops, cpu_times = [], [], [], []
    k_used = trainer.policy_model.backprop_depth
    params = sum(p.numel() for p in trainer.policy_model.parameters())
    times, losses, norms, metrics = [], [], [], {}
    depths: list[float] = []
    for i in range(a.warmup + a.steps):
        if spread:
            batch = spread_rollouts(s, i, trainer.weight_version, cfg.seed, a.resp_min,
                                    a.resp_max, a.exit_depths)  # fmt: skip
        else:
            batch = rollouts(s, i, trainer.weight_version, cfg.seed, a.exit_depths)
        depths.extend(float(d) for r in batch for d in r.exit_depths)
        lens = build_batch(batch).seq_lens.tolist()  # the step's order (sorted)
        if i >= a.warmup:
            real.append(sum(lens))
            computed.append(layout_positions(lens, a.layout, s["micro"], budget,
                                             a.pack_multiple))  # fmt: skip
            step_flops.append(real_flops(s, k_used, lens, [r.num_tokens for r in
                                                           sorted(batch, key=_order)]))  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
            if i == a.warmup:
                torch.cuda.reset_peak_memory_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = trainer.step(batch)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            cpu_times.append(time.process_time() - c0)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        if i >= a.warmup:
            times.append(dt)
        if rank0:
            print(f"step {i} {dt * 1e3:.0f} ms loss {metrics['loss']:.5f} grad_norm "
                  f"{metrics['grad_norm']:.3g} skipped {metrics['skipped_nonfinite']:.0f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    if a.profile and cuda:  # rank 0 profiles; the other ranks run the same two steps
        from benchmarks.step_profile import profile_call

        n = a.warmup + a.steps
        batch = rollouts(s, n, trainer.weight_version, cfg.seed)
        if rank0:
            prof = profile_call(lambda: trainer.step(batch), a.profile, a.label or a.shape)
            path = Path(a.profile) / f"{a.label or a.shape}_profile.json"
            path.write_text(json.dumps(prof, indent=1), "utf-8")
            print(json.dumps({k: v for k, v in prof.items() if k != "top_kernels"}),
                  file=sys.stderr)  # fmt: skip
        else:
            trainer.step(batch)
            trainer.step(batch)
    syncs = None
    if a.syncs and cuda:
        syncs = count_syncs(
            lambda: trainer.step(
                rollouts(s, a.warmup + a.steps + 2, trainer.weight_version, cfg.seed)
            )
        )
    fc = flop_counts(s, trainer.policy_model.backprop_depth)
    tokens = s["batch"] * s["seq"]
    step_s = statistics.median(times)
    res: dict[str, Any] = {
        "bench": "trainer_step",
        "label": a.label,
        "loop_weighting": a.loop_weighting,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "world": info.world_size,
        "dp": info.dp_size,
        "tp": a.tp,
        "shape": {**s, "params": params},
        "precision": a.precision,
        "compile": a.compile,
        "recompute": a.recompute,
        "build_s": round(build_s, 1),
        "tokens_per_step": tokens,
        **fc,
        "flops_formula": "2*P_nograd + 6*P_grad + 6*V*h*R/seq + (4*L_nograd + 12*L_grad)*seq*h "
        "per token (R: response positions; the head runs there only)",
        "step_ms_median": round(step_s * 1e3, 1),
        "step_ms_mean": round(statistics.fmean(times) * 1e3, 1) if times else None,
        "tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(fc["flops_per_token"] * tokens / step_s / (PEAK_BF16 * info.world_size), 4),
        "mfu_head_every_position": round(
            fc["flops_per_token_head_every_position"]
            * tokens
            / step_s
            / (PEAK_BF16 * info.world_size),
            4,
        ),  # fmt: skip
        "layout": a.layout,
        "process_cpu_s_median": round(statistics.median(cpu_times), 3) if cpu_times else None,
        "real_tokens_per_step": round(statistics.fmean(real), 1) if real else None,
        "positions_per_step": round(statistics.fmean(computed), 1) if computed else None,
        "padding_fraction": round(1 - sum(real) / sum(computed), 4) if computed else None,
        "real_tokens_per_s": round(sum(real) / sum(times), 1) if times else None,
        "mfu_real_tokens": round(sum(step_flops) / sum(times) / (PEAK_BF16 * info.world_size), 4)
        if times
        else None,  # fmt: skip
        "budget": budget if a.layout == "packed" else None,
        "resp_range": [a.resp_min, a.resp_max] if spread else None,
        "packed_attention": _packed_attention() if a.layout == "packed" else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
        "lr": cfg.optimizer.lr,
        "losses": [round(x, 6) for x in losses],
        "grad_norms": [float(f"{g:.4g}") for g in norms],
        "loss_finite_every_step": all(math.isfinite(x) for x in losses),
        "health": health(losses, norms),
        "skipped_nonfinite_total": metrics.get("skipped_nonfinite_total"),
        "last_grad_norm": metrics.get("grad_norm"),
        "command": " ".join(sys.argv),
    }
    if syncs is not None:
        res.update(syncs)
    if spread:  # the spread layouts count real tokens only (module doc)
        res.update(tokens_per_step=res["real_tokens_per_step"],
                   tokens_per_s=res["real_tokens_per_s"], mfu=res["mfu_real_tokens"],
                   mfu_head_every_position=None)  # fmt: skip
    res.update(
        exit_depths=a.exit_depths,
        compact=policy.options.compact,
        mean_exit_depth=round(statistics.fmean(depths), 3) if depths else None,
    )
    if a.exit_depths != "full":  # the FLOP formula counts r iterations a token: not these
        res.update(mfu=None, mfu_head_every_position=None, mfu_real_tokens=None)
    if rank0:
        print(json.dumps(res), flush=True)
    from learner.parallel import destroy_distributed

    destroy_distributed()


def count_syncs(call: Any) -> dict[str, Any]:
    """{"syncs": how many synchronizing CUDA calls ``call`` made, "sync_sites": the 12
    commonest file:line of ours (the nearest frame in the repository) with their counts}."""
    import collections
    import traceback
    import warnings

    import torch

    here = str(Path(__file__).resolve().parents[1])
    sites: collections.Counter[str] = collections.Counter()

    def note(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(here) and "/.venv/" not in f.filename]  # fmt: skip
        f = ours[-1] if ours else None
        sites[f"{Path(f.filename).relative_to(here)}:{f.lineno}" if f else filename] += 1

    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return {"syncs": sum(sites.values()), "sync_sites": dict(sites.most_common(12))}


def _order(r: Any) -> tuple[str, int, str]:
    return (r.work_id, r.sample_index, r.rollout_id)  # learner.batching.sort_rollouts


def _packed_attention() -> str:
    """Which attention the packed rows ran with (learner.megatron.layers: FlexAttention on CUDA
    once it checked out, else SDPA with a dense block-diagonal mask; the reason why)."""
    from learner.megatron.layers import _FLEX

    if "fn" in _FLEX:
        return "flex"
    return f"dense_mask ({_FLEX['error']})" if "error" in _FLEX else "dense_mask"


if __name__ == "__main__":
    main()
