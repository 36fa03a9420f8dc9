"""`looprl replay`: a recorded run trained again from its stream reaches the same weights.

test_replay_fake_free: a live run (real learner, megatron or reference backend, one real
generator process, 3 steps; the default objective, or OBJECTIVE_VALUES below), then
replay from its stream: every published version's canonical digest equals the live one, with
the learner's torch threads (learner.threads, pinned or auto) recorded by the live run and set
again by replay. (The 120-step quickstart replays identically too:
docs/PIPELINE.md.)
test_replay_errors: what replay refuses (a step log naming rollouts the stream lacks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from learner.threads import resolve_threads, set_threads
from models.errors import ConfigError
from pipeline.commands.learner_main import resolve_config
from pipeline.commands.replay_main import replay
from tests.pipeline.e2e_utils import check_run, run, small_config

# Objective values of the verl / AReaL / TRL parity issue, together: RLOO advantages (Bessel
# whitening), GSPO sequence ratios, the length-normalised sequence aggregation, geometric-mean
# rollout correction with a lower bound, a veto and rejected tokens out of the denominator, the
# reference KL as a per-token reward penalty from the proximal log-probs, the token-version gap.
OBJECTIVE_VALUES = [
    "objective.advantage_estimator=rloo", "objective.whiten=true", "objective.whiten_std=bessel",
    "objective.ratio_level=sequence", "objective.aggregation=seq_mean_token_sum_norm",
    "objective.loss_scale_length=8", "objective.is_cap=2.0", "objective.is_level=geometric",
    "objective.is_cap_low=0.5", "objective.is_veto=1e-4",
    "objective.is_rejected_in_denominator=false", "objective.kl_coef=0.01",
    "objective.kl_in_reward=true", "objective.kl_in_reward_level=token",
    "objective.kl_in_reward_logp=proximal", "objective.max_token_version_gap=1",
]  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("objective", ["defaults", "parity_values"])
@pytest.mark.parametrize("backend", ["megatron", "reference"])
def test_replay_fake_free(tmp_path: Path, backend: str, objective: str) -> None:
    """parity_values: the new objective values run through the real learner and generator in
    both learner policies, and replay reaches the same weights."""
    live = tmp_path / "live"
    values = OBJECTIVE_VALUES if objective == "parity_values" else []
    # learner.threads: a pinned count (reference, defaults) or auto, resolved and recorded
    pinned = backend == "reference" and objective == "defaults"
    threads = ["learner.threads=1"] if pinned else []
    cfg = small_config(live, "steps=3", "generators.count=1", "staleness.max_staleness=1",
                       f"backend={backend}", *values, *threads)  # fmt: skip
    s = run(cfg)
    check_run(live, 4, 3, max_staleness=1)
    recorded = resolve_config(None, str(live), []).learner.threads
    assert recorded == (1 if pinned else resolve_threads("auto"))  # a number, not auto
    before = torch.get_num_threads()
    set_threads(2 if recorded == 1 else 1)  # replay must set the recorded count
    try:
        res = replay(live / "stream", tmp_path / "replay")
        assert torch.get_num_threads() == recorded
    finally:
        set_threads(before)
    assert sorted(res, key=int) == ["1", "2", "3"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
    assert res["3"][1] == s["final_digest"]
    if backend == "reference" and objective == "defaults":
        # a run recorded before the tree digest: digests.jsonl with no digest_kind, each
        # digest one flat sha256; replay compares in that kind and still verifies
        from models.checkpoint import load_checkpoint
        from weights.digest import canonical_digest

        old = {
            v: canonical_digest(load_checkpoint(live / "weights" / f"v{v}")[1]) for v in (1, 2, 3)
        }
        lines = [json.dumps({"version": v, "digest": d}) + "\n" for v, d in old.items()]
        (live / "weights" / "digests.jsonl").write_text("".join(lines))
        res_old = replay(live / "stream", tmp_path / "replay_old")
        assert res_old == {str(v): [d, d] for v, d in old.items()}


def test_replay_errors(tmp_path: Path) -> None:
    from pipeline.core.recorder import Recorder, StepRecord

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from pipeline.config.run import RunConfig, to_yaml

    (run_dir / "config.yaml").write_text(to_yaml(RunConfig(run_dir=str(run_dir))))
    rec = Recorder(run_dir)
    rec.log_step(StepRecord(1, 0, ["w0/0"], [False], 1))
    rec.close()
    with pytest.raises(ConfigError, match="not in the stream"):
        replay(run_dir / "stream", tmp_path / "out")
    (run_dir / "steps.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no training steps"):
        replay(run_dir / "stream", tmp_path / "out")
