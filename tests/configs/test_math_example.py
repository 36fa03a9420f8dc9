"""The real-task example (configs/math.yaml, docs/TASKS.md): its committed data is what the
generator writes, balanced over the answers 0..9 with the answer in the question; every
value the example needs is stated in the YAML (not left to defaults that may move); a prompt
plus the warm start's target fits the generator's context and completion budget; and the
warm start (``looprl sft``, pipeline/commands/warm_start.py) trains on the reference answers and writes
a checkpoint that loads. Fast: no run, a few optimizer steps on a handful of rows."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from generator.math_reward import hash_answer, math
from models.chat import ChatRenderer, eos_token_ids
from models.random_init import init_checkpoint
from pipeline.commands.make_math_data import main as make_data
from pipeline.commands.warm_start import completion_tokens, sft_examples, warm_start
from pipeline.commands.warm_start import main as sft_main
from pipeline.config.run import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "math.yaml"


def _rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = load_config(CONFIG)
    out = tmp_path_factory.mktemp("init") / "m"
    return init_checkpoint(cfg.model.family, cfg.model.size, out, seed=cfg.model.init_seed)


def test_committed_data_is_the_copy_level(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    data = REPO / cfg.task.path
    assert make_data([str(tmp_path), "--level", "copy"]) == 0
    for split in ("train", "test"):
        assert (data / f"{split}.jsonl").read_bytes() == (tmp_path / f"{split}.jsonl").read_bytes()
    train, test = _rows(data / "train.jsonl"), _rows(data / "test.jsonl")
    assert (len(train), len(test)) == (1000, 100)
    for r in train + test:
        final = hash_answer(r["answer"])
        assert final is not None and final in r["prompt"].split() and r["level"] == "copy"
        assert math(f"#### {final}", [], {"answer": r["answer"]})[0] == 1.0
    counts = Counter(hash_answer(r["answer"]) for r in train)
    assert sorted(counts) == [str(d) for d in range(10)]
    assert min(counts.values()) >= 80  # balanced: a constant answer earns ~10%, no more


def test_example_states_what_it_needs() -> None:
    raw = yaml.safe_load(CONFIG.read_text())
    g, r, t = raw["generators"], raw["rollout"], raw["task"]
    assert {"max_inflight", "reward_mode", "max_model_len", "count"} <= set(g)
    assert g["reward_mode"] == "process"  # math-verify's time limit needs a main thread
    assert {"n", "max_tokens", "temperature", "prompts_per_step"} <= set(r)
    assert t["kind"] == "dataset" and t["reward"] == "math" and t["template"] == "auto"
    assert {"lr"} <= set(raw["optimizer"]) and raw["eval"]["every"] > 0
    cfg = load_config(CONFIG)
    assert cfg.eval.every < cfg.steps  # eval/accuracy at least twice (step 1 and the last)


def test_prompt_and_target_fit_the_budget(tiny: Path) -> None:
    cfg = load_config(CONFIG)
    examples = sft_examples(cfg, tiny)
    assert len(examples) == 1000
    eos = eos_token_ids(tiny)
    for prompt, target in examples:
        assert target[-1] in eos and len(target) <= cfg.rollout.max_tokens
        assert len(prompt) + cfg.rollout.max_tokens <= cfg.generators.max_model_len
    r = ChatRenderer.from_checkpoint(tiny)
    ids = completion_tokens(r, "Mia has 7 pens. How many pens does Mia have?", "#### 7", eos)
    assert r.decode(ids) == " #### 7"  # what the template writes after "Assistant:"


def test_warm_start_lowers_the_loss_and_writes_a_checkpoint(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert make_data([str(data), "--level", "copy", "--train", "4", "--test", "2"]) == 0
    cfg = load_config(CONFIG, [f"task.path={data}"])
    out = tmp_path / "sft"
    stats = warm_start(cfg, tiny, out, steps=4, lr=3e-3, batch=4)
    assert stats["examples"] == 4 and stats["loss_last"] < stats["loss_first"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()
    assert (out / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert load_config(CONFIG, [f"model.path={out}"]).model.path == str(out)


def test_sft_cli_refuses_a_task_without_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert sft_main(["--out", "/nonexistent/never-written", "--model", "/nonexistent"]) == 2
    assert "needs a dataset task with an answer column" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA refuses it")
def test_sft_cli_device_defaults_to_the_configs(tiny: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Without --device, `looprl sft` trains where warm_start.device says; a CUDA device this
    host lacks is refused naming the flag or the key that asked for it (exit 2, nothing
    written)."""
    data = tmp_path / "data"
    assert make_data([str(data), "--level", "copy", "--train", "6", "--test", "2"]) == 0
    base = ["--config", str(CONFIG), "--model", str(tiny), "--steps", "1"]
    for extra, key in ((["warm_start.device=cuda"], "warm_start.device"), (["--device", "cuda:0"],
                       "--device")):  # fmt: skip
        assert sft_main([*base, "--out", str(tmp_path / "o"), *extra, f"task.path={data}"]) == 2
        assert f"{key}={'cuda' if key != '--device' else 'cuda:0'}: this host has no CUDA" in (
            capsys.readouterr().err)  # fmt: skip
        assert not (tmp_path / "o").exists()
    assert sft_main([*base, "--out", str(tmp_path / "o"), f"task.path={data}"]) == 0  # auto: cpu
    assert (tmp_path / "o" / "config.json").is_file()


def test_run_config_warm_start_is_the_chained_sft_calls(tiny: Path, tmp_path: Path) -> None:
    """warm_start.segments [2, 1] writes exactly what `looprl sft --steps 2 --seed 0` then
    `--steps 1 --seed 2` from its output write; bad settings name the key."""
    from models.checkpoint import load_checkpoint
    from models.errors import ConfigError
    from pipeline.commands.warm_start import warm_start_chain

    data = tmp_path / "data"
    assert make_data([str(data), "--level", "copy", "--train", "6", "--test", "2"]) == 0
    cfg = load_config(CONFIG, [f"task.path={data}", "warm_start.segments=[2,1]",
                               "warm_start.batch=3"])  # fmt: skip
    stats = warm_start_chain(cfg, tiny, tmp_path / "init")
    assert [s["steps"] for s in stats] == [2, 1]
    warm_start(cfg, tiny, tmp_path / "a", steps=2, batch=3, seed=0)
    warm_start(cfg, tmp_path / "a", tmp_path / "b", steps=1, batch=3, seed=2)
    x, y = load_checkpoint(tmp_path / "init")[1], load_checkpoint(tmp_path / "b")[1]
    assert x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)
    assert not list(tmp_path.glob(".init-warm-start*"))  # the intermediate segments are gone
    with pytest.raises(ConfigError, match="warm_start.segments.*needs task.kind=dataset"):
        load_config(None, ["warm_start.segments=[5]"])
    with pytest.raises(ConfigError, match="warm_start.segments.*>= 1 step"):
        load_config(CONFIG, ["warm_start.segments=[5,0]"])
    # warm_start.device: auto is this CPU host's cpu (above); a CUDA device it lacks is refused
    # by the key's name, before a step, in the run's chain and in `looprl sft` alike
    assert cfg.warm_start.device == "cpu"
    on_card = load_config(CONFIG, [f"task.path={data}", "warm_start.segments=[2]",
                                   "warm_start.device=cuda"])  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="warm_start.device=cuda: this host has no CUDA"):
            warm_start_chain(on_card, tiny, tmp_path / "init2")
        assert not (tmp_path / "init2").exists()
