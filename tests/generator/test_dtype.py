"""The generator's dtype follows the published weights: resolve_dtype's rule, the config's
refusal of bf16 under exact numerics, and the flag `looprl run` passes its generators."""

from __future__ import annotations

from pathlib import Path

import pytest

from generator.config import GeneratorConfig
from generator.engine import resolve_dtype
from models.errors import ConfigError
from pipeline.commands.launcher import generator_command
from pipeline.config.run import load_config


def test_auto_follows_the_checkpoint_on_gpu_and_is_fp32_on_cpu() -> None:
    bf16 = {"torch_dtype": "bfloat16"}
    assert resolve_dtype("auto", bf16, cpu=False, numerics="fast") == "bfloat16"
    assert resolve_dtype("auto", {}, cpu=False, numerics="fast") == "float32"
    assert resolve_dtype("auto", bf16, cpu=True, numerics="fast") == "float32"
    assert resolve_dtype("auto", bf16, cpu=False, numerics="exact") == "float32"
    assert resolve_dtype("bfloat16", {}, cpu=True, numerics="fast") == "bfloat16"
    with pytest.raises(ValueError, match="exact"):
        resolve_dtype("bfloat16", {}, cpu=False, numerics="exact")
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", {}, cpu=False, numerics="fast")


def test_generator_config_refuses_bf16_in_exact_numerics() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        GeneratorConfig(learner="tcp://127.0.0.1:1", model="m", numerics="exact", dtype="bfloat16")
    with pytest.raises(ConfigError, match="dtype"):
        GeneratorConfig(learner="tcp://127.0.0.1:1", model="m", dtype="fp8")


def test_looprl_run_passes_the_learner_precision_to_its_generators(tmp_path: Path) -> None:
    def dtype(*over: str) -> str:
        cmd = generator_command(
            load_config(None, list(over)), 0, "tcp://a:1", "tcp://a:2", tmp_path
        )
        return cmd[cmd.index("--dtype") + 1]

    assert dtype() == "auto"
    assert dtype("learner.precision=bf16", "backend=megatron") == "bfloat16"
    assert (
        dtype("generators.dtype=float32", "learner.precision=bf16", "backend=megatron") == "float32"
    )
