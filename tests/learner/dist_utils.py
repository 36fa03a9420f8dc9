"""Run a function in N spawned processes that form a gloo process group (tests only).

`run_distributed(fn, world_size, *args)` starts `world_size` fresh interpreters (spawn), sets
the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) in each, calls
`fn(*args)` there, and returns the per-rank results in rank order. `fn` must be importable by
name (a module-level function) and its arguments and result picklable; it normally starts with
`learner.parallel.init_distributed(...)`. A rank that raises, a rank that dies and the deadline
all stop every process still running (by pid) and raise `DistributedRunError` with the
tracebacks collected so far.

Below it: a tiny megatron GPT (local spec) and the few steps every learner test repeats
(batch, loss, DDP + optimizer, TP sharding of full weights), for use inside the ranks.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from learner.parallel import free_port

__all__ = [
    "TINY_SEQ",
    "TINY_VOCAB",
    "DistributedRunError",
    "causal_mask",
    "forward_backward",
    "full_params",
    "lm_loss",
    "load_full_params",
    "params_equal",
    "run_distributed",
    "tiny_gpt",
    "token_batch",
    "train_step",
    "wrap_ddp",
]


class DistributedRunError(RuntimeError):
    """A spawned rank failed, died or ran past the deadline."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    torchrun_env: bool,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    if torchrun_env:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    warnings.filterwarnings(
        "ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not"
    )
    torch.set_num_threads(threads)
    try:
        results.put((rank, True, _to_plain(fn(*args))))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _to_plain(value: Any) -> Any:
    """Tensors -> numpy (a tensor in a queue is shared memory that dies with its rank)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_plain(v) for v in value)
    return value


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    torchrun_env: bool = True,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks; return their results, rank 0 first.

    timeout_s: deadline for the whole run (imports included), after which all ranks are killed.
    threads_per_rank: torch intra-op threads per rank (default: CPU count // world_size).
    torchrun_env: set the torchrun variables; False (world_size 1 only) clears them instead, so
        `init_distributed` takes its single-process path.
    Tensors in the result come back as numpy arrays.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not torchrun_env and world_size != 1:
        raise ValueError("torchrun_env=False needs world_size=1")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, threads, torchrun_env, results, args),
            name=f"looprl-test-rank{rank}",
            daemon=False,  # ranks may start children (dist_checkpointing's writer does)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(got) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not errors:
                    errors.append(f"timed out after {timeout_s:.0f} s; done: ranks {sorted(got)}")
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if errors:
                    continue  # waiting briefly for the other ranks' errors
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                silent = all(p.exitcode is not None for p in procs)
                if dead or silent:
                    exits = ", ".join(f"{p.name} exit code {p.exitcode}" for p in procs)
                    errors.append(f"ranks ended without reporting: {exits}")
                    break
                continue
            if ok:
                got[rank] = value
            else:
                errors.append(f"rank {rank} raised:\n{value}")
                # The others may now hang in a collective: collect their errors for a moment.
                deadline = min(deadline, time.monotonic() + 3.0)
    finally:
        _stop(procs)
        results.close()
    if errors:
        raise DistributedRunError("\n".join(errors))
    return [got[rank] for rank in range(world_size)]


def _stop(procs: list[Any], grace_s: float = 2.0) -> None:
    """Join finished ranks; kill (by pid, via Process.kill) those still running."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=grace_s)


# --------------------------------------------------------------------------------------------
# A tiny megatron GPT for tests that run inside the spawned ranks (megatron imported lazily).
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 128
TINY_SEQ = 16


def tiny_gpt(tp: int, **overrides: Any) -> Any:
    """Tiny GPT, local layer spec: hidden 64, 2 layers, 2 heads (head_dim 32), vocab 128, RoPE,
    RMSNorm; on the current CUDA device when there is one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        ffn_hidden_size=128,
        tensor_model_parallel_size=tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        normalization="RMSNorm",
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=TINY_VOCAB,
        max_sequence_length=TINY_SEQ,
        position_embedding_type="rope",
    )
    if torch.cuda.is_available():  # megatron builds norms on the CPU; training moves the model
        model.cuda(torch.cuda.current_device())
    return model


def token_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each [n, TINY_SEQ]: labels are the tokens shifted by one."""
    tokens = torch.randint(
        0, TINY_VOCAB, (n, TINY_SEQ + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def causal_mask(b: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked out (what megatron's local attention expects)."""
    ones = torch.ones(s, s, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).expand(b, 1, s, s)


def lm_loss(
    model: Any, tokens: torch.Tensor, labels: torch.Tensor, explicit_mask: bool = True
) -> Any:
    """Mean next-token loss; GPTModel returns per-token losses [b, s] (vocab-parallel CE)."""
    (b, s), device = tokens.shape, tokens.device
    mask = causal_mask(b, s, device) if explicit_mask else None
    positions = torch.arange(s, device=device).expand(b, s)
    return model(tokens, positions, mask, labels=labels).mean()


def full_params(model: Any) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_full_params(model: Any, full: dict[str, torch.Tensor]) -> Any:
    """Copy TP=1 weights into a (possibly TP-sharded) model; returns the model.

    Shards along each param's `partition_dim`; right for everything in `tiny_gpt` but not for a
    gated MLP (SwiGLU fc1 shards are [gate_r; up_r], not contiguous chunks).
    """
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(size, dim=param.partition_dim)[rank]
            param.copy_(value)
    return model


def wrap_ddp(
    model: Any, kind: str, *, lr: float, adam_eps: float, distributed: bool, clip: float
) -> tuple[Any, Any]:
    """Megatron DDP (fp32 grad buffers) + get_megatron_optimizer ("adam" or "sgd", no decay)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer=kind,
        lr=lr,
        weight_decay=0.0,
        adam_eps=adam_eps,
        clip_grad=clip,
        use_distributed_optimizer=distributed,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def forward_backward(ddp: Any, opt: Any, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Zero grads, loss, backward, finalize_model_grads (the DP reduction); returns the loss."""
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = lm_loss(ddp, tokens, labels)
    loss.backward()
    finalize_model_grads([ddp])
    return float(loss.detach())


def train_step(ddp: Any, opt: Any, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """forward_backward + optimizer step (asserting it succeeded); returns the loss."""
    loss = forward_backward(ddp, opt, tokens, labels)
    ok, _, _ = opt.step()
    assert ok, "optimizer step reported failure"
    return loss


def params_equal(a: Any, b: Any) -> bool:
    """Same parameter names, bit-identical values."""
    pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
    return all(na == nb and torch.equal(pa, pb) for (na, pa), (nb, pb) in pairs)
