"""The run's auto keys (pipeline.config.device): today's CPU values on a CPU host; bf16,
compiled blocks, packed rows from the free memory, the torch engine with the cache the learner
leaves and /dev/shm weights on a CUDA host; a set key kept; the choice recorded in config.yaml;
the standalone generator's own choice. The CUDA host is a ``Host`` value (no GPU here: the
arithmetic is what is tested; the device check runs scripts/gpu_check.sh)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from generator.config import GeneratorConfig, for_this_host
from learner.config import LearnerConfig, LoraConfig
from models.cost import GIB, Host, LoopShape
from models.errors import ConfigError
from models.random_init import model_config
from pipeline.config import device as device_defaults
from pipeline.config.run import RunConfig, load_config, to_yaml
from pipeline.config.sections import ModelSection

H100 = Host(True, "NVIDIA H100 80GB HBM3", int(79 * GIB), int(80 * GIB))


def on(host: Host, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> RunConfig:
    monkeypatch.setattr(device_defaults.Host, "here", classmethod(lambda cls: host))
    monkeypatch.setattr(device_defaults, "megatron_available", lambda: True)
    return RunConfig(**kw)


def test_a_cpu_host_keeps_todays_defaults() -> None:
    cfg = RunConfig()  # this host has no CUDA
    assert cfg.learner.precision == "fp32" and cfg.learner.compile is False
    assert cfg.learner.max_tokens_per_micro == 0
    assert cfg.generators.engine == "vllm" and cfg.generators.kv_cache_mb == 64
    assert cfg.publish.transport == "shared_fs" and cfg.generators.max_inflight == 16
    assert cfg.generators.inflight_updates is False and cfg.generators.decode_chunk == 1
    assert cfg.generators.mps is False and cfg.warm_start.device == "cpu"
    assert len(cfg.device_choices) == 13 and all("a CPU host" in x for x in cfg.device_choices)
    assert device_defaults.summary(cfg.device_choices) is None  # nothing new to print on a CPU


def test_a_cuda_host_gets_the_gpu_path_sized_from_its_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = on(H100, monkeypatch, model=ModelSection(size="1b"))
    lr, gens = cfg.learner, cfg.generators
    assert lr.precision == "bf16" and lr.compile is True
    shape = LoopShape.of(model_config("huginn", "1b"))
    per = device_defaults.token_bytes(shape, 8)
    # a third of the free memory for one micro-batch's activations, a multiple of 1024
    assert lr.max_tokens_per_micro % 1024 == 0
    assert lr.max_tokens_per_micro == int(79 * GIB / 3 / per) // 1024 * 1024
    assert 8192 <= lr.max_tokens_per_micro <= 65536
    # the generator's cache: 0.8 of what the learner's plan leaves, less its bf16 weights and
    # 1 GiB of its own
    # (cuda_ipc's two slots on the learner's card, the copy each generator serves from)
    learner = device_defaults.learner_gib(shape, lr.max_tokens_per_micro, 8, weight_copies=2)
    assert 10 < learner < 60
    expect = (0.8 * (79 - learner) - 2 * 2 * shape.params() / GIB - 1) * 1024
    assert gens.kv_cache_mb == pytest.approx(expect, abs=256) and gens.kv_cache_mb % 256 == 0
    assert gens.engine == "torch" and cfg.publish.transport == "cuda_ipc"
    assert gens.inflight_updates is True  # a version swapped in between decode steps
    assert gens.decode_chunk == 8  # 8 tokens a graph replay at the fixed full depth
    assert cfg.warm_start.device == "cuda"  # `looprl run`'s warm start on the card
    # a whole step's prompts, and the next one's (max_staleness 1), held by the one generator
    assert gens.max_inflight == cfg.rollout.prompts_per_step * 2
    assert cfg.device_choices[0] == f"host: {H100.describe()}"
    line = device_defaults.summary(cfg.device_choices)
    assert line is not None and line.startswith("auto keys on NVIDIA H100 80GB HBM3 (79 of 80 GiB")
    assert "learner.precision=bf16" in line and "publish.transport=cuda_ipc" in line
    assert "generators.inflight_updates=True" in line


def test_mps_is_chosen_where_generator_processes_share_the_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """generators.mps auto: on for generator processes beside a GPU learner where the MPS
    control daemon is on PATH; off (with the reason) without it, with generator threads, with
    no local generator, on a CPU host; a share of the SMs is refused where MPS is off."""
    import shutil

    from models.errors import ConfigError
    from pipeline.config.sections import GeneratorsSection

    have = {"nvidia-cuda-mps-control": "/usr/bin/nvidia-cuda-mps-control"}
    monkeypatch.setattr(shutil, "which", lambda name: have.get(name))
    cfg = on(H100, monkeypatch, model=ModelSection(size="1b"))
    assert cfg.generators.mps is True
    assert any(c.startswith("generators.mps=True: NVIDIA H100") for c in cfg.device_choices)
    for gens, why in [(GeneratorsSection(placement="thread"), "placement=thread"),
                      (GeneratorsSection(count=0), "no local generator")]:  # fmt: skip
        cfg = on(H100, monkeypatch, model=ModelSection(size="1b"), generators=gens)
        assert cfg.generators.mps is False
        assert any(c.startswith("generators.mps=False") and why in c for c in cfg.device_choices)
    have.clear()
    cfg = on(H100, monkeypatch, model=ModelSection(size="1b"))
    assert cfg.generators.mps is False
    assert any("nvidia-cuda-mps-control is not on PATH" in c for c in cfg.device_choices)
    with pytest.raises(ConfigError, match=r"generators.mps_percent=40: a share of the SMs under "
                                          r"MPS; generators.mps is false"):  # fmt: skip
        on(H100, monkeypatch, model=ModelSection(size="1b"),
           generators=GeneratorsSection(mps_percent=40))  # fmt: skip


def test_adapters_and_the_device_copies_are_in_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """learner.lora: the frozen base in bf16 and the adapters' states, not 18 bytes a weight;
    cuda_ipc's copies on both sides. Huginn-0125 on an H100 with LoRA leaves a cache; the
    adapter count is an upper estimate of the real one (12,288,000 factor elements at rank 16
    on the default targets: docs/LEARNER.md "LoRA", benchmarks/adapter_bytes.py)."""
    shape = LoopShape.of(model_config("huginn", "0125"))
    assert 12_288_000 <= device_defaults.lora_params(shape, 16) <= 1.25 * 12_288_000
    full = device_defaults.learner_gib(shape, 4096, 8)
    lora = device_defaults.learner_gib(shape, 4096, 8, lora_rank=16)
    # ~14 bytes a frozen weight fewer: 18 against the bf16 base and the bf16 merged weights
    # the forward keeps for the backward, less the merge's fp64 temporary (one weight)
    assert 13.5 * shape.params() / GIB < full - lora < 14 * shape.params() / GIB
    with_slots = device_defaults.learner_gib(shape, 4096, 8, lora_rank=16, weight_copies=2)
    assert with_slots - lora == pytest.approx(4 * shape.params() / GIB)
    cfg = on(H100, monkeypatch, model=ModelSection(size="0125"),
             learner=LearnerConfig(lora=LoraConfig(rank=16)))  # fmt: skip
    assert cfg.publish.transport == "cuda_ipc" and cfg.publish.directories == "when_free"
    # room for a cache beside the LoRA learner (2,560 MiB with merged versions' two slots; an
    # H100 run of this plan before the merged weights were counted ran out of memory)
    assert cfg.generators.kv_cache_mb >= 2048
    # adapter versions on the device keep one copy, the base, where merged ones keep 2 slots:
    # the generator's cache gets the other copy (0.8 of it, its share of what is left)
    ad = on(H100, monkeypatch, model=ModelSection(size="0125"),
            learner=LearnerConfig(lora=LoraConfig(rank=16, publish="adapters")))  # fmt: skip
    assert ad.publish.directories == "when_free"
    assert ad.generators.kv_cache_mb >= 6144  # 7,936 MiB
    gain = (ad.generators.kv_cache_mb - cfg.generators.kv_cache_mb) * 2**20
    assert gain == pytest.approx(0.8 * 2 * shape.params(), rel=0.02, abs=256 * 2**20)
    full_ft = on(H100, monkeypatch, model=ModelSection(size="0125"))
    assert full_ft.generators.kv_cache_mb == 256  # a full 0125 learner leaves an H100 nothing


def test_a_set_key_is_kept_and_exact_numerics_stay_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["learner.precision=fp32", "generators.kv_cache_mb=1024",
                             "publish.transport=zmq"])  # fmt: skip
    assert (cfg.learner.precision, cfg.generators.kv_cache_mb) == ("fp32", 1024)
    monkeypatch.setattr(device_defaults.Host, "here", classmethod(lambda cls: H100))
    monkeypatch.setattr(device_defaults, "megatron_available", lambda: True)
    cfg = load_config(None, ["learner.precision=fp32", "generators.kv_cache_mb=1024",
                             "publish.transport=zmq", "model.size=1b"])  # fmt: skip
    assert cfg.learner.precision == "fp32" and cfg.learner.compile is True
    assert cfg.generators.kv_cache_mb == 1024 and cfg.publish.transport == "zmq"
    exact = load_config(None, ["numerics=exact", "model.size=1b"])
    assert exact.learner.precision == "fp32" and exact.learner.compile is False
    assert exact.learner.max_tokens_per_micro == 0
    # per-loop credit's forward packs too; a micro_batch_size set keeps padded rows
    credit = load_config(None, ["objective.loop_weighting=uniform", "model.size=1b"])
    assert credit.learner.max_tokens_per_micro > 0 and credit.learner.precision == "bf16"
    rows = load_config(None, ["learner.micro_batch_size=4", "model.size=1b"])
    assert rows.learner.max_tokens_per_micro == 0
    # backend reference implements none of them
    ref = load_config(None, ["backend=reference", "model.size=1b"])
    assert ref.learner.precision == "fp32" and ref.learner.compile is False
    assert ref.publish.transport == "shm"  # its weights are on the host: no device buffer
    # the tick decode swaps between batches only; a set value is kept
    ticks = load_config(None, ["generators.depth_ticks=2", "model.size=1b"])
    assert ticks.generators.inflight_updates is False and ticks.generators.decode_chunk == 1
    sampled = load_config(None, ["rollout.exit_policy={kind: sampled_gate}", "model.family=ouro",
                                 "model.size=400m"])  # fmt: skip
    assert sampled.generators.decode_chunk == 1  # an exit policy: not one fixed depth
    assert sampled.learner.max_tokens_per_micro > 0  # the sampled exit's forward packs
    one = load_config(None, ["generators.decode_chunk=1", "model.size=1b"])
    assert one.generators.decode_chunk == 1
    off = load_config(None, ["generators.inflight_updates=false", "model.size=1b"])
    assert off.generators.inflight_updates is False
    here = load_config(None, ["warm_start.device=cpu", "model.size=1b"])
    assert here.warm_start.device == "cpu"  # a warm start kept on the host's CPU
    assert load_config(None, ["warm_start.device=cuda:1"]).warm_start.device == "cuda:1"
    with pytest.raises(ConfigError, match="warm_start.device.*auto, cpu, cuda or cuda:N"):
        load_config(None, ["warm_start.device=gpu"])


def test_the_choice_is_recorded_for_replay(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    cfg = on(H100, monkeypatch, model=ModelSection(size="1b"))
    text = to_yaml(cfg)
    doc = yaml.safe_load(text)
    recorded = {**{f"learner.{k}": doc["learner"][k]
                   for k in ("precision", "compile", "max_tokens_per_micro")},
                **{f"generators.{k}": doc["generators"][k]
                   for k in ("engine", "kv_cache_mb", "max_inflight", "inflight_updates",
                             "decode_chunk")},
                "publish.transport": doc["publish"]["transport"]}  # fmt: skip
    assert "auto" not in recorded.values(), recorded  # the chosen values, not "auto"
    assert recorded["learner.precision"] == "bf16" and recorded["publish.transport"] == "cuda_ipc"
    assert recorded["generators.inflight_updates"] is True
    assert doc["warm_start"]["device"] == "cuda"
    monkeypatch.undo()  # replayed on a CPU host: the recorded values, not the CPU's
    path = tmp_path / "config.yaml"
    path.write_text(text)
    again = load_config(path, [])
    assert again.learner == cfg.learner and again.generators == cfg.generators
    assert again.publish == cfg.publish and again.device_choices == []
    assert again.warm_start == cfg.warm_start


def test_a_standalone_generator_chooses_for_its_own_host(tmp_path: Any) -> None:
    cfg, why = for_this_host(GeneratorConfig())
    assert (cfg.engine, cfg.kv_cache_mb, cfg.max_inflight) == ("vllm", 64, 16) and len(why) == 5
    assert cfg.inflight_updates is False and cfg.decode_chunk == 1
    from models.random_init import init_checkpoint

    model = init_checkpoint("huginn", "tiny", tmp_path / "m", seed=0)
    gpu, why = for_this_host(GeneratorConfig(model=str(model)), H100)
    assert gpu.engine == "torch" and gpu.held_items == 64 and gpu.inflight_updates is True
    assert gpu.decode_chunk == 8
    assert gpu.kv_cache_mb == pytest.approx(0.8 * 79 * 1024, abs=256) and gpu.kv_cache_mb % 256 == 0
    kept, why = for_this_host(GeneratorConfig(engine="vllm", kv_cache_mb=100, max_inflight=4,
                                              inflight_updates=False, decode_chunk=1),
                              H100)  # fmt: skip
    assert (kept.engine, kept.kv_cache_mb, why) == ("vllm", 100, [])
    with pytest.raises(ValueError, match="kv_cache_mb=auto was not resolved"):
        _ = GeneratorConfig().kv_cache_bytes
