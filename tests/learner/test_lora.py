"""learner.lora: low-rank adapters on the reference backend's policy. At init the adapted
model is its base bit for bit; a step changes the adapters only (the base's bytes stay, the
optimizer holds A and B only); the published weights are the merged ones; bad targets are
refused by name."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.errors import ConfigError
from pipeline.config.run import load_config
from proto.records import Rollout

_RUN = ["backend=reference", "rollout.n=4", "rollout.prompts_per_step=2",
        "learner.backprop_depth=0", "optimizer.lr=0.05"]  # fmt: skip


def _rollouts(groups: int = 2, n: int = 4, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = np.array([1, 18 + g, 19 + g], np.int32)
        for i in range(n):
            toks = np.array([rng.randrange(20, 200) for _ in range(5)], np.int32)
            out.append(Rollout(
                rollout_id=f"w{g}/{i}", work_id=f"w{g}", prompt_id=f"p{g}", sample_index=i,
                generator_id="g0", latent_seed=1000 * g + i, prompt_tokens=prompt, tokens=toks,
                logprobs=np.full(5, -6.0, np.float32), exit_depths=np.full(5, 4, np.uint8),
                weight_version=0, reward=float(rng.random()),
            ))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.random_init import init_checkpoint

    d = tmp_path_factory.mktemp("m") / "huginn"
    init_checkpoint("huginn", "tiny", d, seed=0)
    return d


def _trainer(model: Path, *over: str) -> Any:
    from pipeline.backends.reference_trainer import ReferenceTrainer

    return ReferenceTrainer(load_config(None, [*_RUN, *over]), model)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_at_init_the_adapted_model_is_its_base_bit_for_bit(model: Path, numerics: str) -> None:
    from learner.config import LoraConfig
    from learner.lora import apply_lora
    from models.checkpoint import load_model

    _, base = load_model(model)
    _, adapted = load_model(model)
    ad = apply_lora(adapted, LoraConfig(rank=4, alpha=8.0), seed=3)
    assert len(ad.factors) == 16  # (1 prelude + 2 core + 1 coda blocks) x Wqkv, proj, fc, proj
    assert all(float(f.lora_A.detach().abs().max()) > 0 for f in ad.factors.values())
    ids = torch.tensor([[1, 18, 19, 40, 41, 42, 7]])
    with torch.no_grad():
        want = base(ids, [5], numerics=numerics)
        got = adapted(ids, [5], numerics=numerics)
    assert torch.equal(got, want)


def test_a_step_trains_the_adapters_only(model: Path, tmp_path: Path) -> None:
    from models.checkpoint import load_checkpoint

    t = _trainer(model, "learner.lora.rank=4", "learner.lora.alpha=8")
    names = list(t.adapters.factors)
    assert names == sorted(names) and "transformer.core_block.0.attn.Wqkv" in names
    assert not any(n.startswith("lm_head") for n in names)  # not matched by the default
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    trained = {k for k, p in t.model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.parametrizations.weight.0.{ab}" for n in names
                       for ab in ("lora_A", "lora_B")}  # fmt: skip

    def changed() -> set[str]:
        after = t.model.state_dict()
        return {k for k in before if not torch.equal(before[k], after[k])}

    out = t.step(_rollouts(), [False] * 8).metrics
    assert out["updates"] == 1.0 and out["grad_norm"] > 0
    # B = 0 at init, so A's first gradient (s B^T dW) is 0: the first update moves B only
    assert changed() == {k for k in trained if k.endswith("lora_B")}
    t.step(_rollouts(seed=1), [False] * 8)
    assert changed() == trained, changed() ^ trained  # every A and B moved, nothing else
    # the optimizer holds exactly the adapter tensors (Adam moments of each, nothing more)
    opt = t.policy.policy.opt
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in t.adapters.parameters()}
    assert len(opt.state) == len(held) == 2 * len(names)
    # the publication is the merged model under the base's names: adapted weights moved by
    # exactly s B A (models.lora), the rest the base's bytes
    t.publish(tmp_path / "v1", 1)
    pub = load_checkpoint(tmp_path / "v1")[1]
    base = load_checkpoint(model)[1]
    assert pub.keys() == base.keys()
    moved = {k for k in pub if not torch.equal(pub[k], base[k])}
    assert moved == {f"{n}.weight" for n in names}
    f = t.adapters.factors["transformer.core_block.1.mlp.proj"]
    w = base["transformer.core_block.1.mlp.proj.weight"]
    want = (w.double() + 2.0 * f.lora_B.detach().double() @ f.lora_A.detach().double()).float()
    assert torch.equal(pub["transformer.core_block.1.mlp.proj.weight"], want)


def test_bad_targets_are_refused_by_name(model: Path) -> None:
    with pytest.raises(ConfigError, match=r"'\*q_proj' matches no linear.*core_block\.\*\.attn"):
        _trainer(model, "learner.lora.rank=4", 'learner.lora.targets=["*q_proj"]')
    with pytest.raises(ConfigError, match="lm_head shares its weight"):  # the tiny head is tied
        _trainer(model, "learner.lora.rank=4", "learner.lora.targets=[lm_head]")
    with pytest.raises(ConfigError, match="learner.lora.dropout"):
        _trainer(model, "learner.lora.rank=4", "learner.lora.dropout=0.1")
    with pytest.raises(ConfigError, match="learner.lora.rank=-1"):
        load_config(None, ["learner.lora.rank=-1"])
