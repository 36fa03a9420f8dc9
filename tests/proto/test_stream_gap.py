"""A segment file missing from the middle of a recorded stream: ``looprl stream recover``
salvages every intact segment around it and reports the gap (its seqs and frame count);
``looprl stream inspect`` names the missing segment and counts what is intact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from proto.codec import Codec
from proto.records import Rollout, RolloutBatch
from proto.stream.format import index_name, segment_name
from proto.stream.reader import StreamReader
from proto.stream.writer import StreamWriter

REPO = Path(__file__).resolve().parents[2]
FRAMES = 60


def _rollout(frame: int, k: int) -> Rollout:
    n = 24 + (frame * 7 + k * 3) % 40
    return Rollout(
        rollout_id=f"w{frame}/{k}", work_id=f"w{frame}", prompt_id=f"p{frame}", sample_index=k,
        generator_id=f"gen-{frame % 2}", latent_seed=frame * 100 + k,
        prompt_tokens=np.arange(1, 9, dtype=np.int32), tokens=(np.arange(n) % 50).astype(np.int32),
        logprobs=np.full(n, -0.5, np.float32), exit_depths=np.full(n, 4, np.uint8),
        weight_version=frame // 10,
    )  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[str]]]:
    """A stream written as the recorder writes it (one RolloutBatch per intake, codec level 1),
    in small segments; returns it and the rollout ids of each seq."""
    s = tmp_path_factory.mktemp("gap") / "stream"
    codec = Codec(level=1)
    ids: dict[int, list[str]] = {}
    with StreamWriter(s, segment_bytes=4096) as w:
        for f in range(FRAMES):
            batch = [_rollout(f, k) for k in range(1 + f % 4)]
            ids[w.append(codec.encode(RolloutBatch(batch)))] = [r.rollout_id for r in batch]
            w.flush()
    return s, ids


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pipeline.cli", "stream", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _segments(s: Path) -> dict[int, list[int]]:
    with StreamReader(s) as r:
        return {seg.number: list(seg.seqs) for seg in r.segments}


def _rollout_ids(s: Path) -> dict[int, list[str]]:
    codec = Codec()
    with StreamReader(s) as r:
        out = {}
        for f in r.iter():
            rec = codec.decode_frame(f.payload).record
            assert isinstance(rec, RolloutBatch)
            out[f.seq] = [x.rollout_id for x in rec.rollouts]
        return out


@pytest.mark.parametrize("orphan_index", [False, True])
def test_recover_salvages_the_segments_around_a_missing_one(
    recorded: tuple[Path, dict[int, list[str]]], tmp_path: Path, orphan_index: bool
) -> None:
    pristine, ids = recorded
    s = tmp_path / "stream"
    shutil.copytree(pristine, s)
    segs = _segments(s)
    assert len(segs) >= 8, len(segs)  # a real multi-segment stream
    gone = sorted(segs)[len(segs) // 2]  # a middle segment
    lost_seqs = segs[gone]
    assert len(lost_seqs) >= 2
    (s / segment_name(gone)).unlink()
    if not orphan_index:
        (s / index_name(gone)).unlink()
    kept = {q: v for q, v in ids.items() if q not in lost_seqs}
    kept_rollouts = sum(len(v) for v in kept.values())

    # inspect: exit 2, names the missing segment, counts the intact frames and the gap
    look = _cli("inspect", str(s))
    assert look.returncode == 2
    assert f"{segment_name(gone)} is missing" in look.stderr
    assert f"{len(kept)} frames intact" in look.stderr
    gap = f"seq {lost_seqs[0]}..{lost_seqs[-1]} ({len(lost_seqs)} frames)"
    assert f"damaged: {gap}: {segment_name(gone)} missing" in look.stderr, look.stderr
    assert "Traceback" not in look.stderr
    j = json.loads(_cli("inspect", str(s), "--json").stdout)
    assert j["intact_frames"] == len(kept)
    assert j["damaged"][0]["missing_segments"] == [segment_name(gone)]
    assert j["damaged"][0]["frames"] == len(lost_seqs)

    # recover: exit 0, every intact segment salvaged, the gap reported with its seqs
    fixed = _cli("recover", str(s))
    assert fixed.returncode == 0, fixed.stderr
    assert f"{len(kept)} intact frames" in fixed.stdout
    assert f"lost {gap}: {segment_name(gone)} missing" in fixed.stdout, fixed.stdout
    back = _rollout_ids(s)  # every intact frame reads back, with its rollouts, at its seq
    assert back == kept
    assert sum(len(v) for v in back.values()) == kept_rollouts
    with StreamReader(s) as r:
        assert r.verify() == len(kept) and r.torn_tail is None
    backups = [p for p in tmp_path.iterdir() if p.name.startswith("stream.damaged-")]
    if orphan_index:  # the orphan index (what the segment held) is kept, not overwritten
        assert len(backups) == 1 and os.listdir(backups[0]) == [index_name(gone)]
    else:
        assert backups == []

    ok = _cli("inspect", str(s), "--json")
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["frames"] == len(kept) and summary["rollouts"] == kept_rollouts
    with StreamWriter(s) as w:  # the recorder continues after the last seq
        assert w.append(b"x") == FRAMES
    again = _cli("recover", str(s), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["lost"] == []


def test_two_gaps_and_adjacent_missing_segments(
    recorded: tuple[Path, dict[int, list[str]]], tmp_path: Path
) -> None:
    """Two consecutive missing segments are one gap; another gap elsewhere is another."""
    pristine, ids = recorded
    s = tmp_path / "stream"
    shutil.copytree(pristine, s)
    segs = _segments(s)
    nums = sorted(segs)
    a, b, c = nums[2], nums[3], nums[-2]
    for n in (a, b, c):
        (s / segment_name(n)).unlink()
        (s / index_name(n)).unlink()
    rep = json.loads(_cli("recover", str(s), "--json").stdout)
    got = [(r["missing_segments"], r["frames"], r["seqs"]) for r in rep["lost"]]
    ab = segs[a] + segs[b]
    assert got == [
        ([segment_name(a), segment_name(b)], len(ab), f"{ab[0]}..{ab[-1]}"),
        ([segment_name(c)], len(segs[c]), f"{segs[c][0]}..{segs[c][-1]}"),
    ]
    lost = set(ab) | set(segs[c])
    assert _rollout_ids(s) == {q: v for q, v in ids.items() if q not in lost}
