"""``looprl stream inspect|recover``: look into a recorded rollout stream, repair one.

``inspect`` reads every frame (never modifying the stream, so it also works on a stream
being written), decodes each payload with :class:`proto.codec.Codec` and prints frame
count, seq range, segments, bytes on disk, message types, weight versions, generators and
compression; ``--json`` prints the same as one JSON object, ``--frames`` lists frames.
``recover`` takes the writer lock, checks every frame, rewrites segments holding damage to
their intact frames (originals kept in ``PATH.damaged-<time>``), cuts a torn tail and
rebuilds indexes; it prints what was lost. A segment file missing from the middle is
replaced by an empty one and reported as a gap (its seqs and frame count). Damage that held
no frame (a damaged segment header, named field by field and byte by byte) is reported as
repaired, never as a lost range: ``lost`` in ``--json`` is empty exactly when the text says
"nothing lost". A damaged stream (a missing segment included) makes ``inspect`` exit 2 after
counting its intact frames, naming each damaged range and what held no frame, and pointing
to ``looprl stream recover``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proto.codec import Codec
from proto.errors import ProtocolError
from proto.records import Rollout, RolloutBatch
from proto.stream.format import FRAME_HEADER_SIZE, StreamCorruptError, StreamError, segment_name
from proto.stream.reader import StreamReader
from proto.stream.salvage import LostRange, Repair, missing_segments, survey
from proto.stream.writer import RecoveryReport, recover


@dataclass
class PayloadInfo:
    """What one frame's payload holds, as far as ``stream inspect`` cares."""

    wire_type: str  # record type ("rollouts", "rollout", ...) or "<undecodable>"
    message_bytes: int  # decompressed message body bytes
    rollouts: list[tuple[str, int]] = field(default_factory=list)  # (generator_id, version)
    error: str | None = None  # why decoding failed


PayloadDecoder = Callable[[bytes], PayloadInfo]


def codec_decoder() -> PayloadDecoder:
    """Decode payloads with the proto codec (frames of any record type)."""

    codec = Codec()

    def decode(payload: bytes) -> PayloadInfo:
        try:
            got = codec.decode_frame(payload)
        except ProtocolError as e:
            return PayloadInfo("<undecodable>", len(payload), error=str(e))
        rec = got.record
        rollouts: list[Rollout] = []
        if isinstance(rec, RolloutBatch):
            rollouts = rec.rollouts
        elif isinstance(rec, Rollout):
            rollouts = [rec]
        pairs = [(r.generator_id, r.weight_version) for r in rollouts]
        return PayloadInfo(got.wire_type, got.body_bytes, pairs)

    return decode


def _disk_bytes(root: Path) -> dict[str, int]:
    out = {"segments": 0, "indexes": 0, "other": 0}
    for name in os.listdir(root):
        size = (root / name).stat().st_size
        key = "segments" if name.endswith(".lrs") else "indexes" if name.endswith(".idx") else ""
        out[key or "other"] += size
    return out


def inspect_stream(
    path: str | os.PathLike[str], *, decode: PayloadDecoder | None = None, frames: bool = False
) -> dict[str, Any]:
    """Summary of a stream as a JSON-ready dict (see the module docstring)."""
    decode = decode or codec_decoder()
    root = Path(path)
    types: Counter[str] = Counter()
    versions: Counter[int] = Counter()
    generators: Counter[str] = Counter()
    wire = message = count = 0
    errors: list[str] = []
    listing: list[dict[str, Any]] = []
    with StreamReader(root) as reader:
        for fr in reader.iter():
            info = decode(fr.payload)
            count += 1
            wire += len(fr.payload)
            message += info.message_bytes
            types[info.wire_type] += 1
            if info.error is not None and len(errors) < 10:
                errors.append(f"seq {fr.seq}: {info.error}")
            for gen, ver in info.rollouts:
                generators[gen] += 1
                versions[ver] += 1
            if frames:
                vs = sorted({v for _, v in info.rollouts})
                listing.append(
                    {
                        "seq": fr.seq,
                        "type": info.wire_type,
                        "bytes": fr.frame_bytes,
                        "rollouts": len(info.rollouts),
                        "versions": vs,
                        "generators": sorted({g for g, _ in info.rollouts}),
                    }
                )
        segments = [
            {
                "name": s.path.name,
                "bytes": s.size,
                "frames": len(s.seqs),
                "first_seq": s.seqs[0] if s.seqs else None,
                "last_seq": s.last_seq,
            }
            for s in reader.segments
        ]
        first, last, torn = reader.first_seq, reader.last_seq, reader.torn_tail
        active = reader.writer_active()
    disk = _disk_bytes(root)
    out: dict[str, Any] = {
        "path": str(root),
        "frames": count,
        "first_seq": first,
        "last_seq": last,
        "segments": segments,
        "disk_bytes": sum(disk.values()),
        "disk": disk,
        "wire_bytes": wire,
        "frame_header_bytes": count * FRAME_HEADER_SIZE,
        "message_bytes": message,
        "compression_ratio": round(message / wire, 4) if wire else None,
        "types": dict(sorted(types.items())),
        "rollouts": sum(generators.values()),
        "weight_versions": {
            "min": min(versions) if versions else None,
            "max": max(versions) if versions else None,
            "histogram": {str(v): n for v, n in sorted(versions.items())},
        },
        "generators": dict(sorted(generators.items())),
        "undecodable": types.get("<undecodable>", 0),
        "errors": errors,
        "torn_tail": torn,
        "writer_active": active,
    }
    if frames:
        out["frame_list"] = listing
    return out


def _print_text(s: dict[str, Any]) -> None:
    segs = s["segments"]
    wv = s["weight_versions"]
    rows = [
        ("stream", s["path"] + ("  (writer active)" if s["writer_active"] else "")),
        ("frames", f"{s['frames']}  seq {s['first_seq']}..{s['last_seq']}"),
        ("segments", f"{len(segs)}  {segs[0]['name']} .. {segs[-1]['name']}" if segs else "0"),
        (
            "disk",
            f"{s['disk_bytes']:,} bytes  " + ", ".join(f"{k} {v:,}" for k, v in s["disk"].items()),
        ),
        ("wire", f"{s['wire_bytes']:,} payload bytes (+{s['frame_header_bytes']:,} frame headers)"),
        (
            "messages",
            f"{s['message_bytes']:,} bytes decoded; compression {s['compression_ratio']}x",
        ),
        ("types", ", ".join(f"{k} {v}" for k, v in s["types"].items()) or "-"),
        ("rollouts", str(s["rollouts"])),
        (
            "versions",
            f"min {wv['min']} max {wv['max']}  "
            + " ".join(f"v{k}:{n}" for k, n in wv["histogram"].items()),
        ),
        ("generators", ", ".join(f"{k} {v}" for k, v in s["generators"].items()) or "-"),
        ("torn tail", s["torn_tail"] or "none"),
    ]
    for k, v in rows:
        print(f"{k:<11}{v}")
    for e in s["errors"]:
        print(f"error      {e}")
    for seg in segs:
        print(
            f"  {seg['name']}  {seg['bytes']:>12,} B  {seg['frames']:>8} frames  "
            f"seq {seg['first_seq']}..{seg['last_seq']}"
        )
    for f in s.get("frame_list", []):
        vs = f["versions"]
        ver = "-" if not vs else str(vs[0]) if len(vs) == 1 else f"{vs[0]}..{vs[-1]}"
        gens = ",".join(f["generators"][:3]) + ("..." if len(f["generators"]) > 3 else "")
        print(f"  seq {f['seq']:>10}  {f['type']:<12} {f['bytes']:>10,} B  v{ver:<8} {gens}")


def _where(r: LostRange) -> str:
    """Where a lost range was: a byte range of a segment, or the missing segment files."""
    if r.missing:
        names = ", ".join(segment_name(n) for n in r.missing)
        return f"{names} missing (rollouts in it unknown: the file is gone)"
    return f"{segment_name(r.segment)} offset {r.offset}, {r.bytes} bytes ({r.reason})"


def _count(r: LostRange) -> str:
    n = r.frame_count
    if n is None:
        why = "a frame header is damaged" if not r.missing else "no intact frame on one side"
        return f"frame count unknown: {why}"
    return f"{n} frame{'s' if n != 1 else ''}"


def _repair(r: Repair) -> str:
    """A repair that lost no frame, in one line."""
    at = "" if r.missing else f" offset {r.offset}, {r.bytes} bytes"
    return f"{segment_name(r.segment)}{at}: {r.reason}"


def _print_recovery(rep: RecoveryReport) -> None:
    seqs = f"seq {rep.last_seq}" if rep.last_seq is not None else "no frames"
    print(f"recovered {rep.path}: {rep.frames} intact frames (last {seqs}) in "
          f"{rep.segments} segments; every frame checked")  # fmt: skip
    for r in rep.lost:
        print(f"  lost seq {r.seqs} ({_count(r)}): {_where(r)}")
        if r.missing:
            print(f"  gap kept: {', '.join(segment_name(n) for n in r.missing)} now an empty "
                  "segment (header only), so the stream opens again")  # fmt: skip
    for f in rep.repaired:
        print(f"  {f.action} (no frame lost): {_repair(f)}")
    if rep.truncated_segment is not None:
        print(f"  cut torn tail: {segment_name(rep.truncated_segment)} offset "
              f"{rep.truncated_offset}, {rep.truncated_bytes} bytes ({rep.torn_reason})")  # fmt: skip
    if rep.backup is not None:
        print(f"  original files of the damaged segments kept in {rep.backup}")
    if not rep.lost and rep.truncated_segment is None:
        print("  nothing lost" + (f"; indexes rebuilt for segments {list(rep.indexes_repaired)}"
                                  if rep.indexes_repaired else ""))  # fmt: skip


def _damaged(path: str, err: StreamError, as_json: bool) -> int:
    """Report a damaged stream: the error, then how much of it is intact (exit code 2)."""
    try:
        found = survey(path)
    except StreamError as e:
        print(f"looprl stream: error: {err} (and counting intact frames failed: {e})",
              file=sys.stderr)  # fmt: skip
        return 2
    lost = [r.as_dict() for r in found.lost]
    fixes = found.repairs
    if as_json:
        print(json.dumps({"path": str(path), "error": str(err), "intact_frames": found.frames,
                          "first_seq": found.first_seq, "last_seq": found.last_seq,
                          "damaged": lost, "repairable": [f.as_dict() for f in fixes],
                          "torn_tail": found.torn}))  # fmt: skip
    print(f"looprl stream: error: {err}", file=sys.stderr)
    span = f"{found.frames} frames intact (seq {found.first_seq}..{found.last_seq})"
    nofr = ", ".join(f"{segment_name(f.segment)} {'header' if f.header else f.action}"
                     for f in fixes)  # fmt: skip
    if lost:
        head = f"{span}; {len(lost)} damaged ranges, {sum(r.bytes for r in found.lost)} bytes" + (
            f"; damaged without a lost frame: {nofr}" if fixes else ""
        )
        todo = "salvages the intact frames"
    else:
        head = f"{span}, none lost" + (f"; damaged without a lost frame: {nofr}" if fixes else "")
        todo = ("rewrites what is damaged and keeps every frame" if fixes
                else "salvages the intact frames")  # fmt: skip
    print(f"looprl stream: {head}; `looprl stream recover {path}` {todo}", file=sys.stderr)
    for r in found.lost:
        print(f"  damaged: seq {r.seqs} ({_count(r)}): {_where(r)}", file=sys.stderr)
    for f in fixes:
        print(f"  damaged, no frame lost: {_repair(f)}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run ``looprl stream <action>``; returns the exit code (2: not a stream / corrupt)."""
    try:
        if args.stream_action == "recover":
            rep = recover(args.path, backup=args.backup)
            if args.json:
                print(json.dumps(rep.as_dict()))
            else:
                _print_recovery(rep)
            return 0
        summary = inspect_stream(args.path, frames=args.frames)
    except StreamCorruptError as e:
        return _damaged(args.path, e, getattr(args, "json", False))
    except StreamError as e:
        if os.path.isdir(args.path) and missing_segments(args.path):  # a gap in the numbering
            return _damaged(args.path, e, getattr(args, "json", False))
        print(f"looprl stream: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        _print_text(summary)
    return 1 if summary["undecodable"] else 0


def add_parser(subparsers: Any) -> None:
    """Register ``inspect`` and ``recover`` under the ``looprl stream`` subparsers."""
    p = subparsers.add_parser("inspect", help="summarise a recorded rollout stream")
    p.add_argument("path", help="stream directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--frames", action="store_true", help="also list every frame")
    p.set_defaults(func=run, stream_action="inspect")
    r = subparsers.add_parser(
        "recover",
        help="check every frame; salvage intact frames around damage; cut a torn tail",
    )
    r.add_argument("path", help="stream directory")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.add_argument("--backup", metavar="DIR", default=None,
                   help="keep the damaged segments' original files here "
                        "(default: PATH.damaged-<time> beside the stream)")  # fmt: skip
    r.set_defaults(func=run, stream_action="recover")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="looprl stream")
    add_parser(parser.add_subparsers(dest="stream_command", required=True, metavar="ACTION"))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
