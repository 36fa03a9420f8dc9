"""The long mixed-depth example (configs/depth_mix_long.yaml, generator.depth_mix --queries
16): its committed data is what `python -m generator.depth_mix configs/data/depth_mix_long
--queries 16` writes, every row asking each class in the stated share; the config names the
partial-credit reward and its class column, and the prompts fit its budgets exactly."""

from __future__ import annotations

import json
from pathlib import Path

from generator.depth_mix import main
from generator.rewards import resolve_reward
from models.random_init import init_checkpoint
from pipeline.config.run import load_config
from pipeline.core.tasks import dataset_prompts

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "depth_mix_long.yaml"


def test_committed_data_is_what_the_command_writes(tmp_path: Path) -> None:
    data = REPO / load_config(CONFIG).task.path
    assert main([str(tmp_path), "--queries", "16"]) == 0
    for split, n in (("train", 4000), ("test", 200)):
        committed = (data / f"{split}.jsonl").read_text()
        assert committed == (tmp_path / f"{split}.jsonl").read_text()
        rows = [json.loads(x) for x in committed.splitlines()]
        assert len(rows) == n
        assert all(len(r["answer"]) == 16 and sorted(r["hops"]) == ["1"] * 8 + ["2"] * 8
                   for r in rows)  # fmt: skip


def test_config_wires_the_task(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert cfg.task.metadata_columns == ["hops"] and cfg.eval.depths == [1, 2, 3, 4]
    assert cfg.rollout.max_tokens == 17  # the 16 digits + EOS
    fn = resolve_reward(cfg.task.reward)
    task = {"answer": "4719", "hops": "1221"}
    assert fn("4719", [], task)[0] == 1.0 and fn("4710", [], task)[0] == 0.75
    tiny = init_checkpoint(cfg.model.family, cfg.model.size, tmp_path / "m")
    cfg = load_config(CONFIG, [f"task.path={REPO / cfg.task.path}"])
    for split in ("train", "test"):
        prompts, _ = dataset_prompts(cfg.task, tiny, 10_000, split=split)
        assert len(prompts) == {"train": 4000, "test": 200}[split]
        assert {len(p.tokens) for p in prompts} == {49}  # BOS + 8 x "X=Y" + 7 "," + "?" + 16
        assert all(len(str(p.task["hops"])) == 16 for p in prompts)
        assert 49 + cfg.rollout.max_tokens == cfg.generators.max_model_len
