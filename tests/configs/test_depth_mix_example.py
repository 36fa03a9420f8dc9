"""The mixed-depth example (configs/depth_mix.yaml, generator.depth_mix): its committed data is
what `python -m generator.depth_mix configs/data/depth_mix` writes, in the stated classes; the
config names the task's reward and class column, and the prompts fit its budgets."""

from __future__ import annotations

import json
from pathlib import Path

from generator.depth_mix import main
from generator.rewards import resolve_reward
from models.random_init import init_checkpoint
from pipeline.config.run import load_config
from pipeline.core.tasks import dataset_prompts

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "depth_mix.yaml"


def test_committed_data_is_what_the_command_writes(tmp_path: Path) -> None:
    data = REPO / load_config(CONFIG).task.path
    assert main([str(tmp_path)]) == 0
    for split, n in (("train", 4000), ("test", 200)):
        committed = (data / f"{split}.jsonl").read_text()
        assert committed == (tmp_path / f"{split}.jsonl").read_text()
        rows = [json.loads(x) for x in committed.splitlines()]
        assert len(rows) == n and {h: sum(r["hops"] == h for r in rows) for h in (1, 2)} == {
            1: n // 2, 2: n // 2}  # fmt: skip


def test_config_wires_the_task(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert cfg.task.metadata_columns == ["hops"] and cfg.eval.depths == [1, 2, 3, 4]
    fn = resolve_reward(cfg.task.reward)
    assert fn("4", [], {"answer": "4"})[0] == 1.0
    tiny = init_checkpoint(cfg.model.family, cfg.model.size, tmp_path / "m")
    cfg = load_config(CONFIG, [f"task.path={REPO / cfg.task.path}"])
    for split in ("train", "test"):
        prompts, _ = dataset_prompts(cfg.task, tiny, 10_000, split=split)
        assert len(prompts) == {"train": 4000, "test": 200}[split]
        assert {p.task["hops"] for p in prompts} == {1, 2}
        longest = max(len(p.tokens) for p in prompts)
        assert longest + cfg.rollout.max_tokens <= cfg.generators.max_model_len, longest
