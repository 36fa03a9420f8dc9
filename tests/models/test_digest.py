"""models.digest: the canonical weight digest and the weight blob layout."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from models.digest import (
    DigestedState,
    blob_and_meta,
    canonical_digest,
    digest_from_blob,
    state_digest,
    state_from_blob,
    tensor_bytes,
)
from proto.records import TensorMeta, WeightAnnounce


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.weight": torch.randn(4, 3, generator=gen),
        "lm_head.weight": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "freqs_cis": torch.randn(1, 6, 1, 2, 2, generator=gen),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "ids": torch.arange(7, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "half": torch.randn(3, generator=gen).half(),
    }


def test_documented_byte_layout() -> None:
    t = torch.tensor([[1.0, -2.0]], dtype=torch.float32)
    raw = struct.pack("<2f", 1.0, -2.0)
    assert tensor_bytes(t) == raw
    want = hashlib.sha256(b"w\0float32\x001,2\0" + (8).to_bytes(8, "little") + raw).hexdigest()
    assert canonical_digest({"w": t}) == want
    scalar = torch.tensor(1.0)
    head = b"s\0float32\0\0" + (4).to_bytes(8, "little")
    assert (
        canonical_digest({"s": scalar}) == hashlib.sha256(head + struct.pack("<f", 1.0)).hexdigest()
    )


def test_bf16_is_its_raw_two_byte_pattern() -> None:
    x = torch.tensor([1.0, -0.5, 3.140625], dtype=torch.bfloat16)
    bits = [int(b) for b in x.view(torch.int16).tolist()]
    assert tensor_bytes(x) == struct.pack("<3h", *bits)
    assert len(tensor_bytes(x)) == 6


def test_non_contiguous_tensors_use_row_major_order() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_bytes(x.t()) == tensor_bytes(x.t().contiguous())
    assert canonical_digest({"a": x.t()}) == canonical_digest({"a": x.t().contiguous()})


def test_digest_is_stable_across_dict_order() -> None:
    state = _state()
    reordered = dict(reversed(list(state.items())))
    assert list(reordered) != list(state)
    assert canonical_digest(state) == canonical_digest(reordered)
    assert len(canonical_digest(state)) == 64


@pytest.mark.parametrize("name", sorted(k for k, v in _state().items() if v.numel()))
def test_one_flipped_bit_changes_the_digest(name: str) -> None:
    state = _state()
    base = canonical_digest(state)
    t = state[name]
    flat = t.clone().reshape(-1).view(torch.uint8)
    flat[0] ^= 1
    state[name] = flat.view(t.dtype).reshape(t.shape)
    assert canonical_digest(state) != base


def test_name_dtype_and_shape_are_part_of_the_digest() -> None:
    x = torch.arange(6, dtype=torch.float32)
    base = canonical_digest({"a": x})
    assert canonical_digest({"b": x}) != base
    assert canonical_digest({"a": x.reshape(2, 3)}) != base
    assert canonical_digest({"a": x.view(torch.int32)}) != base


def test_blob_round_trip_is_bit_exact() -> None:
    state = _state()
    blob, meta = blob_and_meta(state)
    assert [m["name"] for m in meta] == sorted(state)
    assert sum(m["nbytes"] for m in meta) == len(blob)
    back = state_from_blob(blob, meta)
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)
    assert digest_from_blob(blob, meta) == canonical_digest(state) == canonical_digest(back)
    mutable = bytearray(blob)
    owned = state_from_blob(mutable, meta)
    mutable[:] = bytes(len(mutable))  # the tensors own their memory, not views of the blob
    assert all(torch.equal(owned[n], t) for n, t in state.items())
    # the metadata is proto's TensorMeta; an announce built from it validates
    metas = [TensorMeta(**m) for m in meta]
    assert digest_from_blob(bytearray(blob), metas) == canonical_digest(state)
    ann = WeightAnnounce(1, canonical_digest(state), len(blob), 16, -(-len(blob) // 16), metas)
    ann.validate()


def test_generator_weights_source_carries_the_receivers_digest() -> None:
    """The views generator.protocols.weights_source builds of a verified blob hash to the
    digest the receiver checked (digest_from_blob), which state_digest then returns as is."""
    from types import SimpleNamespace

    from generator.protocols import weights_source

    state = _state()
    blob, meta = blob_and_meta(state)
    digest = digest_from_blob(blob, meta)
    ann = SimpleNamespace(version=1, digest=digest, tensors=[TensorMeta(**m) for m in meta])
    src = weights_source(SimpleNamespace(announce=ann, blob=bytearray(blob)))
    assert isinstance(src, DigestedState) and state_digest(src) == digest
    assert canonical_digest(dict(src)) == digest == canonical_digest(state)
    assert all(torch.equal(src[k], state[k]) for k in state)
    assert state_digest(dict(src)) == digest  # a plain mapping: hashed
    assert state_digest(DigestedState(src, "f" * 64)) == "f" * 64  # the receiver's, not hashed


def test_bad_blobs_are_rejected() -> None:
    blob, meta = blob_and_meta(_state())
    with pytest.raises(ValueError, match="covers"):
        state_from_blob(blob + b"\0", meta)
    with pytest.raises(ValueError, match="past the blob"):
        state_from_blob(blob[:-1], meta)
    corrupt = bytearray(blob)
    corrupt[0] ^= 0xFF
    with pytest.raises(ValueError, match="sha256"):
        state_from_blob(bytes(corrupt), meta)
    assert state_from_blob(bytes(corrupt), meta, verify=False).keys() == set(
        m["name"] for m in meta
    )
    bad = [dict(m) for m in meta]
    bad[0]["dtype"] = "complex_nonsense"
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        digest_from_blob(blob, bad)
    bad = [dict(m) for m in meta]
    bad[1]["shape"] = [999]
    with pytest.raises(ValueError, match="needs"):
        digest_from_blob(blob, bad)
