"""The automatic micro-batch (learner.micro_batch_size=0) bounds the tokens of one
forward/backward (pipeline.backends.learner_configs.MICRO_BATCH_TOKENS), not the group size:
the quickstart's update is one micro-batch (it was 16 of 8 rows), long rows get
fewer rows, and an explicit learner.micro_batch_size always wins. Config only: no model."""

from __future__ import annotations

import logging

import pytest

from pipeline.backends import learner_configs
from pipeline.backends.learner_configs import (
    MICRO_BATCH_TOKENS,
    micro_batch_size,
    row_tokens,
    train_config,
)
from pipeline.config.run import load_config


def test_quickstart_update_is_one_micro_batch() -> None:
    cfg = load_config(None, [])
    tc = train_config(cfg)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n, cfg.rollout.max_tokens) == (16, 8, 8)
    assert row_tokens(cfg) == 4 + 8  # bos + 3 shown symbols, 8 completion tokens
    assert tc.global_batch_size == 128
    assert tc.micro_batch_size == 128  # one forward/backward a step (the group size gave 8: 16)
    assert tc.grad_accum_steps(1) == 1


@pytest.mark.parametrize(
    ("over", "row_len", "mbs"),
    [
        (["rollout.max_tokens=1024"], 1028, 8),  # 16384 // 1028 = 15 rows -> 8 divides 128
        (["rollout.max_tokens=8192"], 8196, 1),  # 1 row of 8196
        (["rollout.max_tokens=100", "task.max_prompt_tokens=412"], 512, 32),
        (["rollout.max_tokens=20", "rollout.prompts_per_step=6", "rollout.n=5"], 24, 30),
        (["rollout.max_tokens=20", "objective.minibatches=4"], 24, 32),  # per update: 32
    ],
)
def test_automatic_micro_batch_is_bounded_by_tokens(
    over: list[str], row_len: int, mbs: int
) -> None:
    cfg = load_config(None, over)
    tc = train_config(cfg)
    assert row_tokens(cfg) == row_len
    assert tc.micro_batch_size == mbs
    assert tc.micro_batch_size * row_len <= MICRO_BATCH_TOKENS or tc.micro_batch_size == 1
    assert tc.global_batch_size % tc.micro_batch_size == 0


def test_explicit_micro_batch_wins_and_unknown_prompts_keep_the_group_rule(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(learner_configs, "_warned", set())  # other tests may have said it
    with caplog.at_level(logging.WARNING, "pipeline.backends.learner_configs"):
        assert train_config(load_config(None, ["learner.micro_batch_size=4"])).micro_batch_size == 4
        assert not caplog.records  # an explicit value: nothing to say
        # a jsonl task's prompts are not known from the config: group size (8), at most 16
        cfg = load_config(None, ["task.kind=jsonl", "task.path=/nonexistent.jsonl"])
        assert row_tokens(cfg) is None
        assert train_config(cfg).micro_batch_size == 8
        train_config(cfg)  # said once, not at every step
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "task.kind=jsonl" in said[0] and "task.max_prompt_tokens" in said[0]
    assert "8 of a rank's 128 rows" in said[0]
    assert micro_batch_size(128, 32, None) == 16
    assert micro_batch_size(12, 8, None) == 6  # the largest divisor at most the group size
    assert micro_batch_size(7, 8, 10_000) == 1  # always at least one row
