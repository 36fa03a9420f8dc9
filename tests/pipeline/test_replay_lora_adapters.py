"""A LoRA run with adapter-only versions (learner.lora.publish=adapters), end to end: the real
learner, one real generator process, real files and ZeroMQ, numerics exact, 4 steps. v0 is the
full set; v1..v4 each reach the generator as its adapter set (read from
RUN_DIR/weights/v<N>/adapter, merged onto the base it read once, checked against the merged
digest: the generator's log says so per version, with the bytes it read); replay from the
stream reaches every version's merged digest bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.commands.replay_main import replay
from tests.pipeline.e2e_utils import check_run, run, small_config
from weights.publication import Publication


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "reference"])
def test_adapter_versions_reach_the_generator_and_replay_bit_for_bit(
    tmp_path: Path, backend: str
) -> None:
    live = tmp_path / "live"
    cfg = small_config(live, "steps=4", "generators.count=1", "staleness.max_staleness=1",
                       f"backend={backend}", "numerics=exact", "learner.lora.rank=4",
                       "learner.lora.publish=adapters", "optimizer.lr=3e-2", "publish.keep=0",
                       "publish.transport=shared_fs",
                       # the adapters alone (auto would train the fresh init's embedding too,
                       # a quarter of the set: tests/weights/test_adapters.py has that case)
                       "learner.lora.train_embeddings=false")  # fmt: skip
    s = run(cfg)
    check_run(live, 4, 4, max_staleness=1)
    # what the generator read: the base once, then each served version's adapter set alone
    log = (live / "logs" / "gen0.log").read_text(errors="replace")
    assert "refusing adapter weights" not in log and "reading the merged directory" not in log
    merged = {int(v): int(n) for v, n in
              re.findall(r"weights v(\d+): adapter set of (\d+) bytes read", log)}  # fmt: skip
    assert len(re.findall(r"read the base \w+ once", log)) == 1
    assert merged and set(merged) <= {1, 2, 3, 4}, log[-3000:]
    full = len(Publication.from_dir(live / "weights" / "v1", 1).blob)
    for v, nbytes in merged.items():
        assert nbytes == (
            live / "weights" / f"v{v}" / "adapter" / "model.safetensors"
        ).stat().st_size - _header(live / "weights" / f"v{v}" / "adapter" / "model.safetensors")
        assert nbytes * 5 < full, (v, nbytes, full)  # rank 4 on the tiny model: < 1/5
    # replay reaches every version's merged digest (what digests.jsonl recorded)
    res = replay(live / "stream", tmp_path / "replay")
    assert sorted(res, key=int) == ["1", "2", "3", "4"]
    for version, (want, got) in res.items():
        assert want == got, f"v{version}: live {want} != replay {got}"
    assert res["4"][1] == s["final_digest"]


def _header(path: Path) -> int:
    """Bytes of a safetensors file before its data (8 + the JSON header)."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
