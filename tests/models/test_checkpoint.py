"""Hugging Face checkpoint IO: bit-exact round trips, sharding, ties and named errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models.checkpoint import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    load_checkpoint,
    load_into,
    plan_shards,
    read_config,
    save_checkpoint,
    state_dict_for_save,
    validate_state_dict,
)
from models.errors import CheckpointError, ConfigError
from models.ties import find_aliases


def checkpoint_files(path: Path) -> list[str]:
    """Weight, index and config files of a checkpoint directory."""
    return sorted(
        p.name for p in path.iterdir() if p.name == "config.json" or "safetensors" in p.name
    )


CONFIG = {"model_type": "synthetic", "hidden_size": 8, "torch_dtype": "float32"}
TIED = {"lm_head.weight": "transformer.wte.weight"}


def synthetic_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g)
    return {
        "transformer.wte.weight": torch.randn(32, 8, generator=g),
        "transformer.h.0.attn.weight": torch.randn(24, 8, generator=g).bfloat16(),
        "transformer.h.0.mlp.weight": torch.randn(16, 8, generator=g).half(),
        "transformer.h.0.norm.weight": torch.ones(8),
        "transformer.h.0.transposed": wide.t(),  # not contiguous
        "transformer.h.0.slice": wide[2:4],  # a view into a larger storage
        "freqs_cis": torch.randn(1, 16, 1, 2, 2, generator=g, dtype=torch.float32),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        # bit-exact, NaN and -0.0 included: compare the raw bytes too
        x, y = a[name].reshape(-1).contiguous(), b[name].reshape(-1).contiguous()
        assert x.view(torch.uint8).tolist() == y.view(torch.uint8).tolist(), name
        if not a[name].is_floating_point() or not a[name].isnan().any():
            assert torch.equal(a[name], b[name]), name


class TiedModel(torch.nn.Module):
    """lm_head.weight is transformer.wte.weight, plus an fp32 RoPE buffer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = torch.nn.ModuleDict(
            {"wte": torch.nn.Embedding(32, 8), "proj": torch.nn.Linear(8, 8)}
        )
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.register_buffer("freqs_cis", torch.randn(1, 16, 1, 2, 2), persistent=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.proj(self.transformer.wte(ids)))


def test_round_trip_single_file_is_bit_exact(tmp_path: Path) -> None:
    state = synthetic_state()
    save_checkpoint(state, CONFIG, tmp_path / "ckpt")
    assert checkpoint_files(tmp_path / "ckpt") == ["config.json", SAFE_WEIGHTS_NAME]
    config, got = load_checkpoint(tmp_path / "ckpt")
    assert config == CONFIG
    assert_same(state, got)
    with safe_open(str(tmp_path / "ckpt" / SAFE_WEIGHTS_NAME), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    text = (tmp_path / "ckpt" / "config.json").read_text()
    assert text == json.dumps(CONFIG, indent=2, sort_keys=True) + "\n"


def test_same_state_gives_same_bytes(tmp_path: Path) -> None:
    state = synthetic_state()
    save_checkpoint(state, CONFIG, tmp_path / "a", max_shard_bytes=200)
    save_checkpoint(
        dict(reversed(list(state.items()))), CONFIG, tmp_path / "b", max_shard_bytes=200
    )
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_sharded_matches_single_file_and_hf_index(tmp_path: Path) -> None:
    state = synthetic_state()
    save_checkpoint(state, CONFIG, tmp_path / "single")
    save_checkpoint(state, CONFIG, tmp_path / "sharded", max_shard_bytes=300)
    files = checkpoint_files(tmp_path / "sharded")
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and SAFE_WEIGHTS_NAME not in files
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    index = json.loads((tmp_path / "sharded" / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert sorted(index["weight_map"]) == sorted(state)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    for shard in shards:
        with safe_open(str(tmp_path / "sharded" / shard), "pt") as f:
            names = list(f.keys())
            size = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
        assert size <= 300 or len(names) == 1, shard
        assert all(index["weight_map"][n] == shard for n in names)
    _, single = load_checkpoint(tmp_path / "single")
    _, sharded = load_checkpoint(tmp_path / "sharded")
    assert_same(single, sharded)
    assert_same(state, sharded)


def test_plan_shards_follows_huggingface_rule() -> None:
    sizes = {"a": 6, "b": 6, "c": 2, "d": 6, "e": 2, "f": 2, "g": 11}
    assert plan_shards(sizes, 10) == [["a"], ["b", "c"], ["g"], ["d", "e", "f"]]
    assert plan_shards({}, 10) == [[]]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_shards(sizes, 0)


def test_tied_weight_stored_once_and_tied_after_load(tmp_path: Path) -> None:
    model = TiedModel()
    state = model.state_dict()
    assert find_aliases(state) == {"transformer.wte.weight": "lm_head.weight"}
    save_checkpoint(state, CONFIG, tmp_path / "ckpt", tied=TIED)
    with safe_open(str(tmp_path / "ckpt" / SAFE_WEIGHTS_NAME), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()
    _, got = load_checkpoint(tmp_path / "ckpt", tied=TIED)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    _, plain = load_checkpoint(tmp_path / "ckpt")
    assert "lm_head.weight" not in plain

    fresh = TiedModel(seed=1)
    report = load_into(fresh, plain)
    assert report == {"lm_head.weight": "transformer.wte.weight"}
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(fresh(ids), model(ids))


def test_checkpoint_storing_both_tied_names_loads_tied(tmp_path: Path) -> None:
    model = TiedModel()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # undeclared: both stored
    save_checkpoint(state, CONFIG, tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / SAFE_WEIGHTS_NAME), "pt") as f:
        assert {"lm_head.weight", "transformer.wte.weight"} <= set(f.keys())
    _, got = load_checkpoint(tmp_path / "ckpt", tied=TIED)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    fresh = TiedModel(seed=1)
    load_into(fresh, got)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_tie_that_differs_is_refused(tmp_path: Path) -> None:
    state = TiedModel().state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight"):
        save_checkpoint(state, CONFIG, tmp_path / "ckpt", tied=TIED)
    save_checkpoint(state, CONFIG, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(tmp_path / "ckpt", tied=TIED)
    _, got = load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="one tensor in the model"):
        load_into(TiedModel(), got)
    with pytest.raises(ValueError, match="source not in state dict"):
        save_checkpoint(state, CONFIG, tmp_path / "x", tied={"lm_head.weight": "nope"})


def test_bf16_weights_keep_fp32_buffers(tmp_path: Path) -> None:
    model = TiedModel()
    state = state_dict_for_save(model, torch.bfloat16)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert state["transformer.proj.weight"].dtype == torch.bfloat16
    assert state["freqs_cis"].dtype == torch.float32
    save_checkpoint(state, CONFIG, tmp_path / "ckpt", tied=TIED)
    _, got = load_checkpoint(tmp_path / "ckpt", tied=TIED)
    assert got["transformer.wte.weight"].dtype == torch.bfloat16
    assert got["freqs_cis"].dtype == torch.float32
    assert torch.equal(got["freqs_cis"], model.freqs_cis)
    fresh = TiedModel(seed=1)
    load_into(fresh, got)  # bf16 into fp32 parameters: cast, buffers bit-exact
    assert fresh.transformer.wte.weight.dtype == torch.float32
    assert torch.equal(fresh.freqs_cis, model.freqs_cis)
    with pytest.raises(CheckpointError, match="expected dtype torch.float32, got torch.bfloat16"):
        load_into(TiedModel(), got, strict_dtype=True)


def test_validate_names_every_problem() -> None:
    expected = {
        "a.weight": ((2, 3), torch.float32),
        "b.weight": ((4,), torch.float32),
        "c.weight": ((5,), torch.float32),
        "ids": ((3,), torch.int64),
    }
    got = {
        "a.weight": torch.zeros(3, 2),
        "c.weight": torch.zeros(5, dtype=torch.bfloat16),
        "ids": torch.zeros(3),
        "stray": torch.zeros(1),
    }
    with pytest.raises(CheckpointError) as err:
        validate_state_dict(expected, got)
    msg = str(err.value)
    assert "missing tensors: b.weight" in msg
    assert "unexpected tensors: stray" in msg
    assert "a.weight (expected shape (2, 3), got (3, 2))" in msg
    assert "ids (expected dtype torch.int64, got torch.float32)" in msg
    assert "c.weight" not in msg  # floating -> floating is a cast, allowed
    validate_state_dict(
        {"t": ((2,), None), "s": ((2,), None)}, {"s": torch.zeros(2)}, tied={"t": "s"}
    )


def test_load_into_refuses_mismatch_and_leaves_module_untouched() -> None:
    model = TiedModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["transformer.proj.weight"] = torch.zeros(8, 9)
    del state["freqs_cis"]
    state["extra.bias"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as err:
        load_into(model, state)
    msg = str(err.value)
    assert "freqs_cis" in msg and "extra.bias" in msg
    assert "transformer.proj.weight (expected shape (8, 8), got (8, 9))" in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_missing_shard_is_named(tmp_path: Path) -> None:
    save_checkpoint(synthetic_state(), CONFIG, tmp_path / "ckpt", max_shard_bytes=300)
    index = json.loads((tmp_path / "ckpt" / SAFE_WEIGHTS_INDEX_NAME).read_text())
    victim = index["weight_map"]["freqs_cis"]
    (tmp_path / "ckpt" / victim).unlink()
    with pytest.raises(CheckpointError, match=f"missing: {victim} \\(holds .*freqs_cis"):
        load_checkpoint(tmp_path / "ckpt")


def test_index_and_shard_disagree(tmp_path: Path) -> None:
    save_checkpoint(synthetic_state(), CONFIG, tmp_path / "ckpt", max_shard_bytes=300)
    path = tmp_path / "ckpt" / SAFE_WEIGHTS_INDEX_NAME
    index = json.loads(path.read_text())
    index["weight_map"]["ghost.weight"] = index["weight_map"]["freqs_cis"]
    path.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match="lacks tensors its index lists there: \\['ghost.weight'\\]"
    ):
        load_checkpoint(tmp_path / "ckpt")
    del index["weight_map"]["ghost.weight"], index["weight_map"]["freqs_cis"]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not list: \\['freqs_cis'\\]"):
        load_checkpoint(tmp_path / "ckpt")
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="index file .* is not valid JSON"):
        load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_is_named(tmp_path: Path, damage: str) -> None:
    save_checkpoint(synthetic_state(), CONFIG, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / SAFE_WEIGHTS_NAME
    data = file.read_bytes()
    file.write_bytes({"truncate": data[:-7], "garbage": b"\x07" * 64, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=f"{SAFE_WEIGHTS_NAME} is not a readable safetensors"):
        load_checkpoint(tmp_path / "ckpt")


def test_config_and_weights_errors(tmp_path: Path) -> None:
    save_checkpoint(synthetic_state(), CONFIG, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    config.write_text('{"model_type": ')
    with pytest.raises(CheckpointError, match="config file .*config.json is not valid JSON"):
        load_checkpoint(tmp_path / "ckpt")
    config.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_config(tmp_path / "ckpt")
    config.unlink()
    with pytest.raises(CheckpointError, match="config file .*config.json is missing"):
        load_checkpoint(tmp_path / "ckpt")
    config.write_text("{}")
    (tmp_path / "ckpt" / SAFE_WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_unknown_model_type_names_the_path(tmp_path: Path) -> None:
    pytest.importorskip("models.config")
    from models.checkpoint import load_config

    save_checkpoint({}, {"model_type": "no_such_family"}, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"ckpt/config.json: .*no_such_family"):
        load_config(tmp_path / "ckpt")


def test_overwrite_is_atomic_and_keeps_other_files(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    save_checkpoint(
        synthetic_state(), CONFIG, out, max_shard_bytes=300, extra_files={"note.txt": "hi"}
    )
    (out / "tokenizer.json").write_text("{}")
    new = {"w": torch.arange(4.0)}
    save_checkpoint(new, {"model_type": "v2"}, out)
    assert checkpoint_files(out) == ["config.json", SAFE_WEIGHTS_NAME]  # stale shards gone
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "note.txt").read_text() == "hi"
    assert_same(load_checkpoint(out)[1], new)
    # a failure half way leaves the old checkpoint whole and no temporary directory behind
    with pytest.raises(ValueError, match="content must be"):
        save_checkpoint(synthetic_state(), CONFIG, out, extra_files={"bad.bin": 3})  # type: ignore[dict-item]
    assert_same(load_checkpoint(out)[1], new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_extra_files(tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    src.write_bytes(b"copied")
    extras = {"gen.json": {"b": 1, "a": 2}, "t.txt": "text", "raw.bin": b"\x00\x01", "c.txt": src}
    out = save_checkpoint({}, CONFIG, tmp_path / "ckpt", extra_files=extras)
    assert (out / "gen.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
    assert (out / "t.txt").read_text() == "text"
    assert (out / "raw.bin").read_bytes() == b"\x00\x01"
    assert (out / "c.txt").read_bytes() == b"copied"
    for bad in ["../x", "config.json", "model-00001-of-00002.safetensors", ""]:
        with pytest.raises(ValueError, match="extra file"):
            save_checkpoint({}, CONFIG, tmp_path / "bad", extra_files={bad: "x"})
    with pytest.raises(ValueError, match="dense tensors.*'x'"):
        save_checkpoint({"x": [1, 2]}, CONFIG, tmp_path / "bad")  # type: ignore[dict-item]


FAMILIES = ["huginn", "ouro", "nanbeige", "llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_round_trip_same_logits(tmp_path: Path, family: str) -> None:
    pytest.importorskip("models.reference")
    from models.checkpoint import load_model
    from models.config import tiny_config
    from models.reference import build_model
    from models.ties import tied_from_module

    config = tiny_config(family)
    model = build_model(config, seed=0)
    tied = tied_from_module(model)
    if family == "huginn":  # the official tie, stored once under the embedding's name
        assert tied == {"lm_head.weight": "transformer.wte.weight"}
    save_checkpoint(model.state_dict(), config.to_hf_dict(), tmp_path / family, tied=tied)
    _, state = load_checkpoint(tmp_path / family, tied=tied)
    assert_same(dict(model.state_dict()), state)
    loaded_config, loaded = load_model(tmp_path / family, seed=1)
    assert loaded_config == config
    for target, source in tied.items():  # e.g. Huginn's lm_head stays its embedding
        assert loaded.get_parameter(target) is loaded.get_parameter(source)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 4]])
    with torch.no_grad():
        want = model(ids, latent_seeds=[11])
        got = loaded(ids, latent_seeds=[11])
    assert torch.equal(got, want)
