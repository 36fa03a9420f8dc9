"""Where the looped plugin's decode time goes: the workload of benchmarks/generate.py, profiled.

    OMP_NUM_THREADS=1 python benchmarks/generate_profile.py [--family huginn] [--batch 32]
        [--prompt-len 16] [--max-tokens 64] [--numerics fast] [--no-record] [--top 30]

One looped engine (the real plugin, FixedDepth(max_depth), as benchmarks/generate.py builds
it) serves the batch once to warm up, then once under cProfile (Python time by function,
cumulative: the vLLM engine step, the plugin's forward and its parts) and once under
torch.profiler (time and call counts by aten op). Prints both tables, then one JSON line with
the wall time of each pass and the plugin forward's share of it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generate import _items, _set_record  # noqa: E402
from models.config import tiny_config  # noqa: E402
from models.exits import FixedDepth  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="huginn", choices=["huginn", "ouro", "nanbeige"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--numerics", default="fast", choices=["fast", "exact"])
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--llama", action="store_true", help="profile the Llama baseline instead")
    args = ap.parse_args(argv)

    from benchmarks.generate import llama_like
    from generator.engine import LoopedEngine
    from models.random_init import init_checkpoint

    items = _items(args.batch, args.prompt_len, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(max_num_seqs=args.batch, kv_cache_bytes=64 << 20, max_model_len=512)
        if args.llama:
            engine = LoopedEngine(llama_like(args.family, Path(tmp) / "llama")[0], **common)  # type: ignore[arg-type]
        else:
            engine = LoopedEngine(
                init_checkpoint(args.family, "tiny", Path(tmp) / args.family),
                numerics=args.numerics,
                exit_policy=FixedDepth(int(tiny_config(args.family).max_depth)),
                **common,  # type: ignore[arg-type]
            )
            _set_record(engine, not args.no_record)
        engine.generate(items)  # warm-up
        t0 = time.perf_counter()
        engine.generate(items)
        plain = time.perf_counter() - t0
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(engine.generate, items)
        profiled = time.perf_counter() - t0
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
        stats.print_stats(args.top)
        stats.print_callees("vllm_plugin/models.py.*forward|compute_logits|initial_state")
        print(out.getvalue())
        fwd = [
            v
            for k, v in stats.stats.items()
            if k[2] == "_model_forward" and "vllm_plugin/context" not in k[0]
        ]  # type: ignore[attr-defined]
        logits = [
            v
            for k, v in stats.stats.items()
            if k[2] == "compute_logits" and "vllm_plugin/models" in k[0]
        ]  # type: ignore[attr-defined]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            engine.generate(items)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        engine.close()
    tot = pstats.Stats(prof).total_tt  # type: ignore[attr-defined]
    line = {
        "wall_s": round(plain, 3),
        "wall_profiled_s": round(profiled, 3),
        "forward_cum_s": round(fwd[0][3], 3) if fwd else None,
        "compute_logits_cum_s": round(logits[0][3], 3) if logits else None,
        "profiled_total_s": round(tot, 3),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
