"""Weight updates of vLLM's own Llama (the depth-1 case), on the checkpoint `looprl model init
--family llama --size tiny` writes (head_dim 32, float32, fast numerics, greedy).

vLLM fuses its q/k/v and gate/up weights and, on CPU, packs every linear weight and leaves an
empty parameter, so an update goes through vLLM's reload (generator.engine module doc). Two
engines share the module: one updated in place, one built on the new weights (its outputs
taken once, before anything is updated; the two are closed together at the end).
- after an update to a perturbed set, the log-probs equal the fresh engine's, bit for bit, and
  differ from before; a wrong digest changes nothing first;
- an update from a directory (the engine hashes the files) back to the first set gives the
  first outputs again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from models.checkpoint import load_checkpoint
from models.random_init import init_checkpoint
from tests.generator.update_utils import (
    engine,
    flat,
    greedy_items,
    max_diff,
    moved,
    perturbed,
    shutdown,
    write_like,
)
from weights.check import WeightsRefused
from weights.digest import canonical_digest
from weights.verified import VerifiedWeights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Llama:
    def __init__(self, root: Path) -> None:
        self.a = init_checkpoint("llama", "tiny", root / "a")
        self.state_a = load_checkpoint(self.a)[1]
        self.state_b = perturbed(self.state_a, seed=1)
        self.b = write_like(self.a, self.state_b, root / "b")
        self.items = greedy_items()
        self.engine = engine(self.a)
        self.before = self.engine.generate(self.items)
        self.fresh = engine(self.b)  # built on the new weights
        self.want = self.fresh.generate(self.items)
        self.version = 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    s = Llama(tmp_path_factory.mktemp("llama"))
    yield s
    shutdown(s.engine, s.fresh)


def test_update_equals_a_fresh_engine_on_the_new_weights(llama: Llama) -> None:
    eng, items = llama.engine, llama.items
    if eng.weight_version:  # (run after the next test) back to the first set
        llama.version += 1
        eng.load_weights(
            VerifiedWeights.of(llama.state_a, llama.version, canonical_digest(llama.state_a))
        )
    with pytest.raises(WeightsRefused):
        eng.load_weights(VerifiedWeights.of(llama.state_b, llama.version + 1, "0" * 64))
    assert max_diff(eng.generate(items), llama.before) == 0.0  # still the first set
    llama.version += 1
    eng.load_weights(
        VerifiedWeights.of(llama.state_b, llama.version, canonical_digest(llama.state_b))
    )
    after = eng.generate(items)
    diff, move = max_diff(after, llama.want), moved(after, llama.before)
    print(
        f"\nllama: updated vs fresh engine max|dlogprob| = {diff}; first log-prob moved {move:.3g}"
    )
    assert diff == 0.0
    assert move > 1e-2
    assert all(s.weight_version == llama.version for s in flat(after))


def test_update_from_a_directory_back_to_the_first_set(llama: Llama) -> None:
    eng = llama.engine
    if eng.weight_version == 0:  # run alone: move away first
        llama.version += 1
        eng.load_weights(
            VerifiedWeights.of(llama.state_b, llama.version, canonical_digest(llama.state_b))
        )
    llama.version += 1
    eng.load_weights(VerifiedWeights.of(llama.a, llama.version, canonical_digest(llama.state_a)))
    back = eng.generate(llama.items)
    assert max_diff(back, llama.before) == 0.0
    assert all(s.weight_version == llama.version for s in flat(back))


def test_direct_reload_serves_what_vllms_reload_serves(
    llama: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generator.vllm_plugin.reload._direct_reload (the packed layers refilled through vLLM's own loaders
    and processing, without its per-version bookkeeping) is the path taken on the CPU, and it
    serves bit for bit what vLLM's reload serves on the same weights, before and after a
    reload of vLLM's (which leaves its counting loaders on its record of the layers); over
    DIRECT_RELOAD_BYTES it keeps nothing and vLLM's reload runs."""
    import generator.vllm_plugin.reload as reload_mod

    eng, items = llama.engine, llama.items
    direct = reload_mod._direct_reload
    served = []
    for path in ("direct", "vllm", "direct"):
        monkeypatch.setattr(reload_mod, "_direct_reload",
                            direct if path == "direct" else lambda model, state: False)  # fmt: skip
        llama.version += 1
        eng.load_weights(
            VerifiedWeights.of(llama.state_b, llama.version, canonical_digest(llama.state_b))
        )
        served.append(eng.generate(items))
    kept = eng.llm.collective_rpc(
        lambda w: len(getattr(w.model_runner.get_model(), reload_mod.KEPT, {}))
    )[0]
    assert kept == 8  # 2 layers x (qkv, o, gate_up, down): the packed linear layers
    assert max_diff(served[0], llama.want) == 0.0
    assert max_diff(served[1], llama.want) == 0.0
    assert max_diff(served[2], llama.want) == 0.0
    # over DIRECT_RELOAD_BYTES (a large model) nothing is kept: vLLM's reload serves
    monkeypatch.setattr(reload_mod, "_direct_reload", direct)
    monkeypatch.setattr(reload_mod, "DIRECT_RELOAD_BYTES", 0)
    eng.llm.collective_rpc(lambda w: getattr(w.model_runner.get_model(), reload_mod.KEPT).clear())
    llama.version += 1
    eng.load_weights(
        VerifiedWeights.of(llama.state_b, llama.version, canonical_digest(llama.state_b))
    )
    assert max_diff(eng.generate(items), llama.want) == 0.0
    assert eng.llm.collective_rpc(
        lambda w: len(getattr(w.model_runner.get_model(), reload_mod.KEPT))
    ) == [0]
