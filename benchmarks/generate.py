"""Generation throughput: the looped plugin vs vLLM's own Llama of the same unrolled depth.

    OMP_NUM_THREADS=1 python benchmarks/generate.py [--family huginn] [--batch 32]
        [--prompt-len 16] [--max-tokens 64] [--repeats 2] [--numerics fast]

A tiny random checkpoint of `family` runs at fixed full depth r (FixedDepth(max_depth)); the
baseline is vLLM's LlamaForCausalLM with n_layers = prelude + core * r + coda layers of the
same width (hidden, heads, head_dim, MLP width), i.e. the same attention layers per token.
Both serve the same batch (one request per prompt, temperature 1) through
`generator.engine.LoopedEngine`; both engines live in the process together and each repeat
runs Llama, then the looped model twice, so they share the machine's noise (best of
`--repeats` each). The looped model runs twice on one engine: recording of
exit depths / behaviour log-probs / versions on and off (the plugin's `record` flag, toggled
through `collective_rpc`); `record_overhead` = t(on) / t(off) - 1 (target <= 0.10).

Prints one JSON line: tok_s_llama, tok_s_looped (recording on), tok_s_looped_norecord,
record_overhead, looped_vs_llama = tok_s_looped / tok_s_llama, and the workload; the `_cpu`
fields divide by the process's CPU time (`time.process_time`) instead of wall time, which
other processes on a shared machine disturb much less (one thread: OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import config_from_hf_dict, tiny_config  # noqa: E402
from models.exits import FixedDepth  # noqa: E402
from proto.records import WorkItem  # noqa: E402


def llama_like(family: str, out: Path) -> tuple[Path, int]:
    """A random Llama with the looped model's unrolled layer count; (path, layers)."""
    from models.checkpoint import save_checkpoint, state_dict_for_save
    from models.reference import build_model
    from models.ties import tied_from_module
    from models.tokenizer import BOS_ID, EOS_ID, PAD_ID, tokenizer_files

    cfg: Any = tiny_config(family)
    if family == "huginn":
        layers = cfg.n_layers_in_prelude + cfg.n_layers_in_recurrent_block * cfg.max_depth
        layers += cfg.n_layers_in_coda
        heads, kv_heads = cfg.n_heads, cfg.n_heads
    else:
        layers = cfg.num_hidden_layers * cfg.max_depth
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    base = tiny_config("llama").to_hf_dict()
    base.update(
        num_hidden_layers=layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
    )
    config = config_from_hf_dict(base)
    model = build_model(config, seed=0)
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    extra: dict[str, Any] = dict(tokenizer_files(config.vocab_size))
    extra["generation_config.json"] = ids
    path = save_checkpoint(
        state_dict_for_save(model, torch.float32),
        {**config.to_hf_dict(), **ids, "torch_dtype": "float32"},
        out,
        tied=tied_from_module(model),
        extra_files=extra,
    )
    return path, layers


def _items(batch: int, prompt_len: int, max_tokens: int) -> list[WorkItem]:
    gen = torch.Generator().manual_seed(0)
    return [
        WorkItem(
            work_id=f"b{i}",
            prompt_id=f"b{i}",
            prompt_tokens=torch.randint(3, 512, (prompt_len,), generator=gen)
            .numpy()
            .astype(np.int32),
            latent_seeds=np.asarray([1000 + i], dtype=np.uint64),
            temperature=1.0,
            max_tokens=max_tokens,
        )
        for i in range(batch)
    ]


def _tok_s(engine: Any, items: list[WorkItem], repeats: int) -> tuple[float, float]:
    """(tokens / best wall time, tokens / best CPU time of this process) over `repeats`."""
    engine.generate(items[:2])  # warm-up
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine.generate(items)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    tokens = sum(int(s.tokens.shape[0]) for ss in out for s in ss)
    return tokens / best, tokens / best_cpu


def _set_record(engine: Any, flag: bool) -> None:
    def setter(worker: Any, value: bool) -> None:
        worker.model_runner.get_model().record = value

    engine.llm.collective_rpc(setter, args=(flag,))
    engine.settings = type(engine.settings)(
        engine.settings.numerics, engine.settings.exit_policy, flag
    )


def _close(engine: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine.close()
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="huginn", choices=["huginn", "ouro", "nanbeige"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--numerics", default="fast", choices=["fast", "exact"])
    args = ap.parse_args(argv)

    from generator.engine import LoopedEngine
    from models.random_init import init_checkpoint

    items = _items(args.batch, args.prompt_len, args.max_tokens)
    common = dict(max_num_seqs=args.batch, kv_cache_bytes=64 << 20, max_model_len=512)
    with tempfile.TemporaryDirectory() as tmp:
        llama_path, layers = llama_like(args.family, Path(tmp) / "llama")
        llama = LoopedEngine(llama_path, **common)  # type: ignore[arg-type]
        looped_path = init_checkpoint(args.family, "tiny", Path(tmp) / args.family)
        depth = int(tiny_config(args.family).max_depth)
        engine = LoopedEngine(
            looped_path,
            numerics=args.numerics,
            exit_policy=FixedDepth(depth),
            **common,  # type: ignore[arg-type]
        )
        base, on, off = [], [], []
        for _ in range(args.repeats):  # interleave to share the machine's noise
            base.append(_tok_s(llama, items, 1))
            _set_record(engine, True)
            on.append(_tok_s(engine, items, 1))
            _set_record(engine, False)
            off.append(_tok_s(engine, items, 1))
        _close(engine)
        _close(llama)
    tok_llama, cpu_llama = max(t for t, _ in base), max(c for _, c in base)
    tok_on, tok_off = max(t for t, _ in on), max(t for t, _ in off)
    cpu_on = max(c for _, c in on)
    line = {
        "bench": "generate",
        "family": args.family,
        "numerics": args.numerics,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "depth": depth,
        "llama_layers": layers,
        "tok_s_llama": round(tok_llama, 1),
        "tok_s_looped": round(tok_on, 1),
        "tok_s_looped_norecord": round(tok_off, 1),
        "record_overhead": round(tok_off / tok_on - 1.0, 4),
        "looped_vs_llama": round(tok_on / tok_llama, 3),
        "tok_s_llama_cpu": round(cpu_llama, 1),
        "tok_s_looped_cpu": round(cpu_on, 1),
        "looped_vs_llama_cpu": round(cpu_on / cpu_llama, 3),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
