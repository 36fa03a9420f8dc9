"""`looprl run publish.transport=shm` (weights/shm.py): the
learner writes each version once into /dev/shm beside its directory, the generator on its host
maps it and checks the tree digest; a corrupt copy (the test hook LOOPRL_CORRUPT_SHM) is
refused by name, that version loads from its directory (its digest checked as it is read), and
the run finishes. Every file of the run is gone from /dev/shm at the end."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from models.random_init import init_checkpoint
from tests.cli.test_run_llama import ENV, looprl_run
from weights.shm import SHM_DIR, shm_versions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_run_delivers_through_shm_and_refuses_a_corrupt_copy(tmp_path: Path) -> None:
    model = init_checkpoint("llama", "tiny", tmp_path / "llama")
    run_dir = tmp_path / "run"
    os.environ["LOOPRL_CORRUPT_SHM"] = "2"
    ENV["LOOPRL_CORRUPT_SHM"] = "2"
    try:
        code, err, wall = looprl_run(
            run_dir, f"model.path={model}", "steps=5", "generators.count=1",
            "publish.transport=shm", "publish.keep=2", timeout_s=300,
        )  # fmt: skip
    finally:
        os.environ.pop("LOOPRL_CORRUPT_SHM")
        ENV.pop("LOOPRL_CORRUPT_SHM")
    assert code == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    print(f"\nshm run: {s['steps']} steps in {wall:.0f} s, reward {s['reward_first']:.3f} -> "
          f"{s['reward_last']:.3f}")  # fmt: skip
    assert s["steps"] == 5 and s["final_version"] == 5
    assert 0 <= s["reward_first"] <= 1 and 0 <= s["reward_last"] <= 1, s
    assert s["counts"]["publisher"].get("nacked", 0) == 0, s["counts"]["publisher"]
    gen = (run_dir / "logs" / "gen0.log").read_text()
    refused = [x for x in gen.splitlines() if "shared-memory copy refused" in x]
    assert len(refused) == 1, gen[-3000:]
    assert re.search(r"weights v2 in /\S+/looprl-\w+-v2\.blob: pieces 0 \(\[.+\]\) do not match",
                     refused[0]), refused  # fmt: skip
    assert str((run_dir / "weights" / "v2").resolve()) in refused[0]
    mapped = re.findall(r"weights v(\d+) mapped from ", gen)
    assert {int(v) for v in mapped} >= {1, 3}, gen[-3000:]  # (a version may be skipped: newer)
    assert "2" not in mapped
    assert shm_versions(run_dir / "weights", SHM_DIR) == []
