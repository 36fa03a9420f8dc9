"""The mixed-depth task (generator.depth_mix): its rows are a pure function of the seed, each
answer is the queried chain's root, the classes come in the stated proportions, the held-out
split shares no question with train, and the reward scores right, wrong and malformed
completions; `looprl eval --by hops` reports accuracy by class at each fixed depth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from generator.depth_mix import depth_mix_rows, main, parse_mix, reward, write_depth_mix


def _solve(prompt: str) -> tuple[str, int]:
    """The answer and the hops of a question, by following its assignments."""
    body, _, name = prompt.partition("?")
    env = dict(part.split("=") for part in body.split(","))
    assert len(env) == body.count(",") + 1  # every name assigned once
    hops = 1
    while not env[name].isdigit():
        name, hops = env[name], hops + 1
    return env[name], hops


def test_rows_are_a_pure_function_of_the_seed(tmp_path: Path) -> None:
    mix = {1: 0.5, 3: 0.5}
    assert depth_mix_rows(50, mix, 0, "train") == depth_mix_rows(50, mix, 0, "train")
    assert depth_mix_rows(50, mix, 0, "train") != depth_mix_rows(50, mix, 1, "train")
    assert depth_mix_rows(50, mix, 0, "train") != depth_mix_rows(50, mix, 0, "test")
    for out in ("a", "b"):
        assert main([str(tmp_path / out), "--train", "300", "--test", "40", "--seed", "7"]) == 0
    for split in ("train", "test"):
        a, b = ((tmp_path / d / f"{split}.jsonl").read_bytes() for d in ("a", "b"))
        assert a == b and len(a.splitlines()) == {"train": 300, "test": 40}[split]


@pytest.mark.parametrize(("n", "mix", "want"), [
    (200, "1:0.5,3:0.5", {1: 100, 3: 100}),
    (101, "1:0.3,2:0.3,4:0.4", {1: 30, 2: 30, 4: 41}),   # the last class takes the rest
])  # fmt: skip
def test_classes_in_stated_proportions_and_answers_right(tmp_path: Path, n: int, mix: str,
                                                         want: dict[int, int]) -> None:  # fmt: skip
    write_depth_mix(tmp_path, 2000, n, parse_mix(mix), 0)
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    counts = {h: sum(r["hops"] == h for r in test) for h in want}
    assert counts == want and len(test) == n
    assert sum(r["hops"] == min(want) for r in train) == round(2000 * parse_mix(mix)[min(want)])
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}  # held out
    assert len({r["prompt"] for r in train}) == 2000  # distinct
    longest = max(want)
    for r in train + test:
        answer, hops = _solve(r["prompt"])
        assert (answer, hops) == (r["answer"], r["hops"]), r
        # the distractor chain has the longest class's length: h + H assignments in all
        assert r["prompt"].count("=") == r["hops"] + longest
        # copying (hops 1): the prompt's one digit is the answer; tracking: two digits
        digits = [c for c in r["prompt"] if c.isdigit()]
        assert answer in digits and len(set(digits)) == len(digits) == (1 if hops == 1 else 2), r
    # the classes' answers are balanced enough that copying one digit cannot pass (<= 20%)
    for h in want:
        digits = [r["answer"] for r in train if r["hops"] == h]
        assert max(digits.count(d) for d in set(digits)) / len(digits) < 0.2


def test_reward_right_wrong_malformed() -> None:
    task = {"answer": "4", "hops": 3}
    for text in ("4", " 4", "4\n", "  4  "):
        assert reward(text, [], task) == (1.0, {"correct": True, "malformed": False}), text
    assert reward("5", [], task) == (0.0, {"correct": False, "malformed": False})
    for text in ("", " ", "44", "4 4", "x", "four", "4.", "\u0664", "-4"):
        assert reward(text, [], task) == (0.0, {"correct": False, "malformed": True}), text


def test_bad_mix_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("1:0.5", "1:0.5,3", "0:0.5,2:0.5", "a:1", "1:0.7,2:0.7"):
        assert main([str(tmp_path), "--mix", bad]) == 2, bad
        assert "error: --mix" in capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()
