"""weights.publication owns RUN_DIR/weights/v<N>: naming and pruning (one owner;
a killed run's directories are pruned too, not only the ones this process announced)."""

from __future__ import annotations

from pathlib import Path

from weights.publication import prune_weights, weight_versions, weights_dir


def test_prune_keeps_the_newest_up_to_current_and_what_may_be_in_writing(tmp_path: Path) -> None:
    for v in [*range(1, 14), 15]:  # v1..v13 (a killed run's 10 stale among them), v15 in writing
        weights_dir(tmp_path, v).mkdir(parents=True)
    (tmp_path / "weights" / "digests.jsonl").write_text("")
    (tmp_path / "weights" / "vtmp").mkdir()  # not a version: never touched
    assert weights_dir(tmp_path, 7) == tmp_path / "weights" / "v7"
    assert prune_weights(tmp_path, current=13, keep=3) == list(range(1, 11))
    assert weight_versions(tmp_path) == [11, 12, 13, 15]
    assert (tmp_path / "weights" / "digests.jsonl").is_file()
    assert (tmp_path / "weights" / "vtmp").is_dir()
    assert prune_weights(tmp_path, current=13, keep=0) == []  # keep 0: everything stays
    assert prune_weights(tmp_path, current=16, keep=1) == [11, 12, 13]
    assert weight_versions(tmp_path) == [15]
    assert weight_versions(tmp_path / "nowhere") == []
