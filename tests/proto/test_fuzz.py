"""Decoder fuzzing: random and mutated frames; only ProtocolError may escape.

Runs >= 10,000 inputs in the default suite: random bytes, byte-level mutations of valid
frames of every record type (flips, truncations, splices, header edits, re-compression)
and structural mutations of their msgpack bodies (values swapped for hostile ones).
Bounded: a per-input time limit and a peak-allocation limit measured with tracemalloc.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from typing import Any

import msgpack
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.codec import HEADER, MAGIC, Codec
from proto.errors import ProtocolError
from tests.proto.strategies import sample_records

HOSTILE: list[Any] = [
    None,
    True,
    -1,
    2**64 - 1,
    -(2**63),
    1e308,
    float("nan"),
    float("-inf"),
    "",
    "x" * 300,
    b"",
    b"\x00" * 17,
    [],
    [1, 2],
    {},
    {"dt": "<f4", "sh": [2**40], "wd": "<f4", "bs": 0, "d": b""},
    {"dt": "<i4", "sh": [3], "wd": "<f8", "bs": 0, "d": b"\x00" * 24},
    {"dt": "|O", "sh": [1], "wd": "|O", "bs": 0, "d": b"\x00" * 8},
    {"dt": "<i4", "sh": [-1], "wd": "<i4", "bs": 1, "d": b""},
    {"dt": "<u2", "sh": [2, 2], "wd": "|u1", "bs": 2, "d": b"\x00" * 4},
    msgpack.ExtType(1, b"evil"),
]


def _seed_frames(rng: random.Random) -> list[bytes]:
    frames = []
    for rec in sample_records(rng):
        for level in (0, 1):
            frames.append(Codec(level=level, min_compress_bytes=0).encode(rec))
    return frames


def _mutate_structure(body: Any, rng: random.Random) -> Any:
    if isinstance(body, dict) and body:
        k = rng.choice(list(body))
        roll = rng.random()
        if roll < 0.15:
            del body[k]
        elif roll < 0.25:
            body["zz_" + str(rng.random())] = rng.choice(HOSTILE)
        elif roll < 0.6 and isinstance(body[k], dict | list):
            body[k] = _mutate_structure(body[k], rng)
        else:
            body[k] = rng.choice(HOSTILE)
    elif isinstance(body, list) and body:
        i = rng.randrange(len(body))
        if isinstance(body[i], dict | list) and rng.random() < 0.6:
            body[i] = _mutate_structure(body[i], rng)
        else:
            body[i] = rng.choice(HOSTILE)
    return body


def _mutate_bytes(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    op = rng.randrange(7)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        del b[rng.randrange(len(b) + 1) :]
    elif op == 2:
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 3 and len(b) >= 8:
        b[rng.randrange(4, 8)] = rng.randrange(256)
    elif op == 4 and len(b) > HEADER.size:
        i = rng.randrange(HEADER.size, len(b))
        b[i : i + 4] = rng.choice([b"\xff\xff\xff\xff", b"\xdb\xff\xff\xff", b"\xc5\xff\xff"])
    elif op == 5:
        return rng.randbytes(rng.randint(0, 64))
    else:
        return MAGIC + bytes([1, 0, 0, 0]) + rng.randbytes(rng.randint(0, 64))
    return bytes(b)


def _structural(frame: bytes, rng: random.Random) -> bytes:
    codec = Codec(level=0)
    raw = frame[HEADER.size :]
    if frame[6] & 1:
        raw = zstandard.ZstdDecompressor().decompress(raw)
    obj = _mutate_structure(msgpack.unpackb(raw, raw=False, strict_map_key=False), rng)
    body = msgpack.packb(obj, use_bin_type=True)
    if rng.random() < 0.5:
        return HEADER.pack(MAGIC, 1, 0, 1, 0) + zstandard.ZstdCompressor().compress(body)
    del codec
    return HEADER.pack(MAGIC, 1, 0, 0, 0) + body


def test_decoder_fuzz_only_protocol_error_escapes() -> None:
    rng = random.Random(1234)
    seeds = _seed_frames(rng)
    codec = Codec(max_frame_bytes=1 << 20, max_message_bytes=4 << 20)
    counts = {"accepted": 0, "rejected": 0}
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        worst = 0.0
        for i in range(12_000):
            base = rng.choice(seeds)
            kind = i % 3
            data = (
                _structural(base, rng)
                if kind == 0
                else _mutate_bytes(base, rng)
                if kind == 1
                else _mutate_bytes(_mutate_bytes(base, rng), rng)
            )
            s = time.perf_counter()
            try:
                codec.decode(data)
                counts["accepted"] += 1
            except ProtocolError as e:
                assert str(e), "ProtocolError without a message"
                counts["rejected"] += 1
            worst = max(worst, time.perf_counter() - s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = counts["accepted"] + counts["rejected"]
    assert total == 12_000
    assert counts["rejected"] > 6_000, counts  # the mutations really are hostile
    assert worst < 0.5, f"one input took {worst:.3f}s"
    assert peak < 64 << 20, f"peak allocation {peak / 2**20:.1f} MiB"
    assert time.perf_counter() - t0 < 120


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_header(tail: bytes) -> None:
    for flags in (0, 1):
        try:
            Codec().decode(HEADER.pack(MAGIC, 1, 0, flags, 0) + tail)
        except ProtocolError:
            pass
