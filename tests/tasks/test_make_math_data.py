"""The GSM8K-format data generator (pipeline/commands/make_math_data.py): deterministic bytes, test
questions disjoint from train, gold solutions the math reward accepts, easy answers 0..9,
and the committed example data is what the generator writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from generator.math_reward import hash_answer, math
from pipeline.commands.make_math_data import main, make_dataset, make_rows
from pipeline.core.tasks import read_split

REPO = Path(__file__).resolve().parents[2]


def test_deterministic_disjoint_and_verifiable(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", train=300, test=50)
    b = make_dataset(tmp_path / "b", train=300, test=50)
    assert a["train"].read_bytes() == b["train"].read_bytes()
    assert a["test"].read_bytes() == b["test"].read_bytes()
    train = [json.loads(x) for x in a["train"].read_text().splitlines()]
    test = [json.loads(x) for x in a["test"].read_text().splitlines()]
    assert (len(train), len(test)) == (300, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in train}) == 300
    for r in train + test:
        final = hash_answer(r["answer"])
        assert final is not None and 0 <= int(final) <= 9 and r["level"] == "easy"
        assert math(f"#### {final}", [], {"answer": r["answer"]})[0] == 1.0
        assert math(f"#### {int(final) + 1}", [], {"answer": r["answer"]})[0] == 0.0
    assert {r["op"] for r in train} == {"add", "sub", "mul"}


def test_medium_level_and_parquet(tmp_path: Path) -> None:
    paths = make_dataset(tmp_path, train=40, test=10, level="medium", fmt="parquet")
    ds = read_split(str(tmp_path), "train")
    assert len(ds) == 40 and paths["train"].suffix == ".parquet"
    finals = [int(hash_answer(a) or -1) for a in ds["answer"]]
    assert all(0 <= f <= 99 for f in finals) and max(finals) > 9
    assert all(a.count("\n") == 2 for a in ds["answer"])  # two steps, then the answer


def test_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="level 'hard' must be one of"):
        make_rows(3, "hard", 0, "train")
    with pytest.raises(ValueError, match="fewer than 100000 distinct"):
        make_rows(100_000, "easy", 0, "train")
    assert main([str(tmp_path), "--train", "100000"]) == 2
    assert "distinct new questions" in capsys.readouterr().err


def test_committed_example_data_is_what_the_generator_writes(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    for split in ("train", "test"):
        committed = REPO / "configs" / "data" / "math" / f"{split}.jsonl"
        assert committed.read_bytes() == (tmp_path / f"{split}.jsonl").read_bytes()
