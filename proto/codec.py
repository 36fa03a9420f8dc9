"""Frames: record -> msgpack -> (zstd) -> bytes with an 8-byte header, and back.

Frame layout (all frames, every transport, and the payload of stream-file frames)::

    offset 0  4 bytes  magic b"LQRL"
    offset 4  1 byte   protocol major      offset 5  1 byte  protocol minor
    offset 6  1 byte   flags: bit 0 = body is one zstd frame (with its content size)
    offset 7  1 byte   reserved, 0
    offset 8  ...      body: msgpack array [wire_type: str, fields: map]

Decoding is defensive: the frame size, the declared decompressed size, every msgpack
length and every field are bounded and checked before use; ext types are refused;
nothing is ever unpickled. Any failure raises :class:`ProtocolError` and nothing else.

Decompression bombs: a zstd body is decompressed only if it is one standard zstd frame
(its magic number; skippable frames are refused) declaring a content size of at most
``max_message_bytes``. python-zstandard's ``decompress`` allocates the DECLARED content size
in one piece (``max_output_size`` only matters for frames without one, which are refused),
and zstd stops at that size, so decoding one frame allocates at most ``max_message_bytes``
for its body however the bytes claim otherwise. A receiver sets ``max_message_bytes`` to its
frame limit (pipeline.net.transport.session), so a body costs at most its frame limit in memory,
compressed or not, and the lists and maps msgpack builds from it at most twice that
(:class:`_ObjectBudget`); ``encode`` refuses a body its own limit would refuse.

A :class:`Codec` holds zstd contexts and is not thread-safe: use one per thread.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

from proto.batch import decode_batch, encode_batch
from proto.errors import ProtocolError
from proto.records import RolloutBatch
from proto.schema import MAX_LIST, REGISTRY, from_wire, to_wire
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, check_compatible, is_newer_minor

MAGIC = b"LQRL"
HEADER = struct.Struct("<4sBBBB")
FLAG_ZSTD = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a standard zstd frame (RFC 8878), not a skippable one
DEFAULT_MAX_FRAME = 256 << 20  # bytes on the wire
DEFAULT_MAX_MESSAGE = 1 << 30  # bytes after decompression
BODY_START = 0x92  # msgpack fixarray of 2: [wire_type, fields]
ENTRY_BYTES = 88
"""What one entry of a decoded list or map may cost beyond its payload: its slot (8 bytes)
and the largest head of a scalar msgpack builds (a non-ASCII str: 80 bytes)."""


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


class _ObjectBudget:
    """The bytes msgpack may spend on the lists and maps it builds from one body.

    msgpack turns one byte into an object: 0x90 (an empty list) costs 64 bytes of Python
    objects, so 4 MiB of body (a few KiB compressed) would build 256 MiB of lists. Every
    list and map is charged, as msgpack finishes it, its own size plus ``ENTRY_BYTES`` per
    entry (an upper bound of what its scalars' heads take; a map's keys and values both);
    decoding stops with a ProtocolError once the charges pass ``budget`` (twice
    max_message_bytes: the estimate is pessimistic; a weight announce of 45,000 tensors, an
    8.3 MB body that decodes into 33 MB, is charged 75 MB). A single container is also capped at
    ``MAX_LIST`` entries (msgpack allocates its slots before filling them). What is not
    charged is the payload of strings and bytes, at most 4 bytes per body byte (UCS-4)."""

    __slots__ = ("budget", "left")

    def __init__(self, budget: int) -> None:
        self.budget = self.left = budget

    def _charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ProtocolError(
                f"decoded lists and maps exceed {self.budget} bytes (2 x max_message_bytes)"
            )

    def on_list(self, v: list[Any]) -> list[Any]:
        self._charge(sys.getsizeof(v) + ENTRY_BYTES * len(v))
        return v

    def on_map(self, d: dict[Any, Any]) -> dict[Any, Any]:
        self._charge(sys.getsizeof(d) + 2 * ENTRY_BYTES * len(d))
        return d


@dataclass
class DecodedFrame:
    """A decoded frame plus its sizes (for metrics and `stream inspect`)."""

    record: Any
    wire_type: str
    version: tuple[int, int]
    wire_bytes: int
    body_bytes: int


class Codec:
    """Encode and decode looprl records.

    level: zstd level (1 fast .. 19 small; 0 disables compression).
    min_compress_bytes: bodies smaller than this are sent uncompressed.
    max_frame_bytes: largest frame accepted on decode (and produced on encode).
    max_message_bytes: largest msgpack body, decompressed, accepted on decode (checked on the
        declared size, before anything is allocated) and produced on encode.
    """

    def __init__(
        self,
        *,
        level: int = 1,
        min_compress_bytes: int = 512,
        max_frame_bytes: int = DEFAULT_MAX_FRAME,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
    ) -> None:
        if not 0 <= level <= 22:
            raise ValueError(f"zstd level must be in 0..22, got {level}")
        if max_frame_bytes < HEADER.size or max_message_bytes < 1:
            raise ValueError("max_frame_bytes and max_message_bytes must be positive")
        self.level = level
        self.min_compress_bytes = min_compress_bytes
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes
        self._cctx = (
            zstandard.ZstdCompressor(level=level, write_content_size=True) if level else None
        )
        self._dctx = zstandard.ZstdDecompressor()
        self._header = HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, 0, 0)
        self._header_z = HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, FLAG_ZSTD, 0)

    # -- encode ---------------------------------------------------------------------------
    def encode_body(self, rec: Any) -> bytes:
        """The msgpack body of ``rec`` (uncompressed), without a header."""
        wire_type = getattr(type(rec), "WIRE_TYPE", None)
        if wire_type is None or REGISTRY.get(wire_type) is not type(rec):
            raise TypeError(f"{type(rec).__name__} is not a registered wire record")
        fields = encode_batch(rec) if isinstance(rec, RolloutBatch) else to_wire(rec)
        return msgpack.packb([wire_type, fields], use_bin_type=True)

    def encode(self, rec: Any) -> bytes:
        """Record -> frame bytes."""
        body = self.encode_body(rec)
        if len(body) > self.max_message_bytes:
            raise ProtocolError(
                f"{type(rec).__name__} body of {len(body)} bytes exceeds max_message_bytes "
                f"{self.max_message_bytes}; split it (e.g. smaller weight chunks or batches)"
            )
        if self._cctx is not None and len(body) >= self.min_compress_bytes:
            frame = self._header_z + self._cctx.compress(body)
        else:
            frame = self._header + body
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(
                f"{type(rec).__name__} frame of {len(frame)} bytes exceeds max_frame_bytes "
                f"{self.max_frame_bytes}; split it (e.g. smaller weight chunks or batches)"
            )
        return frame

    # -- decode ---------------------------------------------------------------------------
    def decode(self, buf: bytes | bytearray | memoryview) -> Any:
        """Frame bytes -> validated record. Raises ProtocolError only."""
        return self.decode_frame(buf).record

    def decode_frame(self, buf: bytes | bytearray | memoryview) -> DecodedFrame:
        try:
            return self._decode_frame(buf)
        except ProtocolError:
            raise
        except (MemoryError, RecursionError) as e:  # pragma: no cover - defensive
            raise ProtocolError(f"frame could not be decoded: {type(e).__name__}") from e
        except Exception as e:  # any library error on hostile input becomes a ProtocolError
            raise ProtocolError(f"frame could not be decoded: {type(e).__name__}: {e}") from e

    def _decode_frame(self, buf: bytes | bytearray | memoryview) -> DecodedFrame:
        n = len(buf)
        if n > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {n} bytes exceeds max_frame_bytes {self.max_frame_bytes}"
            )
        if n < HEADER.size:
            raise ProtocolError(f"frame of {n} bytes is shorter than the {HEADER.size}-byte header")
        magic, major, minor, flags, reserved = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ProtocolError(
                f"bad magic {bytes(magic)!r}: not a looprl frame (expected {MAGIC!r})"
            )
        check_compatible((major, minor), what="frame")
        if flags & ~FLAG_ZSTD or reserved:
            raise ProtocolError(f"unknown frame flags {flags:#x}/{reserved:#x}")
        body = memoryview(buf)[HEADER.size :]
        if flags & FLAG_ZSTD:
            if bytes(body[:4]) != ZSTD_MAGIC:
                raise ProtocolError("zstd body is not one standard zstd frame (bad zstd magic)")
            size = zstandard.frame_content_size(body)
            if size < 0:
                raise ProtocolError("zstd body without a declared content size is not accepted")
            if size > self.max_message_bytes:
                raise ProtocolError(
                    f"decompressed size {size} exceeds max_message_bytes {self.max_message_bytes}"
                )
            raw: bytes | memoryview = self._dctx.decompress(body, max_output_size=size)
            if len(raw) != size:
                raise ProtocolError("zstd body shorter than its declared content size")
        else:
            raw = body
        if not len(raw) or raw[0] != BODY_START:
            raise ProtocolError("body must be a msgpack array [wire_type, fields]")
        budget = _ObjectBudget(2 * self.max_message_bytes)
        obj = msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            list_hook=budget.on_list,
            object_hook=budget.on_map,
            max_array_len=MAX_LIST,
            max_map_len=MAX_LIST,
        )
        if type(obj) is not list or len(obj) != 2 or type(obj[0]) is not str:
            raise ProtocolError("body must be a msgpack array [wire_type, fields]")
        wire_type, fields = obj
        cls = REGISTRY.get(wire_type)
        if cls is None or wire_type == "tensor_meta":
            raise ProtocolError(
                f"unknown record type {wire_type!r}; known: "
                f"{sorted(k for k in REGISTRY if k != 'tensor_meta')}"
            )
        if cls is RolloutBatch:
            rec = decode_batch(fields)
        else:
            rec = from_wire(cls, fields, allow_unknown=is_newer_minor((major, minor)))
        return DecodedFrame(rec, wire_type, (major, minor), n, len(raw))


def peek_header(buf: bytes | bytearray | memoryview) -> tuple[tuple[int, int], bool]:
    """(protocol version, compressed?) of a frame, without decoding it."""
    if len(buf) < HEADER.size:
        raise ProtocolError("frame shorter than its header")
    magic, major, minor, flags, _ = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a looprl frame")
    return (major, minor), bool(flags & FLAG_ZSTD)
