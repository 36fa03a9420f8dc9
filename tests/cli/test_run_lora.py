"""`looprl run learner.lora.rank=16` as a user runs it (the quickstart: tiny Huginn, the
megatron learner, a vLLM generator): it trains adapters only, and the embedding of the model
it initialized itself (learner.lora.train_embeddings auto: a random embedding). Every step has
its reward and loss rows; the published versions the generator served are the base with only
the adapted linears (every block's attention and MLP projections), the norms and the embedding
moved, the adapter linear left as it was; the run recorded the choice; the final checkpoint
holds the adapters in the PEFT layout, the norms and the embedding as modules saved whole."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.cli.test_run_llama import looprl_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_looprl_run_trains_adapters_only(tmp_path: Path) -> None:
    from learner.peft_adapter import read_peft, read_saved
    from models.checkpoint import load_checkpoint

    run = tmp_path / "run"
    code, err, wall = looprl_run(run, "steps=12", "learner.lora.rank=16", "optimizer.lr=3e-2",
                                 timeout_s=240)  # fmt: skip
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
    assert rows[-1]["version"] == 11  # a new weight version every step
    # the last published version against the starting checkpoint
    base = load_checkpoint(run / "init")[1]
    last = max((run / "weights").glob("v*"), key=lambda p: int(p.name[1:]))
    pub = load_checkpoint(last)[1]
    assert pub.keys() == base.keys()
    moved = {k for k in pub if not torch.equal(pub[k], base[k])}
    linears = {k for k in base if k.endswith(("attn.Wqkv.weight", "attn.proj.weight",
                                              "mlp.fc.weight", "mlp.proj.weight"))}  # fmt: skip
    norms = {k for k in base if ".norm_" in k or k == "transformer.ln_f.weight"}
    emb = {"transformer.wte.weight"}  # auto: trained, the run's own random init
    assert len(linears) == 16 and len(norms) == 17
    assert moved == linears | norms | emb, sorted(moved ^ (linears | norms | emb))
    from pipeline.commands.learner_main import resolve_config

    assert resolve_config(None, str(run), []).learner.lora.train_embeddings is True
    # the final checkpoint's adapter, as Hugging Face PEFT reads it
    ckpt = max((run / "checkpoints").glob("step_*"))
    assert ckpt.name == "step_00000012"
    config, adapters = read_peft(ckpt / "adapter")
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (16, 16.0, "LORA")
    assert sorted(adapters) == sorted(k.removesuffix(".weight") for k in linears)
    assert all(a.shape[0] == 16 and b.shape[1] == 16 for a, b in adapters.values())
    saved = read_saved(ckpt / "adapter")
    assert saved.keys() == norms | emb
    assert all(torch.equal(saved[k], pub[k]) for k in norms | emb)  # the final ones, published
