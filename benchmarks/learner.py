"""Learner step throughput: tokens/s and MFU of fwd + bwd + AdamW in bf16, one JSON line.

    python benchmarks/learner.py                     # Huginn-shaped ~1B-touched model, H200
    python benchmarks/learner.py --device cpu --tiny # smoke test on a CPU host

Model (Huginn-shaped, defaults): hidden 2048, 16 heads x 128, prelude 2, core 4 iterated
r = 4 times, coda 2, SwiGLU 5632, vocab 65536 (tied head), seq 2048, every position at full
depth r. `--impl mcore` (default) is the learner's own `learner.megatron.model.LoopedGPT`
(megatron-core, TP=1, `fast` numerics: SDPA causal attention) with bf16 parameters and
random weights; `--impl torch_reference` is a minimal plain-PyTorch block with the same shapes
(used when megatron-core does not import). The loss is the policy's own per-token statistics,
`-mean(logp) - 0.01 mean(entropy)` from `learner.kernels.token_stats.token_stats_auto`.
Optimizer: `torch.optim.AdamW(fused=True)` on the bf16 parameters (no fp32 master copy).

FLOPs per step = tokens * (6 * P_touched + 12 * L_run * seq * hidden), with
P_touched = prelude + r * (core + adapter) + coda block weights + head (V * h) (embedding
lookups excluded) and L_run = prelude + r * core + coda; MFU = FLOP/s / 989e12 (H100/H200
dense bf16 datasheet). The Huginn latent-state noise (`models.noise.latent_noise`, numpy on
the CPU) is computed once and cached for the timed steps (same seeds and shapes each step);
its CPU cost per step is reported separately as `latent_noise_cpu_ms`.

Variants: `eager`, then `compiled` (`torch.compile` of every block in place; on failure, of
the `models.numerics` element-wise helpers instead), each timed over `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.kernels.token_stats import token_stats_auto  # noqa: E402
from models.config import HuginnConfig  # noqa: E402

PEAK_BF16 = 989e12


def huginn_config(a: argparse.Namespace) -> HuginnConfig:
    return HuginnConfig.from_hf_dict(
        dict(
            model_type="huginn_raven",
            n_embd=a.hidden,
            n_heads=a.heads,
            n_layers=a.prelude + a.core + a.coda,
            n_layers_in_prelude=a.prelude,
            n_layers_in_recurrent_block=a.core,
            n_layers_in_coda=a.coda,
            mean_recurrence=a.recurrence,
            vocab_size=a.vocab,
            padded_vocab_size=a.vocab,
            intermediate_size=a.ffn,
            block_size=a.seq,
            rope_base=50000.0,
            norm_eps=1e-6,
            qk_bias=True,
            tie_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


# ---- plain-PyTorch fallback (same shapes; sandwich block, SDPA, adjacent-pair RoPE) ----------


class _Norm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class _Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2, self.n3, self.n4 = _Norm(h), _Norm(h), _Norm(h), _Norm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(self, x: Tensor, cs: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, -1).unbind(2)

        def rope(t: Tensor) -> Tensor:
            p = t.float().unflatten(-1, (-1, 2))
            c, sn = cs[..., 0], cs[..., 1]
            out = torch.stack([p[..., 0] * c - p[..., 1] * sn, p[..., 1] * c + p[..., 0] * sn], -1)
            return out.flatten(-2).to(t.dtype)

        q, k = rope(q), rope(k)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = self.n2(self.proj(o.transpose(1, 2).reshape(b, s, h)) + x)
        gate, up = self.fc1(self.n3(x)).chunk(2, -1)
        return self.n4(self.fc2(F.silu(gate) * up) + x)


class TorchHuginn(nn.Module):
    freqs: Tensor

    def __init__(self, c: HuginnConfig) -> None:
        super().__init__()
        h, n, f = c.n_embd, c.n_heads, c.intermediate_size
        self.c = c
        self.wte = nn.Embedding(c.rows, h)
        self.prelude = nn.ModuleList(_Block(h, n, f) for _ in range(c.n_layers_in_prelude))
        self.core = nn.ModuleList(_Block(h, n, f) for _ in range(c.n_layers_in_recurrent_block))
        self.coda = nn.ModuleList(_Block(h, n, f) for _ in range(c.n_layers_in_coda))
        self.adapter = nn.Linear(2 * h, h, bias=False)
        self.norm = _Norm(h)
        from models.huginn import precompute_freqs_cis

        self.register_buffer("freqs", precompute_freqs_cis(c.head_dim, c.block_size, c.rope_base))

    def forward(self, tokens: Tensor, state0: Tensor) -> Tensor:
        cs = self.freqs[0, : tokens.shape[1]]  # [S, 1, D/2, 2]
        e = self.wte(tokens) * self.c.embed_scale
        for blk in self.prelude:
            e = blk(e, cs)
        state = state0
        for _ in range(self.c.mean_recurrence):
            x = self.adapter(torch.cat([state, e], -1))
            for blk in self.core:
                x = blk(x, cs)
            state = x
        x = self.norm(state)
        for blk in self.coda:
            x = blk(x, cs)
        return F.linear(self.norm(x), self.wte.weight)


# ---- model construction -------------------------------------------------------------------------


def randomise(model: nn.Module, std: float = 0.02) -> None:
    """Random weights in place on the model's device: matrices ~ N(0, std), 1-D weights (norm
    gains) 1, biases 0."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def quiet_megatron_tp_group() -> None:
    """megatron 0.16's RowParallelLinear.forward passes tp_group=None, so every call goes through
    `get_tensor_model_parallel_group_if_none`, whose DeprecationWarning is a torch.compile graph
    break inside each block. Resolve the default group without the warning (same result)."""
    import megatron.core.tensor_parallel.layers as layers
    from megatron.core import parallel_state

    original = layers.get_tensor_model_parallel_group_if_none

    def quiet(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if tp_group is None and not is_expert and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(
                check_initialized=check_initialized
            )
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    layers.get_tensor_model_parallel_group_if_none = quiet


def build_mcore(c: HuginnConfig, device: torch.device) -> tuple[nn.Module, Any]:
    from learner.megatron.model import LoopedGPT
    from learner.megatron.options import MegatronOptions
    from learner.parallel import init_distributed
    from models.huginn import precompute_freqs_cis

    init_distributed(1)
    quiet_megatron_tp_group()
    model = LoopedGPT(c, MegatronOptions(params_dtype=torch.bfloat16, numerics="fast"))
    model.to(device)
    randomise(model)
    with torch.no_grad():
        model.freqs_cis.copy_(precompute_freqs_cis(c.head_dim, c.block_size, c.rope_base))
    noise_ms: list[float] = []
    original = model._initial_state
    cache: dict[Any, Tensor] = {}

    def cached_initial_state(e: Tensor, positions: Tensor, seeds: Tensor) -> Tensor:
        key = (tuple(seeds.tolist()), tuple(positions.shape))
        if key not in cache:
            t0 = time.perf_counter()
            cache[key] = original(e, positions, seeds)
            noise_ms.append((time.perf_counter() - t0) * 1e3)
        return cache[key]

    model._initial_state = cached_initial_state  # type: ignore[method-assign]

    def step_fn(tokens: Tensor) -> Tensor:
        b, s = tokens.shape
        depths = torch.full_like(tokens, c.mean_recurrence)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        out = model(tokens, depths, valid, list(range(1, b + 1)))
        return out.logits  # type: ignore[no-any-return]

    return model, (step_fn, noise_ms)


def build_torch(c: HuginnConfig, device: torch.device) -> tuple[nn.Module, Any]:
    model = TorchHuginn(c).to(device)
    randomise(model)
    freqs = model.freqs
    model.to(torch.bfloat16)
    model.freqs = freqs.to(device)  # RoPE table stays fp32
    state0: dict[tuple[int, ...], Tensor] = {}

    def step_fn(tokens: Tensor) -> Tensor:
        shape = (*tokens.shape, c.n_embd)
        if shape not in state0:
            state0[shape] = torch.randn(shape, device=device, dtype=torch.bfloat16) * c.init_std
        return model(tokens, state0[shape])  # type: ignore[no-any-return]

    return model, (step_fn, [])


# ---- timing -------------------------------------------------------------------------------------


def flop_counts(c: HuginnConfig, seq: int) -> dict[str, float]:
    h, f, v = c.n_embd, c.intermediate_size, c.rows
    block = 4 * h * h + 3 * h * f  # qkv 3h^2 + proj h^2 + fc1 2hf + fc2 fh (norms/bias omitted)
    r = c.mean_recurrence
    pre, core, coda = c.n_layers_in_prelude, c.n_layers_in_recurrent_block, c.n_layers_in_coda
    touched = (pre + coda) * block + r * (core * block + 2 * h * h) + v * h
    layers_run = pre + r * core + coda
    per_token = 6 * touched + 12 * layers_run * seq * h
    return {
        "params_touched_per_token": touched,
        "layers_run": layers_run,
        "flops_per_token": per_token,
    }


def time_steps(
    step: Any, model: nn.Module, opt: Any, tokens: Tensor, n: int, warm: int
) -> dict[str, float]:
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    targets = torch.roll(tokens, -1, 1).reshape(-1)
    losses = []

    def one() -> None:
        logits = step(tokens)
        st = token_stats_auto(logits.reshape(-1, logits.shape[-1]), None, targets)
        loss = -st.logp.mean() - 0.01 * st.entropy.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t0 = time.perf_counter()
    for _ in range(warm):
        one()
    sync()
    warm_s = time.perf_counter() - t0
    if tokens.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(n):
        one()
    sync()
    dt = (time.perf_counter() - t0) / n
    return {
        "warmup_s": round(warm_s, 2),
        "step_ms": round(dt * 1e3, 2),
        "tokens_per_s": round(tokens.numel() / dt, 1),
        "final_loss": float(losses[-1]),
        "loss_finite": bool(all(torch.isfinite(x) for x in losses)),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if tokens.is_cuda
        else 0.0,
    }


def compile_in_place(model: nn.Module, impl: str) -> str:
    import torch._dynamo as dynamo

    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, 256)
    for name in ("prelude", "core", "coda"):
        for blk in getattr(model, name):
            blk.compile()
    return f"blocks ({impl})"


def compile_numerics() -> str:
    from models import numerics as nx

    for fn in ("rms_norm", "silu_mul", "rope_adjacent"):
        setattr(nx, fn, torch.compile(getattr(nx, fn)))
    return "numerics_helpers"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("mcore", "torch_reference"), default="mcore")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--prelude", type=int, default=2)
    ap.add_argument("--core", type=int, default=4)
    ap.add_argument("--recurrence", type=int, default=4)
    ap.add_argument("--coda", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", choices=("none", "also"), default="also")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke test")
    a = ap.parse_args()
    if a.tiny:
        a.hidden, a.heads, a.ffn, a.vocab, a.seq, a.batch = 64, 2, 128, 512, 32, 2
        a.steps, a.warmup = 2, 1
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    c = huginn_config(a)
    res: dict[str, Any] = {"bench": "learner_step", "impl": a.impl, "device": str(device)}
    if device.type == "cuda":
        res["device"] = torch.cuda.get_device_name()
    res["torch"] = torch.__version__
    try:
        model, (step, noise_ms) = (build_mcore if a.impl == "mcore" else build_torch)(c, device)
    except Exception as exc:  # megatron missing or broken: the honest fallback
        res["mcore_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["impl"] = "torch_reference"
        model, (step, noise_ms) = build_torch(c, device)
    params = sum(p.numel() for p in model.parameters())
    fc = flop_counts(c, a.seq)
    res.update(
        shape=dict(
            hidden=a.hidden,
            heads=a.heads,
            head_dim=a.hidden // a.heads,
            prelude=a.prelude,
            core=a.core,
            recurrence=a.recurrence,
            coda=a.coda,
            ffn=a.ffn,
            vocab=a.vocab,
            seq=a.seq,
            batch=a.batch,
            tied_head=True,
        ),
        params=params,
        params_touched_per_token=fc["params_touched_per_token"],
        flops_per_token=fc["flops_per_token"],
        flops_formula="tokens*(6*P_touched + 12*L_run*seq*hidden); P_touched=(prelude+coda)*block"
        "+r*(core*block+adapter)+V*h, L_run=prelude+r*core+coda",
        peak_flops=PEAK_BF16,
        optimizer="torch.optim.AdamW(fused) on bf16 params",
        loss="token_stats_auto: -mean(logp)-0.01*mean(entropy)",
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)
    flops_step = fc["flops_per_token"] * tokens.numel()
    variants = ["eager"] + (["compiled"] if a.compile == "also" else [])
    for name in variants:
        try:
            if name == "compiled":
                try:
                    res["compiled_what"] = compile_in_place(model, res["impl"])
                    r = time_steps(step, model, opt, tokens, a.steps, a.warmup)
                except Exception as exc:
                    res["compile_blocks_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    import torch._dynamo as dynamo

                    dynamo.reset()
                    for mod in model.modules():
                        mod._compiled_call_impl = None
                    res["compiled_what"] = compile_numerics()
                    r = time_steps(step, model, opt, tokens, a.steps, a.warmup)
            else:
                r = time_steps(step, model, opt, tokens, a.steps, a.warmup)
        except Exception as exc:
            res[f"{name}_error"] = traceback.format_exc()[-600:]
            print(f"{name} failed: {exc}", file=sys.stderr)
            continue
        r["mfu"] = round(flops_step / (r["step_ms"] / 1e3) / PEAK_BF16, 4)
        res[name] = r
    done = [v for v in variants if v in res]
    if done:
        best = max(done, key=lambda v: res[v]["tokens_per_s"])
        res.update(best=best, tokens_per_s=res[best]["tokens_per_s"], mfu=res[best]["mfu"])
    if noise_ms:  # the uncached learner would add this CPU time to every step
        res["latent_noise_cpu_ms"] = round(noise_ms[0], 1)
        if done:
            step_s = (res[best]["step_ms"] + noise_ms[0]) / 1e3
            res["tokens_per_s_with_uncached_noise"] = round(tokens.numel() / step_s, 1)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
