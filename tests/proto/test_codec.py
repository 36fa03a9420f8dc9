"""Round trips of every record, bounds and version refusal."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings

from proto import records
from proto.codec import FLAG_ZSTD, HEADER, MAGIC, ZSTD_MAGIC, Codec
from proto.errors import ProtocolError
from proto.records import Rollout, RolloutBatch
from proto.schema import REGISTRY
from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from tests.proto.strategies import ALL, rollouts


def assert_same(a: object, b: object, where: str = "") -> None:
    assert type(a) is type(b), where
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where  # bit-exact, -inf included
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_every_record_has_a_strategy() -> None:
    assert set(ALL) == {k for k in REGISTRY if k != "tensor_meta"}
    assert {r.WIRE_TYPE for r in records.ALL_RECORDS} == set(ALL)


@pytest.mark.parametrize("wire_type", sorted(ALL))
@pytest.mark.parametrize("level", [0, 3])
def test_round_trip(wire_type: str, level: int) -> None:
    codec = Codec(level=level, min_compress_bytes=0)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ALL[wire_type])
    def check(rec: object) -> None:
        frame = codec.encode(rec)
        got = codec.decode(frame)
        assert_same(rec, got, wire_type)
        # Encoding is deterministic.
        assert codec.encode(got) == frame

    check()


@settings(max_examples=30, deadline=None)
@given(rollouts())
def test_batch_equals_singles(r: Rollout) -> None:
    codec = Codec()
    batch = codec.decode(codec.encode(RolloutBatch([r, r])))
    single = codec.decode(codec.encode(r))
    assert_same(batch.rollouts[0], single)
    assert_same(batch.rollouts[1], r)


def _rollout(t: int = 8) -> Rollout:
    return Rollout(
        rollout_id="w/0",
        work_id="w",
        prompt_id="p",
        sample_index=0,
        generator_id="g",
        latent_seed=7,
        prompt_tokens=np.arange(1, 4, dtype=np.int32),
        tokens=np.arange(t, dtype=np.int32),
        logprobs=np.full(t, -0.5, np.float32),
        exit_depths=np.full(t, 2, np.uint8),
        weight_version=3,
    )


def test_incompatible_major_is_refused() -> None:
    frame = bytearray(Codec().encode(_rollout()))
    frame[4] = 2  # protocol major
    with pytest.raises(
        ProtocolError, match=rf"incompatible protocol version 2\.{PROTOCOL_MINOR}.*speaks 1\.x"
    ):
        Codec().decode(bytes(frame))


def test_newer_minor_with_unknown_field_is_accepted_same_minor_refused() -> None:
    codec = Codec(level=0)
    body = msgpack.packb(["ack", {"kind": "rollout", "ref": "x", "version": 1, "future": 5}])
    newer = HEADER.pack(MAGIC, 1, PROTOCOL_MINOR + 1, 0, 0) + body
    assert codec.decode(newer).ref == "x"
    same = HEADER.pack(MAGIC, 1, PROTOCOL_MINOR, 0, 0) + body
    with pytest.raises(ProtocolError, match="unknown field"):
        codec.decode(same)


def test_bad_magic_and_short_frame() -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        Codec().decode(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ProtocolError, match="shorter than"):
        Codec().decode(b"LQ")


def test_max_frame_bytes_enforced_both_ways() -> None:
    small = Codec(level=0, max_frame_bytes=64)
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes 64"):
        small.encode(_rollout(100))
    frame = Codec(level=0).encode(_rollout(100))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        small.decode(frame)


def test_zip_bomb_is_refused_before_allocation() -> None:
    import zstandard

    body = msgpack.packb(
        ["chunk", {"version": 1, "index": 0, "offset": 0, "crc32": 0, "data": bytes(50 << 20)}]
    )
    frame = HEADER.pack(MAGIC, 1, 0, 1, 0) + zstandard.ZstdCompressor().compress(body)
    assert len(frame) < 100_000
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes"):
        Codec(max_message_bytes=1 << 20).decode(frame)


def zstd_zeros(size: int) -> bytes:
    """One valid zstd frame that decompresses to ``size`` zero bytes and says so in its
    header, built as an attacker builds it (nothing is compressed): RLE blocks of 128 KiB,
    4 bytes each, so 1 GiB takes 32 KiB."""
    out = [ZSTD_MAGIC, b"\xe0", struct.pack("<Q", size)]  # single segment, 8-byte size
    left = size
    while True:
        n = min(left, 128 << 10)
        left -= n
        out.append(struct.pack("<I", (left == 0) | (1 << 1) | (n << 3))[:3] + b"\0")  # RLE
        if left == 0:
            return b"".join(out)


def bomb_frame(declared: int) -> bytes:
    """A looprl frame whose zstd body decompresses to ``declared`` zero bytes."""
    head = HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, FLAG_ZSTD, 0)
    return head + zstd_zeros(declared)


def traced_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated through Python's allocators while ``fn`` runs (zstandard's
    output buffer included: it is a bytes object)."""
    tracemalloc.start()
    try:
        fn()
    except ProtocolError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_declared_oversize_is_refused_before_any_allocation() -> None:
    limit = 64 << 10  # the learner's weights channel
    codec = Codec(max_frame_bytes=limit, max_message_bytes=limit)
    frame = bomb_frame(1 << 30)  # the attack: 1 GiB declared in a 32 KiB frame
    assert len(frame) < 33 << 10
    with pytest.raises(ProtocolError, match="decompressed size 1073741824 exceeds max_message"):
        codec.decode(frame)
    assert traced_peak(lambda: codec.decode(frame)) < 64 << 10  # nothing near 1 GiB
    # What the limit allows is what decoding costs: tracemalloc sees that allocation.
    at_limit = Codec(max_message_bytes=8 << 20)
    assert 8 << 20 <= traced_peak(lambda: at_limit.decode(bomb_frame(8 << 20))) < 9 << 20
    assert traced_peak(lambda: at_limit.decode(bomb_frame((8 << 20) + 1))) < 64 << 10


def test_msgpack_object_amplification_is_bounded() -> None:
    """0x90 is an empty list: 64 bytes of Python objects per body byte. Unbounded, this
    4 MiB body (a few KiB compressed) builds 256 MiB of lists in 1.8 s."""
    inner = b"\xdd" + struct.pack(">I", 65536) + b"\x90" * 65536  # 64 Ki empty lists
    body = b"\x92\xa1x\xdc" + struct.pack(">H", 64) + inner * 64  # ["x", [64 of those]]
    frame = HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, FLAG_ZSTD, 0)
    frame += zstandard.ZstdCompressor(level=19).compress(body)
    assert len(frame) < 64 << 10 and len(body) > 4 << 20
    codec = Codec(max_message_bytes=len(body))
    with pytest.raises(ProtocolError, match="decoded lists and maps exceed"):
        codec.decode(frame)
    assert traced_peak(lambda: codec.decode(frame)) < 3 * len(body)  # body + <= its budget
    flat = b"\x92\xa1x\xdd" + struct.pack(">I", 1 << 24) + b"\xc0" * (1 << 24)  # 16 Mi None
    with pytest.raises(ProtocolError, match="exceeds max_array_len"):
        Codec().decode(HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, 0, 0) + flat)


def test_skippable_zstd_frame_is_refused() -> None:
    """A skippable frame reads as content size 0, yet python-zstandard allocates its
    declared skip size (up to 4 GiB) before finding no data: refused on its magic."""
    skip = struct.pack("<II", 0x184D2A50, 0xFFFFFFF0) + bytes(64)
    frame = HEADER.pack(MAGIC, PROTOCOL_MAJOR, PROTOCOL_MINOR, FLAG_ZSTD, 0) + skip
    with pytest.raises(ProtocolError, match="zstd magic"):
        Codec().decode(frame)
    assert traced_peak(lambda: Codec().decode(frame)) < 64 << 10


def test_encode_refuses_a_body_its_receiver_would_not_decompress() -> None:
    r = _rollout(4000)  # compresses well below 4 KiB, but its body is larger
    codec = Codec(level=1, max_frame_bytes=1 << 20, max_message_bytes=4096)
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes 4096; split it"):
        codec.encode(r)
    big = Codec(level=1, max_message_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes 4096"):
        codec.decode(big.encode(r))


def test_zstd_without_content_size_is_refused() -> None:
    import zstandard

    body = msgpack.packb(["goodbye", {"sender_id": "g", "reason": "x"}])
    z = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    payload = z.compress(body) + z.flush()
    with pytest.raises(ProtocolError, match="content size"):
        Codec().decode(HEADER.pack(MAGIC, 1, 0, 1, 0) + payload)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: setattr(r, "logprobs", r.logprobs[:-1]), "logprobs has 7 entries for 8 tokens"),
        (lambda r: setattr(r, "exit_depths", np.zeros(8, np.uint8)), "exit_depths must be in"),
        (lambda r: setattr(r, "logprobs", np.full(8, 0.5, np.float32)), "logprobs must be <= 0"),
        (lambda r: setattr(r, "finish_reason", "tired"), "finish_reason 'tired'"),
        (lambda r: setattr(r, "latent_seed", -1), "latent_seed must be a uint64"),
        (lambda r: setattr(r, "prompt_tokens", np.zeros(0, np.int32)), "prompt_tokens"),
    ],
)
def test_invalid_rollout_is_refused_with_a_clear_message(mutate, message) -> None:  # type: ignore[no-untyped-def]
    r = _rollout()
    mutate(r)
    codec = Codec()
    with pytest.raises(ProtocolError, match=message):
        codec.decode(codec.encode(r))


def test_wrong_field_type_names_the_field() -> None:
    body = msgpack.packb(
        ["heartbeat", {"sender_id": "g", "sent_at": 1.0, "weight_version": "3", "inflight": 0}]
    )
    with pytest.raises(ProtocolError, match=r"heartbeat\.weight_version: expected an int, got str"):
        Codec(level=0).decode(HEADER.pack(MAGIC, 1, 0, 0, 0) + body)


def test_tensor_shape_must_match_bytes() -> None:
    codec = Codec(level=0)
    w = records.WorkItem(
        work_id="a",
        prompt_id="b",
        prompt_tokens=np.arange(4, dtype=np.int32),
        latent_seeds=np.array([1], np.uint64),
    )
    wire = msgpack.unpackb(codec.encode_body(w))
    wire[1]["prompt_tokens"]["sh"] = [5]
    frame = HEADER.pack(MAGIC, 1, 0, 0, 0) + msgpack.packb(wire)
    with pytest.raises(
        ProtocolError, match=r"work\.prompt_tokens: \d+ data bytes do not match shape \[5\]"
    ):
        codec.decode(frame)


def test_no_pickle_anywhere() -> None:
    import pathlib

    for p in pathlib.Path("proto").glob("*.py"):
        assert "pickle" not in p.read_text().replace("never pickle", "").replace(
            "unpickled", ""
        ).lower().replace("never pickle", ""), p


def test_narrowing_and_shuffling_are_lossless_and_compress() -> None:
    rng = np.random.default_rng(0)
    t = 1024
    r = _rollout(t)
    r.tokens = np.minimum(rng.zipf(1.2, t), 65535).astype(np.int32)
    r.logprobs = np.log(rng.uniform(0.01, 1.0, t)).astype(np.float32)
    codec = Codec(level=1)
    frame = codec.encode(r)
    payload = len(
        msgpack.packb([r.tokens.tobytes(), r.logprobs.tobytes(), r.exit_depths.tobytes()])
    )
    assert payload / len(frame) > 1.3
    assert_same(codec.decode(frame), r)
    assert struct.unpack_from("<B", frame, 6)[0] == 1  # compressed


def test_weight_announce_collective_round_trips_and_is_validated() -> None:
    """Protocol 1.2: WeightAnnounce.collective (publish.transport=collective)."""
    info: dict[str, bool | int | float | str | None] = {
        "store": "10.0.0.5:29610", "round": "v3/r7", "backend": "gloo", "timeout_s": 5.0
    }  # fmt: skip
    ann = records.WeightAnnounce(3, "a" * 64, 12, 0, 0, collective=info)
    codec = Codec()
    back = codec.decode(codec.encode(ann))
    assert back == ann and back.collective == info
    for bad, message in (
        ({**info, "store": ""}, "collective.store must be a non-empty string"),
        ({k: v for k, v in info.items() if k != "round"}, "collective.round"),
        ({**info, "timeout_s": 0}, "collective.timeout_s must be a number > 0"),
        ({**info, "timeout_s": "5"}, "collective.timeout_s"),
    ):
        wrong = dataclasses.replace(ann, collective=bad)
        with pytest.raises(ProtocolError, match=message):
            codec.decode(codec.encode(wrong))
    with_chunks = dataclasses.replace(ann, chunk_bytes=4, num_chunks=3)
    with pytest.raises(ProtocolError, match="collective with chunks or a path"):
        codec.decode(codec.encode(with_chunks))


def test_token_mask_round_trips_and_is_checked() -> None:
    """Protocol 1.6: Rollout.token_mask travels like the other optional arrays (single record
    and column batch) and must have one entry per token."""
    codec = Codec(level=0)
    mask = np.array([1, 1, 0, 0, 0, 1, 1, 1], np.uint8)
    conv = dataclasses.replace(_rollout(), token_mask=mask)
    for rec in (conv, RolloutBatch([_rollout(), conv])):
        got = codec.decode(codec.encode(rec))
        last = got.rollouts[-1] if isinstance(got, RolloutBatch) else got
        assert last.token_mask is not None and last.token_mask.dtype == np.uint8
        assert last.token_mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
        if isinstance(got, RolloutBatch):
            assert got.rollouts[0].token_mask is None
    with pytest.raises(ProtocolError, match=r"token_mask has 3 entries for 8 tokens"):
        codec.decode(codec.encode(dataclasses.replace(_rollout(), token_mask=mask[:3])))


def test_exit_logprobs_round_trip_and_are_checked() -> None:
    """Protocol 1.7: Rollout.exit_logprobs (a sampled exit's log-probability per token)
    travels like the other optional arrays, one entry per token, each <= 0 and not NaN."""
    codec = Codec(level=0)
    elp = np.array([-0.5, -1.25, 0.0, -3.0, -0.1, -0.7, -2.0, -0.3], np.float32)
    roll = dataclasses.replace(_rollout(), exit_logprobs=elp)
    for rec in (roll, RolloutBatch([_rollout(), roll])):
        got = codec.decode(codec.encode(rec))
        last = got.rollouts[-1] if isinstance(got, RolloutBatch) else got
        assert last.exit_logprobs is not None and last.exit_logprobs.dtype == np.float32
        assert np.array_equal(last.exit_logprobs, elp)
        if isinstance(got, RolloutBatch):
            assert got.rollouts[0].exit_logprobs is None
    with pytest.raises(ProtocolError, match=r"exit_logprobs has 3 entries for 8 tokens"):
        codec.decode(codec.encode(dataclasses.replace(_rollout(), exit_logprobs=elp[:3])))
    for bad in (0.5, np.nan):
        e = elp.copy()
        e[2] = bad
        for rec in (dataclasses.replace(_rollout(), exit_logprobs=e),
                    RolloutBatch([dataclasses.replace(_rollout(), exit_logprobs=e)])):  # fmt: skip
            with pytest.raises(ProtocolError, match="exit_logprobs must be <= 0 and not NaN"):
                codec.decode(codec.encode(rec))


def test_stream_recorded_before_1_6_still_reads(tmp_path: object) -> None:
    """A 1.5 stream (frames of minor 5: no token_mask field, no token_mask / has_token_mask
    columns) decodes with token_mask None and every other field intact."""
    from pathlib import Path

    from pipeline.core.recorder import read_rollouts
    from proto.batch import encode_batch
    from proto.schema import to_wire
    from proto.stream.writer import StreamWriter

    assert PROTOCOL_MINOR == 12  # 1.8-1.12: Welcome and WeightAnnounce fields, no rollout field
    a, b = _rollout(5), dataclasses.replace(_rollout(3), rollout_id="w/1", sample_index=1)
    cols = msgpack.unpackb(msgpack.packb(encode_batch(RolloutBatch([a, b]))))
    single = to_wire(dataclasses.replace(a, rollout_id="w/2", sample_index=2))
    for name in ("token_mask", "exit_logprobs"):  # 1.6 and 1.7 added these
        assert {name, f"has_{name}"} <= set(cols) and name in single
        del cols[name], cols[f"has_{name}"], single[name]
    root = Path(str(tmp_path)) / "stream"
    with StreamWriter(root) as w:  # the recorder's layout: one RolloutBatch frame per record
        w.append(HEADER.pack(MAGIC, 1, 5, 0, 0) + msgpack.packb(["rollouts", cols]))
    got = [r for _, r in read_rollouts(root)]
    got.append(Codec().decode(HEADER.pack(MAGIC, 1, 5, 0, 0) + msgpack.packb(["rollout", single])))
    assert [r.rollout_id for r in got] == ["w/0", "w/1", "w/2"]
    assert all(r.token_mask is None for r in got)
    assert [r.num_tokens for r in got] == [5, 3, 5]
    assert_same(got[0], a)
    assert_same(got[1], b)


def test_welcome_states_the_exit_policy_as_a_typed_map() -> None:
    """1.8: Welcome.exit_policy is a map of scalars (models.exits.policy_to_dict's form, {} =
    full depth) that round trips as a map; a 1.7 Welcome (no such field, the policy as JSON text
    in its settings) decodes with exit_policy None; a nested value is refused, naming the field."""
    codec = Codec(level=0)
    gate = {"kind": "ouro_gate", "q": 0.8, "min_depth": 1, "max_depth": None, "kv": "full"}
    for policy in (gate, {}):
        w = records.Welcome("run", "g", 3, 1.0, {"numerics": "fast"}, exit_policy=policy)
        got = codec.decode(codec.encode(w))
        assert isinstance(got, records.Welcome) and got.exit_policy == policy and got == w
    old = {
        "run_id": "run",
        "generator_id": "g",
        "weight_version": 3,
        "heartbeat_interval_s": 1.0,
        "settings": {"numerics": "fast", "exit_policy": '{"kind": "fixed", "depth": 4}'},
    }
    got = codec.decode(HEADER.pack(MAGIC, 1, 7, 0, 0) + msgpack.packb(["welcome", old]))
    assert got.exit_policy is None and got.settings["exit_policy"] == old["settings"]["exit_policy"]
    for bad in ({"kind": "fixed", "depth": [4]}, {"kind": {"fixed": 4}}):
        frame = HEADER.pack(MAGIC, 1, PROTOCOL_MINOR, 0, 0) + msgpack.packb(
            ["welcome", {**old, "exit_policy": bad}]
        )
        with pytest.raises(ProtocolError, match=r"welcome\.exit_policy"):
            codec.decode(frame)
