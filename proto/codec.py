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

A :class:`Codec` holds zstd contexts and is not thread-safe: use one per thread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

from proto.batch import decode_batch, encode_batch
from proto.errors import ProtocolError
from proto.records import RolloutBatch
from proto.schema import REGISTRY, from_wire, to_wire
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, check_compatible, is_newer_minor

MAGIC = b"LQRL"
HEADER = struct.Struct("<4sBBBB")
FLAG_ZSTD = 1
DEFAULT_MAX_FRAME = 256 << 20  # bytes on the wire
DEFAULT_MAX_MESSAGE = 1 << 30  # bytes after decompression


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


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
    max_message_bytes: largest decompressed body accepted.
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
            size = zstandard.frame_content_size(body)
            if size < 0:
                raise ProtocolError("zstd body without a declared content size is not accepted")
            if size > self.max_message_bytes:
                raise ProtocolError(
                    f"decompressed size {size} exceeds max_message_bytes {self.max_message_bytes}"
                )
            raw = self._dctx.decompress(body, max_output_size=size)
            if len(raw) != size:
                raise ProtocolError("zstd body shorter than its declared content size")
        else:
            raw = bytes(body)
        obj = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_ext)
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
