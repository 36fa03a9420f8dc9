"""Both learner policies on ragged rows (exact numerics: the same bits across the two
policies for every loop-aware term): the reference policy (learner.torch_policy, models.engine.chunk's
replay) and the megatron policy (learner.loop_forward, LoopedGPT's loop hook) take one step on
the same sampled-exit rollouts of a tiny Ouro: prompts of 1-4 tokens, responses cut to 7, 3, 1
and 5 tokens, exit depths 1..4 drawn from the gate (SampledGate, exact numerics). Each loop
weighting with the exit term (objective.exit_coef, exit_entropy_coef) and the KL to a
reference: every metric, every rollout's measured claim (token and exit log-probs: 0) and
every published weight the same bits. A one-token prompt has no position at the full depth,
so a row's full depth must come from its record (docs/CONTRACTS.md 2), not from its deepest
position: the sampled exit is forced there, the exit_pdf weights put the remaining mass there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.config import tiny_config
from models.exits import SampledGate
from models.reference import SamplingParams, build_model, generate
from proto.records import Rollout

CUTS = (7, 3, 1, 5)
"""Response lengths after the cut (a prefix of a generation is a valid record)."""


def _rollouts(m: Any) -> list[Rollout]:
    prompts, seeds = [[3], [1, 5], [9, 2, 6, 5], [3, 5, 7]], [31, 32, 33, 34]
    gens = generate(m, prompts, seeds, SamplingParams(max_new_tokens=7), SampledGate(), "exact")
    out = []
    for i, (g, n) in enumerate(zip(gens, CUTS)):
        assert g.exit_logprobs is not None and len(g.tokens) >= n
        out.append(Rollout(
            rollout_id=f"w{i // 2}/{i % 2}", work_id=f"w{i // 2}", prompt_id=f"p{i // 2}",
            sample_index=i % 2, generator_id="g", latent_seed=g.latent_seed,
            prompt_tokens=np.asarray(g.prompt_tokens, np.int32),
            tokens=np.asarray(g.tokens[:n], np.int32), logprobs=g.logprobs.numpy()[:n],
            exit_depths=np.asarray(g.exit_depths[:n], np.uint8), weight_version=0,
            reward=float((3 * i) % 4), full_depth=g.full_depth,
            exit_logprobs=g.exit_logprobs.numpy()[:n], finish_reason="length",
        ))  # fmt: skip
    return out


def ragged_ouro(root: Path) -> list[Rollout]:
    """The tiny Ouro of this module (seed 5, exit gate's bias -0.3) saved at ``root``, and its
    ragged sampled-exit rollouts (`_rollouts`)."""
    from models.checkpoint import save_checkpoint, state_dict_for_save
    from models.ties import tied_from_module

    m: Any = build_model(tiny_config("ouro"), seed=5)
    with torch.no_grad():
        m.model.early_exit_gate.bias.fill_(-0.3)
    save_checkpoint(state_dict_for_save(m), m.config.to_hf_dict(), root, tied=tied_from_module(m))
    return _rollouts(m)


def _both(root_s: str, weightings: list[str]) -> dict[str, Any]:
    """The cases in one process of its own (run_distributed): a megatron trainer in exact
    numerics leaves state in the process that moves a later fast-numerics run's gradients
    (tests/learner/test_exit_term.py)."""
    from models.checkpoint import load_checkpoint
    from pipeline.backends.megatron_adapter import MegatronTrainer
    from pipeline.backends.reference_trainer import ReferenceTrainer
    from pipeline.config.run import load_config

    root = Path(root_s) / "ouro"
    rolls = ragged_ouro(root)
    out: dict[str, Any] = {"depths": sorted({int(d) for r in rolls for d in r.exit_depths}),
                           "full": [r.full_depth for r in rolls], "cases": {}}  # fmt: skip
    for w in weightings:
        over = ["numerics=exact", "rollout.n=2", "rollout.prompts_per_step=2",
                "rollout.temperature=1.0", "rollout.exit_policy={kind: sampled_gate}",
                "objective.exit_coef=0.5", "objective.exit_entropy_coef=0.02",
                "objective.kind=grpo", "objective.kl_coef=0.05", "objective.entropy_coef=0.01",
                f"objective.loop_weighting={w}", "optimizer.lr=1e-3",
                "learner.backprop_depth=0"]  # fmt: skip
        over += ["objective.progressive_alpha=2.0"] if w == "progressive" else []
        over += ["objective.loop_weight_lr=0.05"] if w == "learned" else []
        case: dict[str, Any] = {"res": {}, "mism": {}, "weights": {}}
        for backend in ("reference", "megatron"):
            cfg = load_config(None, [f"backend={backend}", *over])
            t: Any = (ReferenceTrainer(cfg, root) if backend == "reference"
                      else MegatronTrainer(cfg, root))  # fmt: skip
            try:
                res = t.step(rolls, [False] * len(rolls))
                case["res"][backend] = dict(res.metrics)
                case["mism"][backend] = list(res.mismatch)
                t.publish(Path(root_s) / f"{w}-{backend}", 1)
                case["weights"][backend] = load_checkpoint(Path(root_s) / f"{w}-{backend}")[1]
            finally:
                t.close() if backend == "megatron" else None
        a, b = case["weights"]["reference"], case["weights"]["megatron"]
        case["same_names"] = sorted(a) == sorted(b)
        case["unequal"] = sorted(k for k in a if k in b and not torch.equal(a[k], b[k]))
        case["worst"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        start = load_checkpoint(root)[1]
        case["moved"] = sorted(k for k, x in start.items() if k in a and not torch.equal(a[k], x))
        del case["weights"]
        out["cases"][w] = case
    return out


WEIGHTINGS = ["last", "uniform", "progressive", "exit_pdf", "learned"]


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.learner.dist_utils import run_distributed

    root = tmp_path_factory.mktemp("ragged")
    (out,) = run_distributed(_both, 1, str(root), WEIGHTINGS, torchrun_env=False, timeout_s=900)
    return out


def test_the_rollouts_are_ragged(ragged: dict[str, Any]) -> None:
    assert ragged["depths"] == [1, 2, 3, 4], ragged["depths"]
    assert ragged["full"] == [4] * 4


@pytest.mark.megatron
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_same_bits_across_policies(ragged: dict[str, Any], weighting: str) -> None:
    case = ragged["cases"][weighting]
    ref, meg = case["res"]["reference"], case["res"]["megatron"]
    assert ref["updates"] == 1.0 and ref["exit_entropy"] > 0 and ref["kl_ref"] >= 0
    assert ref["exit_loss"] != 0.0, ref
    assert set(ref) == set(meg)
    bad = {k: (ref[k], meg[k]) for k in ref if ref[k] != meg[k] and ref[k] == ref[k]}
    assert not bad, bad
    assert case["mism"]["reference"] == case["mism"]["megatron"] == [0.0] * 4
    assert case["same_names"]
    assert not case["unequal"], (case["unequal"], case["worst"])
    assert "model.early_exit_gate.weight" in case["moved"], case["moved"]
    if weighting != "last":
        assert ref["loop_depth_mean"] < 4.0, ref
