"""The looped vLLM plugin in both exit KV semantics (docs/CONTRACTS.md 3) and deeper than the
model's trained depth, in exact numerics against the models/ reference.

test_vllm_plugin.py covers each family's default kv (Ouro: full, Huginn: last_exited); this
module runs the other two: Ouro with kv='last_exited', and Huginn with kv='full' from a
checkpoint whose mean_recurrence is 4 under a policy whose max depth is 48 (prompts run 48
iterations, generated tokens exit adaptively, mostly beyond 4); and Ouro under a sampled exit
(SampledGate: the exit loop drawn from the gate with the latent seed, its log-prob recorded).
One engine per case.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from generator.engine import LoopedEngine
from models.checkpoint import load_model
from models.config import config_from_hf_dict
from models.exits import ExitPolicy, LatentDiff, OuroGate, SampledGate
from models.random_init import init_checkpoint
from models.reference import ReplayItem, SamplingParams, generate, replay
from tests.generator import prompts, replay_diff, work_item

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CASES: dict[str, tuple[str, ExitPolicy, int]] = {  # family, policy, trained depth
    "huginn-full-48": ("huginn", LatentDiff(0.1, max_depth=48, kv="full"), 4),
    "ouro-last-exited": ("ouro", OuroGate(0.5, kv="last_exited"), 4),
    "ouro-sampled": ("ouro", SampledGate(kv="full"), 4),
}


class Setup:
    def __init__(self, case: str, root: Path) -> None:
        family, self.policy, depth = CASES[case]
        self.case, self.kv = case, self.policy.kv
        self.path = init_checkpoint(family, "tiny", root / case)
        if family == "huginn":  # train-time depth 4; the policy thinks up to 48
            cfg = json.loads((self.path / "config.json").read_text())
            cfg.update(replace(config_from_hf_dict(cfg), mean_recurrence=depth).to_hf_dict())
            (self.path / "config.json").write_text(json.dumps(cfg))
        self.model = load_model(self.path)[1]
        assert self.model.max_depth == depth
        self.full = 48 if family == "huginn" else depth
        self.engine = LoopedEngine(
            self.path,
            numerics="exact",
            exit_policy=self.policy,
            kv_cache_bytes=64 << 20,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=32,
        )


@pytest.fixture(scope="module", params=sorted(CASES))
def setup(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    s = Setup(request.param, tmp_path_factory.mktemp("ckpt"))
    yield s
    engine = s.engine
    del s.engine
    engine.close()
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()


def test_sampled_logprobs_equal_reference_replay_in_the_policys_kv(setup: Setup) -> None:
    items = [
        work_item(p, [300 + i, 2**63 + i], name=f"k{i}", max_tokens=8)
        for i, p in enumerate(prompts(3, [5, 12, 40], seed=7))  # 40 > the 32-token budget
    ]
    results = setup.engine.generate(items)
    assert setup.kv is not None
    other = "full" if setup.kv == "last_exited" else "last_exited"
    diff = max(replay_diff(setup.model, it, ss, "exact", kv=setup.kv)
               for it, ss in zip(items, results))  # fmt: skip
    wrong = max(replay_diff(setup.model, it, ss, "exact", kv=other)
                for it, ss in zip(items, results))  # fmt: skip
    depths = np.concatenate([s.exit_depths[1:] for ss in results for s in ss])
    print(f"\n{setup.case}: vllm-vs-replay(kv={setup.kv}) {diff}, vs kv={other} {wrong:.3f}, "
          f"generated depths {sorted(set(depths.tolist()))}")  # fmt: skip
    assert diff == 0.0
    assert wrong > 1e-4  # the other semantics is a different model here
    assert all(s.full_depth == setup.full for ss in results for s in ss)  # contract 2
    if setup.case.startswith("huginn"):  # Huginn's token 0 runs the full depth (official)
        assert all(s.exit_depths[0] == setup.full for ss in results for s in ss)
    assert len(set(depths.tolist())) >= 2, "adaptive exits vary"
    if setup.case.startswith("huginn"):
        assert int(depths.max()) > setup.model.max_depth  # generated tokens think deeper


def test_greedy_equals_reference_generation(setup: Setup) -> None:
    ps = prompts(2, [6, 13], seed=8)
    seeds = [9, 10]
    items = [work_item(p, [s], temperature=0.0, max_tokens=8) for p, s in zip(ps, seeds)]
    got = [ss[0] for ss in setup.engine.generate(items)]
    sampling = SamplingParams(greedy=True, max_new_tokens=8)
    ref = generate(setup.model, ps, seeds, sampling, setup.policy, "exact")
    for g, r in zip(got, ref):
        assert g.tokens.tolist() == r.tokens
        assert g.exit_depths.tolist() == r.exit_depths
        assert np.array_equal(g.logprobs, r.logprobs.numpy())
        if isinstance(setup.policy, SampledGate):  # the same exits drawn, the same log-probs
            assert g.exit_logprobs is not None and r.exit_logprobs is not None
            assert np.array_equal(g.exit_logprobs, r.exit_logprobs.numpy())
        else:
            assert g.exit_logprobs is None


def test_sampled_exit_logprobs_replay_bit_for_bit(setup: Setup) -> None:
    """A sampled exit's log-probs as the plugin recorded them equal models.reference replay's
    recomputation from the recorded depths (what the learner checks), sampled tokens too."""
    if not isinstance(setup.policy, SampledGate):
        assert all(s.exit_logprobs is None for ss in setup.engine.generate(
            [work_item([5, 6, 7], [1], max_tokens=3)]) for s in ss)  # fmt: skip
        return
    items = [work_item(p, [700 + i, 2**63 + 7 + i], name=f"s{i}", max_tokens=8)
             for i, p in enumerate(prompts(3, [4, 9, 17], seed=11))]  # fmt: skip
    results = setup.engine.generate(items)
    n = 0
    for it, ss in zip(items, results):
        for s in ss:
            assert s.exit_logprobs is not None and s.exit_logprobs.shape == s.tokens.shape
            item = ReplayItem([int(t) for t in it.prompt_tokens], s.tokens.tolist(),
                              s.latent_seed, s.exit_depths.tolist(), s.full_depth)  # fmt: skip
            r = replay(setup.model, [item], temperature=it.temperature, top_p=it.top_p,
                       numerics="exact", exit_policy=setup.policy)[0]  # fmt: skip
            assert r.exit_logprobs is not None
            assert np.array_equal(s.exit_logprobs, r.exit_logprobs.numpy())
            assert np.array_equal(s.logprobs, r.logprobs.numpy())
            n += s.tokens.shape[0]
    depths = {int(d) for ss in results for s in ss for d in s.exit_depths}
    print(f"\nsampled exit: {n} tokens, exit log-probs equal replay's, depths {sorted(depths)}")
    assert len(depths) >= 3
