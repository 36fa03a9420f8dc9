"""The "vllm_vs_reference" pair of benchmarks/parity.py: the vLLM plugin vs reference replay.

    OMP_NUM_THREADS=1 python benchmarks/parity_vllm.py [parity.py options]
        (= parity.py with this pair registered and --pairs vllm_vs_reference by default)

`pair_vllm_vs_reference(model, case, mode)` writes `model` as an HF checkpoint, serves it
with `generator.engine.LoopedEngine` (numerics `mode`, the case's exit policy), samples every
prompt once with its seed, and replays the completions with `models.reference.replay`:
returns (max |delta logprob|, tokens compared, exit depths). The depth-1 Llama goes through
vLLM's own LlamaForCausalLM (log-probs from vLLM's sampler, processed mode).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the root first: benchmarks/learner.py must not shadow the learner package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity_cases import Case, cli, pair_reference  # noqa: E402

from models.base import LoopedLM  # noqa: E402
from models.reference import ReplayItem, replay  # noqa: E402
from proto.records import WorkItem  # noqa: E402


def _save(model: LoopedLM, out: Path) -> Path:
    from models.checkpoint import save_checkpoint, state_dict_for_save
    from models.ties import tied_from_module
    from models.tokenizer import BOS_ID, EOS_ID, PAD_ID, tokenizer_files

    config = model.config
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    config_dict = {**config.to_hf_dict(), **ids, "torch_dtype": "float32"}
    if config_dict.get("layer_types") == []:
        config_dict["layer_types"] = ["full_attention"] * config_dict["num_hidden_layers"]
    extra: dict = dict(tokenizer_files(config.vocab_size))
    extra["generation_config.json"] = ids
    state = state_dict_for_save(model, torch.float32)
    return save_checkpoint(state, config_dict, out, tied=tied_from_module(model), extra_files=extra)


def vllm_samples(model: LoopedLM, case: Case, mode: str) -> list[Any]:
    """Serve `model` with LoopedEngine (numerics `mode`, the case's exit policy) and sample
    every prompt once with its latent seed; returns one engine Sample per prompt."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from generator.engine import LoopedEngine

    s = case.sampling
    with tempfile.TemporaryDirectory() as tmp:
        path = _save(model, Path(tmp) / "ckpt")
        policy = case.policy if model.max_depth > 1 else None
        engine = LoopedEngine(
            path, numerics=mode, exit_policy=policy, kv_cache_bytes=32 << 20, max_model_len=512
        )
        try:
            items = [
                WorkItem(
                    work_id=f"w{i}",
                    prompt_id=f"p{i}",
                    prompt_tokens=np.asarray(p, dtype=np.int32),
                    latent_seeds=np.asarray([seed], dtype=np.uint64),
                    temperature=1.0 if s.greedy else s.temperature,
                    top_p=s.top_p,
                    max_tokens=s.max_new_tokens,
                    stop_token_ids=list(s.stop_token_ids),
                )
                for i, (p, seed) in enumerate(zip(case.prompts, case.seeds))
            ]
            return [ss[0] for ss in engine.generate(items)]
        finally:
            engine.close()
            del engine
            gc.collect()
            cleanup_dist_env_and_memory()


def pair_vllm_vs_reference(model: LoopedLM, case: Case, mode: str) -> tuple[float, int, list[int]]:
    """vLLM plugin generation vs reference replay of the same completions (see module doc)."""
    s = case.sampling
    samples = vllm_samples(model, case, mode)
    replay_items = [
        ReplayItem(
            p, x.tokens.tolist(), x.latent_seed, x.exit_depths.tolist(), x.full_depth or None
        )
        for p, x in zip(case.prompts, samples)
    ]
    results = replay(
        model, replay_items, temperature=s.temperature, top_p=s.top_p, numerics=mode,
        kv=case.policy.kv,
    )  # fmt: skip
    diff = max(
        float((torch.from_numpy(x.logprobs) - r.logprobs).abs().max())
        for x, r in zip(samples, results)
    )
    depths = [int(d) for x in samples for d in x.exit_depths]
    return diff, sum(int(x.tokens.shape[0]) for x in samples), depths


def main(argv: list[str] | None = None) -> int:
    pairs = {"vllm_vs_reference": pair_vllm_vs_reference, "reference": pair_reference}
    return cli(argv, pairs, "vllm_vs_reference", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
