"""The long mixed-depth examples (configs/depth_mix_long.yaml, generator.depth_mix --queries 16;
configs/depth_mix_pairs.yaml, the same with --answer pairs): their committed data is what
`python -m generator.depth_mix DIR --queries 16 [--answer pairs]` writes, every row asking each
class in the stated share; each config names the partial-credit reward and its class column,
and the prompts and completions fit its budgets exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from generator.depth_mix import main
from generator.rewards import resolve_reward
from models.random_init import init_checkpoint
from pipeline.config.run import load_config
from pipeline.core.tasks import dataset_prompts

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {  # config: (the command's extra flags, the answer's characters, right answer, task)
    "depth_mix_long.yaml": ([], 16, "4719", {"answer": "4719", "hops": "1221"}),
    "depth_mix_pairs.yaml": (["--answer", "pairs"], 63, "A=4,B=7,B=1,C=9",
                             {"answer": "A=4,B=7,B=1,C=9", "hops": "1221"}),
}  # fmt: skip


@pytest.mark.parametrize("name", EXAMPLES)
def test_committed_data_is_what_the_command_writes(tmp_path: Path, name: str) -> None:
    flags, chars, _, _ = EXAMPLES[name]
    data = REPO / load_config(REPO / "configs" / name).task.path
    assert main([str(tmp_path), "--queries", "16", *flags]) == 0
    for split, n in (("train", 4000), ("test", 200)):
        committed = (data / f"{split}.jsonl").read_text()
        assert committed == (tmp_path / f"{split}.jsonl").read_text()
        rows = [json.loads(x) for x in committed.splitlines()]
        assert len(rows) == n
        assert all(len(r["answer"]) == chars and sorted(r["hops"]) == ["1"] * 8 + ["2"] * 8
                   for r in rows)  # fmt: skip


@pytest.mark.parametrize("name", EXAMPLES)
def test_config_wires_the_task(tmp_path: Path, name: str) -> None:
    _, chars, right, task = EXAMPLES[name]
    cfg = load_config(REPO / "configs" / name)
    assert cfg.task.metadata_columns == ["hops"] and cfg.eval.depths == [1, 2, 3, 4]
    assert cfg.rollout.max_tokens == chars + 1  # the answer (one token a character) + EOS
    fn = resolve_reward(cfg.task.reward)
    assert fn(right, [], task)[0] == 1.0 and fn(right[:-1] + "0", [], task)[0] == 0.75
    tiny = init_checkpoint(cfg.model.family, cfg.model.size, tmp_path / "m")
    cfg = load_config(REPO / "configs" / name, [f"task.path={REPO / cfg.task.path}"])
    for split in ("train", "test"):
        prompts, _ = dataset_prompts(cfg.task, tiny, 10_000, split=split)
        assert len(prompts) == {"train": 4000, "test": 200}[split]
        assert {len(p.tokens) for p in prompts} == {49}  # BOS + 8 x "X=Y" + 7 "," + "?" + 16
        assert all(len(str(p.task["hops"])) == 16 for p in prompts)
        assert 49 + cfg.rollout.max_tokens == cfg.generators.max_model_len
