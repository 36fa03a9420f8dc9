"""Per-token weight versions: a rollout whose weights changed mid-completion
carries rollout.token_versions; build_batch lays them on the response positions and
objective.max_token_version_gap masks the tokens older than the gap out of the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batching import build_batch, mask_stale_tokens
from learner.objective_config import ObjectiveConfig
from models.errors import ConfigError
from proto.records import Rollout


def rollout(i: int, versions: list[int] | None, n: int = 5) -> Rollout:
    return Rollout(
        rollout_id=f"w0/{i}", work_id="w0", prompt_id="p0", sample_index=i, generator_id="g0",
        latent_seed=i, prompt_tokens=np.array([1, 2, 3][: 1 + i % 3], np.int32),
        tokens=np.arange(10, 10 + n, dtype=np.int32), logprobs=np.full(n, -1.0, np.float32),
        exit_depths=np.full(n, 2, np.uint8), weight_version=3 if versions is None else versions[0],
        token_versions=None if versions is None else np.array(versions, np.int64), reward=1.0,
    )  # fmt: skip


def test_token_versions_are_laid_on_the_response_and_old_ones_masked() -> None:
    rolls = [rollout(0, [1, 1, 2, 4, 5]), rollout(1, None), rollout(2, [5, 5, 5, 5, 5]),
             rollout(3, None, n=0)]  # fmt: skip
    batch = build_batch(rolls)
    assert batch.token_versions is not None
    for i, r in enumerate(rolls):
        p, t = int(batch.prompt_lens[i]), r.num_tokens
        resp = batch.token_versions[i, p - 1 : p - 1 + t].tolist()
        assert resp == ([3] * t if r.token_versions is None else r.token_versions.tolist())
        assert batch.token_versions[i][batch.mask[i] == 0].eq(0).all()  # 0 off the response
    live = int((batch.mask > 0).sum())
    before = batch.mask.clone()
    frac = mask_stale_tokens(batch, version=5, max_gap=2)  # older than 5 - 2 = 3: masked
    assert frac == pytest.approx(3 / live)  # row 0's versions 1, 1, 2
    gone = (before > 0) & (batch.mask == 0)
    assert gone[0].sum() == 3 and gone[1:].sum() == 0
    assert (batch.token_versions[gone] < 3).all()
    # rows cut into micro-batches keep their versions
    assert torch.equal(
        batch.rows(0, 2).token_versions, batch.token_versions[:2, : batch.rows(0, 2).length]
    )


def test_max_token_version_gap_is_checked() -> None:
    with pytest.raises(
        ConfigError, match="objective.max_token_version_gap=-1: must be null or >= 0"
    ):
        ObjectiveConfig(max_token_version_gap=-1)
    assert ObjectiveConfig(max_token_version_gap=0).max_token_version_gap == 0
