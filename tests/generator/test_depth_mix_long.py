"""The mixed-depth task's long variant (generator.depth_mix --queries K): its rows are a pure
function of the seed, each answer digit is its query's chain root, every row asks each class
in the stated share, the single-query rows are untouched, and the reward gives partial credit,
scores one class on request and refuses malformed completions."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from generator.depth_mix import (
    CAPITALS,
    depth_mix_multi_row,
    depth_mix_rows,
    main,
    parse_mix,
    reward_multi,
    write_depth_mix,
)


def _solve(prompt: str) -> tuple[str, str]:
    """(answer digits, classes) of a long question, by following its assignments."""
    body, _, queries = prompt.partition("?")
    env = dict(part.split("=") for part in body.split(","))
    assert len(env) == body.count(",") + 1  # every name assigned once
    answer, classes = "", ""
    for name in queries:
        hops = 1
        while not env[name].isdigit():
            name, hops = env[name], hops + 1
        answer, classes = answer + env[name], classes + str(hops)
    return answer, classes


def test_rows_are_a_pure_function_of_the_seed(tmp_path: Path) -> None:
    mix = {1: 0.5, 2: 0.5}
    rows = depth_mix_rows(30, mix, 0, "train", queries=8)
    assert rows == depth_mix_rows(30, mix, 0, "train", queries=8)
    assert rows != depth_mix_rows(30, mix, 1, "train", queries=8)
    assert rows != depth_mix_rows(30, mix, 0, "test", queries=8)
    assert rows != depth_mix_rows(30, mix, 0, "train", queries=8, chains=3)
    for out in ("a", "b"):
        argv = [str(tmp_path / out), "--train", "300", "--test", "40", "--queries", "16"]
        assert main(argv) == 0
    for split in ("train", "test"):
        a, b = ((tmp_path / d / f"{split}.jsonl").read_bytes() for d in ("a", "b"))
        assert a == b and len(a.splitlines()) == {"train": 300, "test": 40}[split]


def test_single_query_rows_are_the_old_ones(tmp_path: Path) -> None:
    """--queries 1 (the default) writes the short task, whatever the long one gained."""
    assert main([str(tmp_path / "a"), "--train", "50", "--test", "10"]) == 0
    assert main([str(tmp_path / "b"), "--train", "50", "--test", "10", "--queries", "1"]) == 0
    for split in ("train", "test"):
        a, b = ((tmp_path / d / f"{split}.jsonl").read_text() for d in ("a", "b"))
        assert a == b and all(isinstance(json.loads(x)["hops"], int) for x in a.splitlines())


@pytest.mark.parametrize(("queries", "chains", "mix", "want"), [
    (16, 4, "1:0.5,2:0.5", {"1": 8, "2": 8}),
    (10, 3, "1:0.3,2:0.3,3:0.4", {"1": 3, "2": 3, "3": 4}),   # the last class takes the rest
])  # fmt: skip
def test_classes_by_share_and_answers_right(tmp_path: Path, queries: int, chains: int, mix: str,
                                            want: dict[str, int]) -> None:  # fmt: skip
    write_depth_mix(tmp_path, 500, 50, parse_mix(mix), 0, queries, chains)
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}  # held out
    assert len({r["prompt"] for r in train}) == 500  # distinct
    length = max(int(h) for h in want)
    for r in train + test:
        assert _solve(r["prompt"]) == (r["answer"], r["hops"]), r
        assert {h: r["hops"].count(h) for h in want} == want  # each row: exact shares
        body, _, asked = r["prompt"].partition("?")
        assert len(asked) == len(r["answer"]) == queries and set(asked) <= set(CAPITALS)
        assert r["prompt"].count("=") == chains * length  # every chain of the longest class
        digits = [c for c in body if c.isdigit()]
        assert len(digits) == len(set(digits)) == chains  # one distinct root a chain
    # which query is of which class is not fixed by its position
    for j in range(queries):
        assert len({r["hops"][j] for r in train}) == len(want)


def test_every_character_is_one_token_of_the_tiny_tokenizer() -> None:
    """Capital names never merge (models/tokenizer.py's BPE), so query j lies exactly K - 1
    positions before the one predicting answer digit j."""
    from tokenizers import Tokenizer

    from models.tokenizer import tokenizer_files

    tok = Tokenizer.from_str(tokenizer_files(512)["tokenizer.json"].decode())
    for r in depth_mix_rows(50, {1: 0.5, 2: 0.5}, 0, "test", queries=16):
        assert len(tok.encode(r["prompt"], add_special_tokens=False).ids) == len(r["prompt"])
        assert len(tok.encode(r["answer"], add_special_tokens=False).ids) == 16


def test_reward_partial_credit_one_class_and_malformed() -> None:
    task = {"answer": "4719", "hops": "1221"}
    assert reward_multi("4719", [], task) == (1.0, {"correct": True, "malformed": False,
                                                    "right": 4})  # fmt: skip
    assert reward_multi(" 4719\n", [], task)[0] == 1.0
    assert reward_multi("4710", [], task) == (0.75, {"correct": False, "malformed": False,
                                                     "right": 3})  # fmt: skip
    assert reward_multi("0000", [], task)[0] == 0.0
    for text in ("", "471", "47190", "47 19", "471x", "4719.", "\u0664719"):
        assert reward_multi(text, [], task) == (0.0, {"correct": False, "malformed": True,
                                                      "right": 0}), text  # fmt: skip
    # score_hops (task.reward_args): only that class's queries, positions 0 and 3 / 1 and 2
    one, two = {**task, "score_hops": 1}, {**task, "score_hops": 2}
    assert reward_multi("4000", [], one)[0] == 0.5 and reward_multi("4009", [], one)[0] == 1.0
    assert reward_multi("4009", [], one)[1]["correct"] and reward_multi("0710", [], two)[0] == 1.0
    with pytest.raises(ValueError, match="no query of that class"):
        reward_multi("4719", [], {**task, "score_hops": 3})
    with pytest.raises(ValueError, match="3 classes for the 4 answer digits"):
        reward_multi("4719", [], {**task, "hops": "122", "score_hops": 1})


def test_pairs_answer_the_same_questions_name_by_name() -> None:
    """--answer pairs: the digits variant's prompts and digits, each digit after its query's
    name ("A=4,B=7"): 4K - 1 characters, each one token of the tiny tokenizer."""
    from tokenizers import Tokenizer

    from models.tokenizer import tokenizer_files

    tok = Tokenizer.from_str(tokenizer_files(512)["tokenizer.json"].decode())
    mix = {1: 0.5, 2: 0.5}
    digits = depth_mix_rows(40, mix, 0, "test", queries=16)
    named = depth_mix_rows(40, mix, 0, "test", queries=16, answer="pairs")
    for d, r in zip(digits, named, strict=True):
        asked = r["prompt"].partition("?")[2]
        assert (r["prompt"], r["hops"]) == (d["prompt"], d["hops"])
        assert r["answer"] == ",".join(f"{q}={a}" for q, a in zip(asked, d["answer"]))
        assert len(tok.encode(r["answer"], add_special_tokens=False).ids) == len(r["answer"]) == 63
        assert reward_multi(r["answer"], [], r) == (1.0, {"correct": True, "malformed": False,
                                                         "right": 16})  # fmt: skip
    with pytest.raises(ValueError, match="needs the long variant"):
        depth_mix_rows(5, mix, 0, "test", answer="pairs")
    with pytest.raises(ValueError, match="expected one of digits, pairs"):
        depth_mix_rows(5, mix, 0, "test", queries=16, answer="names")


def test_pairs_reward_counts_a_digit_under_its_querys_name() -> None:
    task = {"answer": "A=4,B=7,B=7,C=9", "hops": "1221"}
    assert reward_multi(" A=4,B=7,B=7,C=9\n", [], task)[0] == 1.0
    assert reward_multi("A=4,B=7,B=7,C=0", [], task) == (0.75, {"correct": False,
                                                                "malformed": False, "right": 3})  # fmt: skip
    assert reward_multi("A=4,C=7,B=7,C=9", [], task)[0] == 0.75  # the right digit, a wrong name
    assert reward_multi("D=1,D=1,D=1,D=1", [], task) == (0.0, {"correct": False,
                                                               "malformed": False, "right": 0})  # fmt: skip
    for text in ("", "4779", "A=4,B=7,B=7", "A=4,B=7,B=7,C=9,", "A=4,B=7,B=7,C=99",
                 "A4,B=7,B=7,C=9", "a=4,B=7,B=7,C=9", "AB=4,B=7,B=7,C=9", "A=4,B=7,B=7,C==9",
                 "A=4;B=7,B=7,C=9", "A=4,B=7,B=7,C=x"):  # fmt: skip
        assert reward_multi(text, [], task) == (0.0, {"correct": False, "malformed": True,
                                                      "right": 0}), text  # fmt: skip
    # one class's queries: 1 at items 0 and 3, 2 at items 1 and 2
    assert reward_multi("A=4,B=0,B=0,C=9", [], {**task, "score_hops": 1}) == (
        1.0, {"correct": True, "malformed": False, "right": 2})  # fmt: skip
    assert reward_multi("A=4,B=0,B=7,C=9", [], {**task, "score_hops": 2})[0] == 0.5
    # a digits completion against a pairs answer (and the reverse) is malformed
    assert reward_multi("4779", [], {"answer": "4779", "hops": "1221"})[0] == 1.0
    assert reward_multi("A=4,B=7,B=7,C=9", [], {"answer": "4779", "hops": "1221"})[1]["malformed"]


def test_bad_settings_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, msg in (
        (["--chains", "3"], "only the long variant"),
        (["--queries", "0"], "must be >= 1"),
        (["--queries", "16", "--chains", "11"], "chains"),
        (["--queries", "16", "--chains", "9", "--mix", "1:0.25,3:0.75"], "distinct letters"),
        (["--queries", "4", "--mix", "1:0.9,2:0.1"], "leave a class none"),
    ):
        assert main([str(tmp_path), *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert not (tmp_path / "train.jsonl").exists()
    with pytest.raises(ValueError, match="query classes"):
        depth_mix_multi_row(random.Random(0), [1, 3], 4, 2)
