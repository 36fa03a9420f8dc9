"""init_checkpoint writes a loadable checkpoint + tokenizer for every family and size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models.checkpoint import load_checkpoint, load_config, load_model
from models.random_init import FAMILIES, init_checkpoint, model_config
from models.tokenizer import BOS_ID, EOS_ID, PAD_ID

pytest.importorskip("models.reference")
from models.reference import build_model  # noqa: E402

BOOKKEEPING = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def structural(d: dict) -> dict:
    out = {k: v for k, v in d.items() if k not in BOOKKEEPING}
    if out.get("layer_types"):  # written out in full for transformers (Ouro)
        assert out["layer_types"] == ["full_attention"] * out["num_hidden_layers"]
        out["layer_types"] = []
    return out


def test_unknown_values_name_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown family 'gpt2'; allowed: huginn, ouro, nanbeige"):
        init_checkpoint("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown size 'huge'; allowed: tiny, small"):
        init_checkpoint("llama", "huge", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown dtype 'int8'; allowed: float32, bfloat16"):
        init_checkpoint("llama", "tiny", tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_loads_and_matches_the_built_model(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = init_checkpoint(family, "tiny", tmp_path / family, seed=3)
    assert sorted(p.name for p in out.iterdir()) == FILES
    config = model_config(family, "tiny")
    loaded_config = load_config(out)
    assert structural(loaded_config.to_hf_dict()) == structural(config.to_hf_dict())
    raw = json.loads((out / "config.json").read_text())
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    assert {k: raw[k] for k in ids} == ids and raw["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text()) == ids

    reference = build_model(config, seed=3)
    _, model = load_model(out, seed=1234)
    ids_ = torch.tensor([[BOS_ID, 20, 13, 25, 31, 19]])
    with torch.no_grad():
        assert torch.equal(model(ids_, latent_seeds=[5]), reference(ids_, latent_seeds=[5]))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if family == "huginn":  # tied head stored once, like transformers does
        assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    assert stored <= set(reference.state_dict())

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.decode(tok("12+7=19")["input_ids"], skip_special_tokens=True) == "12+7=19"


def test_bfloat16_keeps_fp32_buffers_and_same_seed_same_bytes(tmp_path: Path) -> None:
    a = init_checkpoint("huginn", "tiny", tmp_path / "a", seed=7, dtype="bfloat16")
    b = init_checkpoint("huginn", "tiny", tmp_path / "b", seed=7, dtype="bfloat16")
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config, state = load_checkpoint(a)
    assert config["torch_dtype"] == "bfloat16"
    assert state["freqs_cis"].dtype == torch.float32
    assert state["transformer.wte.weight"].dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for n, t in state.items() if n != "freqs_cis")
    c = init_checkpoint("huginn", "tiny", tmp_path / "c", seed=8, dtype="bfloat16")
    other = load_checkpoint(c)[1]["transformer.wte.weight"]
    assert not torch.equal(other, state["transformer.wte.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_small_size_has_10_to_30m_parameters(family: str) -> None:
    config = model_config(family, "small")
    model = build_model(config, seed=0)
    count = sum(p.numel() for p in model.parameters())
    assert 10_000_000 <= count <= 30_000_000, count
    assert config.vocab_size == model_config(family, "tiny").vocab_size


def test_small_checkpoint_round_trips(tmp_path: Path) -> None:
    out = init_checkpoint("llama", "small", tmp_path / "small", seed=0, dtype="bfloat16")
    _, state = load_checkpoint(out)
    reference = build_model(model_config("llama", "small"), seed=0)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_transformers_reads_ours_and_we_read_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout is the real one: transformers' Llama loads our single-file and sharded
    checkpoints with the reference's exact logits, and we load what save_pretrained writes
    (sharded, with a tied head stored once)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from models.checkpoint import save_checkpoint

    out = init_checkpoint("llama", "tiny", tmp_path / "ours", seed=0)
    config, state = load_checkpoint(out)
    sharded = save_checkpoint(state, config, tmp_path / "sharded", max_shard_bytes=100_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    _, reference = load_model(out)
    ids = torch.tensor([[BOS_ID, 20, 13, 25, 31, 19, 27]])
    with torch.no_grad():
        want = reference(ids)
        for path in (out, sharded):
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            assert torch.equal(hf.eval()(ids).logits, want), path

    tied_config = transformers.LlamaConfig(**{**config, "tie_word_embeddings": True})
    hf = transformers.LlamaForCausalLM(tied_config)
    hf.save_pretrained(tmp_path / "theirs", max_shard_size=100_000)
    index = json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # transformers stores a tie once too
    tie = {"lm_head.weight": "model.embed_tokens.weight"}
    _, theirs = load_checkpoint(tmp_path / "theirs", tied=tie)
    assert theirs["lm_head.weight"] is theirs["model.embed_tokens.weight"]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(theirs[name], tensor), name


@pytest.mark.parametrize(
    ("size", "params", "recurrence"),
    [("1b", 553_748_480, 4), ("0125", 3_564_976_800, 32)],  # counted on the meta device
)
def test_gpu_shapes_are_huginn_only_with_the_benchmark_shapes(
    size: str, params: int, recurrence: int
) -> None:
    config = model_config("huginn", size)
    with torch.device("meta"):
        model = build_model(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == params
    assert (config.mean_recurrence, config.vocab_size) == (recurrence, 65536)
    with pytest.raises(ValueError, match="is a Huginn shape"):
        model_config("ouro", size)


def test_ouro_gpu_shape_is_ouro_only_and_weight_bound_sized() -> None:
    """400m: Ouro-1.4B's layer (hidden 2048, 16 heads of 128, intermediate 5632) in 8 layers,
    4 loops, the tiny preset's vocab (the CPU tasks' tokenizer); counted on the meta device."""
    from models.cost import LoopShape

    config = model_config("ouro", "400m")
    with torch.device("meta"):
        model = build_model(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 413_208_577
    assert LoopShape.of(config).params() == 413_138_944  # the cost model's count (no norms)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (2048, 8, 128)
    assert (config.max_depth, config.tie_word_embeddings) == (4, False)
    assert config.vocab_size == model_config("ouro", "tiny").vocab_size
    for family in ("huginn", "nanbeige", "llama"):
        with pytest.raises(ValueError, match="'400m' is an Ouro shape"):
            model_config(family, "400m")
    with pytest.raises(ValueError, match="is a Huginn shape; for family 'ouro' use tiny or "
                       "small, 400m"):  # fmt: skip
        model_config("ouro", "1b")


def test_run_config_refuses_a_gpu_size_of_another_family() -> None:
    from models.errors import ConfigError
    from pipeline.config.run import load_config

    assert load_config(None, ["model.family=ouro", "model.size=400m"]).model.size == "400m"
    with pytest.raises(ConfigError, match="is an Ouro shape; model.family is huginn"):
        load_config(None, ["model.family=huginn", "model.size=400m"])
    with pytest.raises(ConfigError, match="is a Huginn shape; model.family is ouro"):
        load_config(None, ["model.family=ouro", "model.size=1b"])
