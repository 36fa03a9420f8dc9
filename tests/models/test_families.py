"""Configs (round trips, strict errors), parameter names, and per-family semantics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import numerics as nx
from models.config import (
    HuginnConfig,
    OuroConfig,
    config_from_hf_dict,
    tiny_config,
)
from models.errors import ConfigError
from models.huginn import HuginnForCausalLM
from models.noise import latent_noise
from models.reference import build_model

FAMILIES = ["huginn", "ouro", "nanbeige", "llama"]
ARCH = {
    "huginn": "RavenForCausalLM",
    "ouro": "OuroForCausalLM",
    "nanbeige": "NanbeigeLoopedForCausalLM",
    "llama": "LlamaForCausalLM",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family: str) -> None:
    config = tiny_config(family)
    d = config.to_hf_dict()
    assert d["architectures"] == [ARCH[family]]
    again = config_from_hf_dict(d)
    assert again == config
    assert again.to_hf_dict() == d
    assert config.family == family
    assert config.hidden_size == 64 and config.head_dim == 32
    assert config.max_depth == {"huginn": 6, "ouro": 4, "nanbeige": 4, "llama": 1}[family]
    # bookkeeping keys survive
    d2 = dict(d, torch_dtype="bfloat16", transformers_version="4.55.0")
    assert config_from_hf_dict(d2).to_hf_dict()["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("family", FAMILIES)
def test_config_errors_name_the_field(family: str) -> None:
    d = tiny_config(family).to_hf_dict()
    with pytest.raises(ConfigError, match="unknown config field 'bogus_key'"):
        config_from_hf_dict(dict(d, bogus_key=1))
    size_key = "n_embd" if family == "huginn" else "hidden_size"
    with pytest.raises(ConfigError, match=f"'{size_key}' must be an integer, got '64'"):
        config_from_hf_dict(dict(d, **{size_key: "64"}))
    with pytest.raises(ConfigError, match=f"'{size_key}' is missing"):
        config_from_hf_dict({k: v for k, v in d.items() if k != size_key})
    with pytest.raises(ConfigError, match="must be a number"):
        config_from_hf_dict(dict(d, **{"norm_eps" if family == "huginn" else "rms_norm_eps": True}))


def test_unknown_model_type_lists_known() -> None:
    with pytest.raises(ConfigError, match="huginn_raven, llama, nanbeige_looped, ouro"):
        config_from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ConfigError):
        tiny_config("gpt2")


def test_semantic_config_errors() -> None:
    h = tiny_config("huginn").to_hf_dict()
    with pytest.raises(ConfigError, match="'n_layers' must be prelude \\+ core \\+ coda = 4"):
        HuginnConfig.from_hf_dict(dict(h, n_layers=5))
    with pytest.raises(ConfigError, match="'init_values' is derived"):
        HuginnConfig.from_hf_dict(dict(h, init_values={"std": 1.0}))
    with pytest.raises(ConfigError, match="'injection_type' must be one of"):
        HuginnConfig.from_hf_dict(dict(h, injection_type="add"))
    o = tiny_config("ouro").to_hf_dict()
    with pytest.raises(ConfigError, match="'num_key_value_heads' must divide"):
        OuroConfig.from_hf_dict(dict(o, num_attention_heads=2, num_key_value_heads=3, head_dim=32))
    with pytest.raises(ConfigError, match="'early_exit_threshold' must be in"):
        OuroConfig.from_hf_dict(dict(o, early_exit_threshold=1.5))
    with pytest.raises(ConfigError, match="'rope_scaling' must be null"):
        OuroConfig.from_hf_dict(dict(o, rope_scaling={"type": "yarn"}))
    with pytest.raises(ConfigError, match="'num_loops' is missing"):
        config_from_hf_dict(dict(tiny_config("llama").to_hf_dict(), model_type="nanbeige_looped"))


def test_official_huginn_keys_accepted() -> None:
    """The derived keys HF writes into Huginn's config.json parse when consistent."""
    d = tiny_config("huginn").to_hf_dict()
    std = math.sqrt(2 / (5 * 64))
    assert d["init_values"]["std"] == pytest.approx(std)
    assert d["init_values"]["embed_scale"] == 8.0
    assert d["effective_expected_depth"] == 1 + 1 + 2 * 6
    assert HuginnConfig.from_hf_dict(d).init_std == pytest.approx(std)


def test_official_ouro_keys_accepted() -> None:
    """A config.json as the official Ouro checkpoints write it (early_exit_step null, the
    official threshold and head_dim, sliding-window bookkeeping, HF keys) loads and round
    trips; early_exit_step is checked against total_ut_steps; an unknown key is still an error."""
    from models.config import OuroConfig

    d = dict(tiny_config("ouro").to_hf_dict())
    d.update({"early_exit_step": None, "early_exit_threshold": 1.0, "use_cache": True,
              "sliding_window": None, "max_window_layers": 24, "bos_token_id": 0,
              "eos_token_id": 0, "torch_dtype": "bfloat16", "transformers_version": "4.55.0",
              "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig"}})  # fmt: skip
    c = config_from_hf_dict(d)
    assert isinstance(c, OuroConfig) and c.early_exit_step is None
    assert config_from_hf_dict(c.to_hf_dict()) == c
    c2 = config_from_hf_dict(dict(d, early_exit_step=c.total_ut_steps - 1))
    assert c2.early_exit_step == c.total_ut_steps - 1 and c2.to_hf_dict()["early_exit_step"] == 3
    with pytest.raises(ConfigError, match="early_exit_step"):
        config_from_hf_dict(dict(d, early_exit_step=c.total_ut_steps))
    with pytest.raises(ConfigError, match="early_exit_stepp"):
        config_from_hf_dict(dict(d, early_exit_stepp=1))


def _layer_keys(prefix: str, names: list[str]) -> set[str]:
    return {f"{prefix}.{n}" for n in names}


def test_state_dict_names() -> None:
    huginn = build_model(tiny_config("huginn")).state_dict()
    block = [
        "norm_1.weight",
        "attn.Wqkv.weight",
        "attn.qk_bias",
        "attn.proj.weight",
        "norm_2.weight",
        "mlp.fc.weight",
        "mlp.proj.weight",
        "norm_3.weight",
        "norm_4.weight",
    ]
    expected = {"transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight"}
    expected |= {"lm_head.weight", "freqs_cis"}
    expected |= _layer_keys("transformer.prelude.0", block)
    expected |= _layer_keys("transformer.core_block.0", block)
    expected |= _layer_keys("transformer.core_block.1", block)
    expected |= _layer_keys("transformer.coda.0", block)
    assert set(huginn) == expected
    assert huginn["transformer.core_block.0.attn.Wqkv.weight"].shape == (192, 64)
    assert huginn["transformer.core_block.0.attn.qk_bias"].shape == (2, 1, 2, 32)
    assert huginn["transformer.adapter.weight"].shape == (64, 128)
    assert huginn["transformer.prelude.0.mlp.fc.weight"].shape == (256, 64)

    llama_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    base = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        base |= _layer_keys(f"model.layers.{i}", llama_layer)
    assert set(build_model(tiny_config("llama")).state_dict()) == base
    assert set(build_model(tiny_config("nanbeige")).state_dict()) == base
    ouro = set(build_model(tiny_config("ouro")).state_dict())
    extra = {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    for i in range(2):
        extra |= _layer_keys(
            f"model.layers.{i}", ["input_layernorm_2.weight", "post_attention_layernorm_2.weight"]
        )
    assert ouro == base | extra
    k = build_model(tiny_config("ouro")).state_dict()["model.layers.0.self_attn.k_proj.weight"]
    assert k.shape == (32, 64)  # GQA: 1 kv head of 32


def test_huginn_tied_embeddings_rope_buffer_and_scale() -> None:
    model = build_model(tiny_config("huginn"), seed=3)
    assert isinstance(model, HuginnForCausalLM)
    wte = model.transformer["wte"].weight
    assert model.lm_head.weight is wte
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    fc = sd["freqs_cis"]
    assert fc.dtype == torch.float32 and fc.shape == (1, 512, 1, 16, 2)
    assert torch.equal(fc[0, 0, 0, :, 0], torch.ones(16))  # cos(0)
    assert "freqs_cis" in dict(model.named_buffers())
    tokens = torch.tensor([3, 7, 500])
    assert torch.equal(model.embed(tokens), wte[tokens] * 8.0)  # sqrt(64) = 8
    bf = build_model(tiny_config("huginn"), dtype=torch.bfloat16)
    assert bf.freqs_cis.dtype == torch.float32 and bf.lm_head.weight.dtype == torch.bfloat16


def test_huginn_adapter_input_order_and_initial_state() -> None:
    model = build_model(tiny_config("huginn"), seed=1)
    state, e = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        eye, zero = torch.eye(64), torch.zeros(64, 64)
        model.transformer["adapter"].weight.copy_(torch.cat([eye, zero], dim=1))
        assert torch.equal(model.core_in(state, e, "exact"), state)  # state comes first
        model.transformer["adapter"].weight.copy_(torch.cat([zero, eye], dim=1))
        assert torch.equal(model.core_in(state, e, "exact"), e)
    pos = torch.tensor([0, 1, 9])
    s0 = model.initial_state(torch.zeros(3, 64), pos, [5, 5, 6])
    z = torch.cat([latent_noise(5, pos[:2], 64), latent_noise(6, pos[2:], 64)])
    std = math.sqrt(2 / 320)
    assert torch.equal(s0, (z * torch.tensor(std)) * 8.0)
    assert float(s0.abs().max()) <= 3 * std * 8.0 + 1e-6


def _official_huginn_logits(model: HuginnForCausalLM, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Independent re-statement of the official full-depth forward (plain torch, SDPA)."""
    c, tr = model.config, model.transformer

    def norm(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps)) * m.weight

    def block(b: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = F.linear(norm(b.norm_1, x), b.attn.Wqkv.weight).view(s, 3, 2, 32).unbind(1)
        q, k = q + b.attn.qk_bias[0, 0], k + b.attn.qk_bias[1, 0]
        fc = model.freqs_cis[0, :s]  # [s, 1, 16, 2]

        def rot(t: torch.Tensor) -> torch.Tensor:
            t2 = t.unflatten(-1, (-1, 2))
            re = t2[..., 0] * fc[..., 0] - t2[..., 1] * fc[..., 1]
            im = t2[..., 1] * fc[..., 0] + t2[..., 0] * fc[..., 1]
            return torch.stack([re, im], -1).flatten(-2)

        y = F.scaled_dot_product_attention(
            rot(q).transpose(0, 1), rot(k).transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = norm(b.norm_2, F.linear(y.transpose(0, 1).reshape(s, 64), b.attn.proj.weight) + x)
        g, u = F.linear(norm(b.norm_3, x), b.mlp.fc.weight).chunk(2, -1)
        return norm(b.norm_4, F.linear(F.silu(g) * u, b.mlp.proj.weight) + x)

    e = tr["wte"].weight[ids] * math.sqrt(64)
    for b in tr["prelude"]:
        e = block(b, e)
    x = latent_noise(seed, torch.arange(len(ids)), 64) * c.init_std * math.sqrt(64)
    for _ in range(c.mean_recurrence):
        x = F.linear(torch.cat([x, e], -1), tr["adapter"].weight)
        for b in tr["core_block"]:
            x = block(b, x)
    x = norm(tr["ln_f"], x)
    for b in tr["coda"]:
        x = block(b, x)
    return F.linear(norm(tr["ln_f"], x), model.lm_head.weight)


def test_huginn_matches_official_structure() -> None:
    model = build_model(tiny_config("huginn"), seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial norms and biases
            if "norm" in name or "ln_f" in name or "qk_bias" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        ids = torch.tensor([5, 9, 100, 3, 77, 1])
        ours = model(ids[None], latent_seeds=[42])[0]
        ref = _official_huginn_logits(model, ids, 42)
    assert float((ours - ref).abs().max()) < 2e-4


def test_ouro_layer_is_sandwich_and_state_is_normed() -> None:
    model = build_model(tiny_config("ouro"), seed=4)
    x = torch.randn(3, 64)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm_2.weight.mul_(0.0)  # zero the attention branch's outer norm
        layer.post_attention_layernorm_2.weight.mul_(0.0)
        q, k, v = layer.qkv(x, model.rope(torch.arange(3), "exact"), "exact")
        attn = nx.attention(q[None], k[None], v[None], torch.ones(1, 3, 3, dtype=torch.bool).tril())
        assert torch.equal(layer.post(x, attn[0], "exact"), x)  # both branches gated by norm_2
        s = model.core_out(torch.randn(4, 64) * 5, "exact")
    assert torch.allclose(s.pow(2).mean(-1), torch.ones(4), atol=1e-4)
    assert model.gate_logit(s, "fast").shape == (4,)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_modes_agree_and_init_is_deterministic(family: str) -> None:
    config = tiny_config(family)
    a, b = build_model(config, seed=5), build_model(config, seed=5)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), na
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        fast, exact = a(ids, numerics="fast"), a(ids, numerics="exact")
    assert fast.shape == (1, 6, 512)
    assert float((fast - exact).abs().max()) < 1e-3
    assert not torch.equal(build_model(config, seed=6).state_dict()["lm_head.weight"],
                           a.state_dict()["lm_head.weight"])  # fmt: skip
