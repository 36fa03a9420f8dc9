"""Depth batching in the reference engine (models.engine.chunk): at each core
iteration only the positions still running are computed (compacted), and the results equal the
uncompacted path (`run_chunk(compact=False)`: every row to the deepest one, K/V writes masked):
bit for bit in exact numerics, within 1e-6 in fast, on mixed exit depths, for both KV semantics,
in generation (decode with an exit policy) and replay (mixed recorded depths)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import models.engine.chunk as engine
import models.reference as reference
from models.exits import KL, ExitPolicy, LatentDiff, OuroGate
from models.reference import Generation, SamplingParams, generate, replay
from tests.models.test_reference import PROMPTS, SEEDS, items_of, model_of

LATENT, KL_, GATE = LatentDiff(0.45), KL(0.1), OuroGate(0.8)
CASES: list[tuple[str, ExitPolicy, str, str]] = [  # (family, policy, kv, numerics)
    ("huginn", LATENT, "last_exited", "exact"),
    ("huginn", LATENT, "full", "exact"),
    ("huginn", KL_, "last_exited", "exact"),  # the policy's per-iteration readout, compacted
    ("ouro", GATE, "full", "exact"),
    ("ouro", GATE, "last_exited", "fast"),
    ("huginn", LATENT, "last_exited", "fast"),
]


def _uncompacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """models.reference's generate / replay on the uncompacted path."""
    monkeypatch.setattr(reference, "run_chunk", functools.partial(engine.run_chunk, compact=False))


def _run(
    family: str, policy: ExitPolicy, mode: str, kv: str
) -> tuple[list[Generation], list[reference.ReplayResult]]:
    model = model_of(family)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8)
    pol = dataclasses.replace(policy, kv=kv)  # type: ignore[type-var]
    gens = generate(model, PROMPTS, SEEDS, sampling, pol, mode)
    reps = replay(model, items_of(gens), temperature=0.8, top_p=0.9, numerics=mode, kv=kv)
    return gens, reps


@pytest.mark.parametrize("family,policy,kv,mode", CASES)
def test_compacted_equals_uncompacted(
    family: str, policy: ExitPolicy, kv: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gens, reps = _run(family, policy, mode, kv)
    depths = [d for g in gens for d in g.exit_depths[1:]]
    assert len(set(depths)) >= 2, f"mixed exit depths needed, got {depths}"
    _uncompacted(monkeypatch)
    old_gens, old_reps = _run(family, policy, mode, kv)
    tol = 0.0 if mode == "exact" else 1e-6
    for g, o, r, ro in zip(gens, old_gens, reps, old_reps, strict=True):
        assert g.tokens == o.tokens and g.exit_depths == o.exit_depths
        assert float((g.logprobs - o.logprobs).abs().max()) <= tol
        assert float((r.logprobs - ro.logprobs).abs().max()) <= tol
        assert float((r.entropies - ro.entropies).abs().max()) <= max(tol, 1e-6)
        if mode == "exact":
            assert torch.equal(g.logprobs, o.logprobs) and torch.equal(r.logprobs, ro.logprobs)


@pytest.mark.parametrize("kv", ["last_exited", "full"])
def test_only_running_positions_are_computed(kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows that go through the core stack, summed over iterations and chunks, are the
    iterations each position runs (last_exited: prompt positions the full depth, the sampling
    positions their exit depths; full: every position the full depth, where it cannot save),
    fewer than the uncompacted path's (every row to the deepest one, padding included)."""
    model = model_of("huginn")
    rows: list[int] = []
    core_in = model.core_in

    def counting(state: torch.Tensor, e: torch.Tensor, mode: str) -> torch.Tensor:
        rows.append(state.shape[0])
        return core_in(state, e, mode)

    monkeypatch.setattr(model, "core_in", counting)

    def count() -> tuple[int, list[Generation]]:
        rows.clear()
        gens = generate(model, PROMPTS, SEEDS, SamplingParams(max_new_tokens=8),
                        LatentDiff(0.45, kv=kv), "exact")  # fmt: skip
        return sum(rows), gens

    got, gens = count()
    full = model.max_depth
    prompt = sum((len(g.prompt_tokens) - 1) * full for g in gens)
    if kv == "last_exited":
        want = prompt + sum(sum(g.exit_depths) for g in gens)
    else:
        want = prompt + sum(len(g.exit_depths) * full for g in gens)
    assert got == want, (got, want)
    _uncompacted(monkeypatch)
    old, old_gens = count()
    assert [g.exit_depths for g in old_gens] == [g.exit_depths for g in gens]
    print(f"\nkv={kv}: core rows computed {got} (uncompacted {old})")
    assert got < old
