"""Weight updates through each served model's own loader, one engine per test (closed at its
end; see tests/generator/update_utils.py), checked against the reference forward (models/):

- vLLM's Llama with its head tied to the embedding: vLLM's reload processes only the layer
  that loads a shared parameter, so the head's packed copy is rebuilt by the engine; then a set
  that passes its digest but does not fit the model breaks the engine for good;
- the looped plugin families Ouro and Nanbeige (Huginn: tests/generator/test_engine.py; the
  untied Llama against a fresh engine: tests/generator/test_llama_weight_updates.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from generator.engine import WeightLoadError
from models.checkpoint import load_checkpoint, load_model
from models.random_init import init_checkpoint
from tests.generator.update_utils import (
    engine,
    flat,
    greedy_items,
    moved,
    perturbed,
    replay_all,
    shutdown,
    tied_llama,
    write_like,
)
from weights.digest import canonical_digest
from weights.verified import VerifiedWeights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# ---- a tied head ------------------------------------------------------------------------------
def test_tied_llama_update_and_an_unloadable_set_breaks_the_engine(tmp_path: Path) -> None:
    a = tied_llama(tmp_path / "tied", seed=0)
    state_a = load_checkpoint(a)[1]
    assert "lm_head.weight" not in state_a
    state_b = perturbed(state_a, seed=2)
    b = write_like(a, state_b, tmp_path / "tied-b")
    eng = engine(a)
    try:
        items = greedy_items()
        before = eng.generate(items)
        eng.load_weights(VerifiedWeights.of(state_b, 1, canonical_digest(state_b)))
        after = eng.generate(items)
        diff = replay_all(load_model(b)[1], items, after)
        print(f"\ntied llama update vs reference max|dlogprob| = {diff:.3g}")
        assert diff <= 1e-4
        assert moved(after, before) > 1e-2
        # a set that passes its digest but does not fit the model: the loader fails part way
        bad = dict(state_b)
        bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)
        with pytest.raises(WeightLoadError, match="weights v2: the model's weight loader"):
            eng.load_weights(VerifiedWeights.of(bad, 2, canonical_digest(bad)))
        assert eng.weight_version == 1 and "weights v2" in eng.broken
        with pytest.raises(WeightLoadError):
            eng.generate(items)
        with pytest.raises(WeightLoadError):
            eng.load_weights(VerifiedWeights.of(state_a, 3, canonical_digest(state_a)))
    finally:
        shutdown(eng)


# ---- the looped plugin families ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_plugin_family_update_equals_the_reference(family: str, tmp_path: Path) -> None:
    a = init_checkpoint(family, "tiny", tmp_path / family)
    state_b = perturbed(load_checkpoint(a)[1], seed=3)
    b = write_like(a, state_b, tmp_path / f"{family}-b")
    eng = engine(a)
    try:
        items = greedy_items()
        before = eng.generate(items)
        eng.load_weights(VerifiedWeights.of(state_b, 1, canonical_digest(state_b)))
        after = eng.generate(items)
        diff = replay_all(load_model(b)[1], items, after)
        print(f"\n{family} update vs reference max|dlogprob| = {diff:.3g}")
        assert diff <= 1e-4
        assert moved(after, before) > 1e-2
        assert all(s.weight_version == 1 for s in flat(after))
    finally:
        shutdown(eng)
