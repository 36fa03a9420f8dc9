"""The warm start's two parts beside its SFT segments (pipeline/commands/warm_start.py,
pipeline/commands/exit_stages.py): warm_start.embed_std rescales the input embedding,
warm_start.gate_steps runs Ouro's exit-gate stage; each refused with a message where the family
cannot honour it, at config load where the family is known, else when the model is built; and
the two row draws (warm_start.rows).

Cost: tiny-model builds and a few steps, ~5 s."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from models.config import tiny_config
from models.errors import ConfigError
from models.reference import build_model
from pipeline.commands.exit_stages import gate_steps
from pipeline.commands.warm_start import _batch, rescale_embedding, row_picker
from pipeline.config.run import load_config


def test_config_refuses_what_no_family_or_value_honours() -> None:
    base = ["task.kind=dataset", "task.path=configs/data/depth_mix", "task.answer_column=answer"]
    for over, msg in (
        (["model.family=huginn", "warm_start.segments=[1]", "warm_start.gate_steps=2"],
         "warm_start.gate_steps=2: needs a family with an exit gate"),
        (["warm_start.gate_steps=2"], "embed_std and gate_steps are parts of a warm start"),
        (["warm_start.segments=[1]", "warm_start.embed_std=-1.0"], "warm_start.embed_std"),
        (["warm_start.segments=[1]", "warm_start.gate_objective=stage3"], "must be one of"),
        (["warm_start.segments=[1]", "warm_start.rows=all"], "must be one of passes, random"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            load_config(None, [*base, *over])
    cfg = load_config(None, [*base, "model.family=ouro", "warm_start.segments=[1]",
                             "warm_start.gate_steps=2", "warm_start.embed_std=1.0"])  # fmt: skip
    assert (cfg.warm_start.gate_steps, cfg.warm_start.embed_std) == (2, 1.0)


def test_embedding_rescale_and_its_refusal_on_a_tied_head() -> None:
    model = build_model(tiny_config("ouro"), seed=0)
    rescale_embedding(model, 1.0)
    assert abs(float(model.model.embed_tokens.weight.detach().std()) - 1.0) < 1e-4
    tied = build_model(replace(tiny_config("llama"), tie_word_embeddings=True), seed=0)
    with pytest.raises(ConfigError, match="warm_start.embed_std=1.0: needs an untied"):
        rescale_embedding(tied, 1.0)


def test_gate_stage_trains_ouro_and_refuses_huginn() -> None:
    """Stage I lowers the exit-weighted loss of a fixed batch of a tiny Ouro; stage II moves
    the exit gate only; a family without a gate read on its state (Huginn) is refused."""
    ex = [([1, 5, 9, 4], [7, 2]), ([1, 6], [8, 3, 2])]
    ids, mask = _batch(ex, 0)
    ouro = build_model(tiny_config("ouro"), seed=3)
    losses = gate_steps(ouro, lambda _: (ids, mask, [1, 2]), 8, "entropy", 1e-2, 0.05, 50.0,
                        0.005, "fast")  # fmt: skip
    assert losses[-1] < losses[0]
    before = {n: p.detach().clone() for n, p in ouro.named_parameters()}
    gate_steps(ouro, lambda _: (ids, mask, [1, 2]), 2, "adaptive", 1e-2, 0.05, 50.0, 0.005,
               "fast")  # fmt: skip
    moved = {n for n, p in ouro.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("exit_gate" in n for n in moved)
    huginn = build_model(tiny_config("huginn"), seed=0)
    with pytest.raises(ConfigError, match="warm_start.gate_steps: needs a family"):
        gate_steps(huginn, lambda _: (ids, mask, [1, 2]), 1, "entropy", 1e-2, 0.05, 50.0,
                   0.005, "fast")  # fmt: skip


def test_row_draws() -> None:
    """passes: every row once per pass; random: rng.sample each step (the benchmark's draw)."""
    ex = [([i], [i]) for i in range(6)]
    pick = row_picker(ex, 3, "passes", random.Random(0))
    assert sorted(r[0][0] for s in (0, 1) for r in pick(s)) == list(range(6))
    rng, want = random.Random(5), random.Random(5)
    got = row_picker(ex, 4, "random", rng)
    assert [got(s) for s in range(3)] == [want.sample(ex, 4) for _ in range(3)]
