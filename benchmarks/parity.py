"""Log-prob parity between implementations of the looped models, one JSON line per result.

    OMP_NUM_THREADS=1 python benchmarks/parity.py [--pairs reference] [--families huginn,ouro]
        [--modes exact,fast] [--max-new-tokens 24] [--prompts 4] [--seed 0]

Each line: {"family", "pair", "mode", "max_abs_logprob_diff", "tokens", "depth_min",
"depth_max", "kv", "seconds"}. Families are the four tiny models with their default policy
and KV semantics, plus variants (`VARIANTS`): Ouro's gate (q = 0.8) in each exit KV semantics
(`ouro_kv_full`, `ouro_kv_last_exited`, docs/CONTRACTS.md 3) and Huginn thinking 48 iterations,
8x its tiny mean_recurrence of 6 (`huginn_depth48`). Pairs:

- reference: `models.reference.generate` (token by token, KV cache per (iteration, layer),
  adaptive exits: Huginn KL(0.1), Ouro gate q=0.8) vs `models.reference.replay` (one parallel
  forward per iteration over the recorded exit depths) on tiny random models.

- vllm_vs_reference (parity_vllm.py), megatron_vs_reference (parity_megatron.py),
  megatron_vs_vllm (parity_cross.py): each a function (model, case, mode) -> (max |delta
  logprob|, tokens compared, depths) in `PAIRS`; the workloads are parity_cases.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # first: benchmarks/learner.py
# must not shadow the learner package

from parity_cases import (  # noqa: E402
    FAMILIES,
    POLICIES,
    VARIANTS,
    Case,
    PairFn,
    cli,
    make_case,
    pair_reference,
)
from parity_cross import pair_megatron_vs_vllm  # noqa: E402
from parity_megatron import pair_megatron_vs_reference  # noqa: E402
from parity_vllm import pair_vllm_vs_reference  # noqa: E402

__all__ = ["FAMILIES", "PAIRS", "POLICIES", "VARIANTS", "Case", "make_case", "main"]

# vLLM and megatron themselves are imported only when their pair runs.
PAIRS: dict[str, PairFn] = {
    "reference": pair_reference,
    "megatron_vs_reference": pair_megatron_vs_reference,
    "vllm_vs_reference": pair_vllm_vs_reference,
    "megatron_vs_vllm": pair_megatron_vs_vllm,
}


def main(argv: list[str] | None = None) -> int:
    return cli(argv, PAIRS, "reference", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
