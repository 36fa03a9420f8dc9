"""``looprl replay``: train from a recorded stream, the same batches in the same order.

    looprl replay --stream runs/quickstart/stream [--config FILE] [--out DIR] [key=value ...]

The stream's run directory (its parent) holds config.yaml (the run's settings; ``--config``
and overrides go on top), steps.jsonl (each step's rollout ids, in training order, and the
correction flags) and weights/digests.jsonl (the digest of every published version). Replay
builds the trainer from the run's starting checkpoint, feeds it exactly those batches
(failed rewards filled as live training does), publishes at the same steps into
``--out`` (default RUN_DIR/replay) and compares each version's canonical digest with the
live run's. Exit code 0 when every compared digest matches, 1 otherwise, 2 bad input.

Under torchrun (several learner ranks, as ``looprl learner`` runs them: tp / dp from the run
config and the world size) every rank reads the stream and makes the same trainer calls in the
same order (each is a collective); rank 0 writes the publications, compares and prints:

    torchrun --nproc-per-node 2 -m pipeline.cli replay --stream RUN_DIR/stream
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from models.errors import ConfigError
from pipeline.backends.trainer_api import build_trainer
from pipeline.commands import console
from pipeline.commands.learner_main import model_dir, resolve_config
from pipeline.core.recorder import read_rollouts, read_steps
from pipeline.net.untrusted import EscapeArgs
from proto.stream.format import check_stream_dir
from weights.publication import Publication, weights_dir

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay",
        help="train from a recorded rollout stream and compare the weights with the live run",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--stream", required=True, metavar="PATH", help="the run's stream directory")
    p.add_argument("--config", metavar="FILE", help="settings on top of the run's config.yaml")
    p.add_argument("--out", metavar="DIR", help="where replay publishes (default RUN_DIR/replay)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show third-party logs and warnings here, not only in "
                        "OUT/replay.log (env: LOOPRL_VERBOSE=1)")  # fmt: skip
    p.set_defaults(func=run)
    return p


def replay(stream: Path, out: Path, config: str | None = None,
           overrides: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Replay ``stream`` (see the module docstring); returns {version: [live, replay digest]}."""

    if not stream.exists():
        raise ConfigError(f"--stream {stream}: no such stream directory (a run's RUN_DIR/stream)")
    check_stream_dir(stream, create=False)  # StreamError naming the path and what is wrong
    run_dir = stream.resolve().parent
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--stream {stream}: {run_dir / 'config.yaml'} not found (replay reads "
                          "the run's settings from the stream's parent directory)")  # fmt: skip
    cfg = resolve_config(config, str(run_dir), list(overrides or []))
    steps = read_steps(run_dir / "steps.jsonl")
    if not steps:
        raise ConfigError(f"{run_dir / 'steps.jsonl'}: no training steps recorded")
    need = {rid for s in steps for rid in s.rollout_ids}
    rollouts = {}
    for _, r in read_rollouts(stream):
        if r.rollout_id in need:  # the last copy: earlier ones were voided by a resume
            rollouts[r.rollout_id] = r
    missing = need - rollouts.keys()
    if missing:
        raise ConfigError(f"{stream}: {len(missing)} trained rollouts are not in the stream, "
                          f"e.g. {sorted(missing)[:3]}")  # fmt: skip
    live: dict[int, str] = {}
    kinds: dict[int, tuple[str, int]] = {}  # the recorded digest kind ("": a run before the tree)
    dpath = run_dir / "weights" / "digests.jsonl"
    if dpath.is_file():
        for line in dpath.read_text().splitlines():
            d = json.loads(line)
            live[int(d["version"])] = str(d["digest"])  # a resumed run's later entry wins
            kinds[int(d["version"])] = (d.get("digest_kind", ""), d.get("digest_chunk_bytes", 0))
    if _rank() and cfg.backend == "reference":
        raise ConfigError("backend=reference replays in one process; use megatron with torchrun")
    trainer = build_trainer(cfg.backend, cfg, model_dir(cfg, run_dir))
    result: dict[str, Any] = {}
    try:
        for s in steps:
            trainer.step([rollouts[rid] for rid in s.rollout_ids], s.corrections)
            if s.publish is not None:
                vdir = weights_dir(out, s.publish)
                pub = trainer.publish(vdir, s.publish)  # the trainer computed its digest once
                if _rank():  # ranks > 0 take part in the publication; rank 0 writes it
                    continue
                pub = pub or Publication.from_dir(vdir, s.publish)
                kind = kinds.get(s.publish, (pub.digest_kind, pub.digest_chunk_bytes))
                digest = pub.digest_as(*kind)  # the recorded kind: older runs' flat digests too
                result[str(s.publish)] = [live.get(s.publish), digest]
    finally:
        trainer.close()
    return result


def _rank() -> int:
    """This process's torchrun rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def run(args: argparse.Namespace) -> int:

    stream = Path(args.stream)
    out = Path(args.out) if args.out else stream.resolve().parent / "replay"
    verbose = console.verbose_from_env(getattr(args, "verbose", False))
    if stream.is_dir():  # third-party warnings to OUT/replay.log (-v: here too)
        name = f"replay-rank{_rank()}.log" if _rank() else "replay.log"
        console.setup(out / name, verbose=verbose, level=logging.WARNING)
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        for h in logging.getLogger().handlers:  # a learner's text in a log line: escaped
            h.addFilter(EscapeArgs())
    try:
        res = replay(stream, out, args.config, list(args.overrides))
    except (ValueError, FileNotFoundError) as e:  # ConfigError, StreamError, bad model dir
        print(f"looprl replay: error: {e}", file=sys.stderr)
        return 2
    if _rank():  # rank 0 compares and reports
        return 0
    compared = {v: d for v, d in res.items() if d[0] is not None}
    bad = [v for v, (a, b) in compared.items() if a != b]
    last = max(res, key=int)
    print(f"replayed {len(res)} publications into {out}; final v{last} digest {res[last][1]}")
    print(f"compared {len(compared)} with the live run: "
          + ("all identical" if not bad else f"MISMATCH at versions {bad}"))  # fmt: skip
    (out / "replay.json").write_text(json.dumps(res, indent=1))
    return 1 if bad else 0
