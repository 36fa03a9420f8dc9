"""weights.digest: the weight digest (tree and flat kinds) and the weight blob layout."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
import torch

from proto.records import DIGEST_KINDS, TensorMeta, WeightAnnounce
from weights import digest as dg
from weights.check import WeightsRefused
from weights.digest import (
    blob_and_meta,
    canonical_digest,
    digest_from_blob,
    state_from_blob,
    tensor_bytes,
)
from weights.verified import VerifiedWeights


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


def test_verified_weights_are_views_that_hash_to_the_receivers_digest() -> None:
    """The views VerifiedWeights builds of a verified blob (the one decoder, state_from_blob
    without a copy) hash to the digest the receiver checked, which it carries as is."""
    state = _state()
    blob, meta = blob_and_meta(state)
    digest = digest_from_blob(blob, meta)
    ann = WeightAnnounce(1, digest, len(blob), 0, 0, [TensorMeta(**m) for m in meta])
    buf = bytearray(blob)
    src = VerifiedWeights.of_blob(ann, buf)
    assert src.digest == digest and src.version == 1 and src.directory == ""
    views = src.state()
    assert canonical_digest(views) == digest == canonical_digest(state)
    assert all(torch.equal(views[k], state[k]) for k in state)
    buf[meta[-1]["offset"]] ^= 1  # views of the blob, not copies
    last = meta[-1]["name"]
    assert not torch.equal(views[last], state[last]) or state[last].numel() == 0
    with pytest.raises(WeightsRefused, match="!= announced"):  # and nothing else is handed out
        VerifiedWeights.of_blob(ann, buf)


def test_tree_digest_documented_layout() -> None:
    """docs/CONTRACTS.md 6: sha256 over tag, chunk size, length, the header leaf and the ordered
    sha256 of fixed-size pieces of the canonical bytes (sorted-name order)."""
    st = {"w": torch.tensor([[1.0, -2.0]]), "b": torch.arange(3, dtype=torch.int16)}
    raw = tensor_bytes(st["b"]) + tensor_bytes(st["w"])  # 6 + 8 bytes, sorted by name
    head = hashlib.sha256(
        b"b\0int16\x003\0"
        + (6).to_bytes(8, "little")
        + b"w\0float32\x001,2\0"
        + (8).to_bytes(8, "little")
    ).digest()
    leaves = [hashlib.sha256(raw[i : i + 4]).digest() for i in range(0, 14, 4)]  # 4 pieces
    want = hashlib.sha256(b"looprl-weights-tree/1\0" + (4).to_bytes(8, "little")
                          + (14).to_bytes(8, "little") + head + b"".join(leaves)).hexdigest()  # fmt: skip
    got = dg.tree_digest(st, chunk_bytes=4)
    assert got.hex == want and got.kind == dg.TREE == "sha256-tree" and got.chunk_bytes == 4
    assert got.chunks == tuple(x.hex() for x in leaves)
    blob, meta = blob_and_meta(st)
    assert dg.weights_digest(blob, meta, dg.TREE, 4) == got  # from the blob: the same, leaves too
    assert dg.digest_of_state(st, dg.TREE, 4) == want
    assert got.record() == {"digest": want, "digest_kind": "sha256-tree", "digest_chunk_bytes": 4}
    # the chunk size is part of the digest; the flat kind is another digest of the same set
    assert dg.tree_digest(st, chunk_bytes=5).hex != want != canonical_digest(st)
    assert dg.KINDS == DIGEST_KINDS[1:3]  # proto spells the kinds the same way
    from weights.device_digest import KIND

    assert DIGEST_KINDS[3] == KIND == "mix128"  # and the device kind


def test_tree_digest_in_parallel_equals_serial_and_names_its_pieces() -> None:
    """The pieces are hashed on the thread pool: same leaves as one thread, in order, for a
    set whose tensors straddle piece boundaries; a flipped bit changes one leaf only."""
    state = _state()
    blob, meta = blob_and_meta(state)
    d = dg.weights_digest(blob, meta, dg.TREE, 7)
    serial = [hashlib.sha256(blob[i : i + 7]).hexdigest() for i in range(0, len(blob), 7)]
    assert list(d.chunks) == serial and len(serial) > 8
    assert dg.tree_digest(state, 7) == d
    bad = bytearray(blob)
    bad[30] ^= 1
    d2 = dg.weights_digest(bad, meta, dg.TREE, 7)
    assert [i for i, (x, y) in enumerate(zip(d.chunks, d2.chunks)) if x != y] == [30 // 7]
    assert d2.hex != d.hex
    z_first = [dict(m, name="z" + m["name"]) if i == 0 else m for i, m in enumerate(meta)]
    with pytest.raises(ValueError, match="sorted-name order"):  # the blob is not canonical
        dg.weights_digest(blob, z_first, dg.TREE, 7)
    with pytest.raises(ValueError, match="digest_kind 'md5'"):
        dg.digest_of_state(state, "md5")


RECORDED_FLAT = "57c3aabee0148180407196a3493c31a0536c39b35e9b3d94ea3399b10534ca9d"
"""The digest of `_recorded_state()` as models/digest.py computed it before the tree (commit
91ed606): a run recorded then has this in weights/digests.jsonl, with no digest_kind."""


def _recorded_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "c": torch.randn(3, generator=g).to(torch.bfloat16)}  # fmt: skip


def test_recorded_old_kind_digest_still_verifies(tmp_path: Any) -> None:
    """A digest recorded before the tree (kind absent, "" or "sha256") verifies through every
    reader: the digest of a state, a publication's digest_as (replay), a manifest without
    digest_kind (verify_publication) and an on-disk announce the engine reads."""
    from models.checkpoint import save_checkpoint
    from weights.publication import Publication, read_manifest, verify_publication

    state = _recorded_state()
    for kind in ("", "sha256"):
        assert dg.digest_of_state(state, kind) == RECORDED_FLAT
    pub = Publication.of_state(state, 1, None)
    assert pub.digest_kind == dg.TREE and pub.digest != RECORDED_FLAT
    assert pub.digest_as("") == RECORDED_FLAT  # replay of a recorded run compares this
    assert pub.digest_as(dg.TREE, dg.DEFAULT_CHUNK_BYTES) == pub.digest
    old = {"format": "looprl-weights/1", "version": 1, "digest": RECORDED_FLAT, "tied": {},
           "tensors": pub.tensors}  # fmt: skip
    save_checkpoint(
        state, {"model_type": "llama"}, tmp_path / "v1", extra_files={"manifest.json": old}
    )
    assert "digest_kind" not in read_manifest(tmp_path / "v1")
    assert verify_publication(tmp_path / "v1") == RECORDED_FLAT
    new = pub.manifest()
    save_checkpoint(
        state, {"model_type": "llama"}, tmp_path / "v2", extra_files={"manifest.json": new}
    )
    assert verify_publication(tmp_path / "v2") == pub.digest
    # an on-disk announce with no kind: the engine's read hashes the files flat
    ann = WeightAnnounce(1, RECORDED_FLAT, 0, 0, 0, path=str(tmp_path / "v1"))
    assert VerifiedWeights.of_directory(ann).state().keys() == state.keys()
    tree = WeightAnnounce(2, pub.digest, 0, 0, 0, path=str(tmp_path / "v2"),
                          digest_kind=dg.TREE, digest_chunk_bytes=dg.DEFAULT_CHUNK_BYTES)  # fmt: skip
    assert VerifiedWeights.of_directory(tree).state().keys() == state.keys()
    flat_for_tree = WeightAnnounce(2, RECORDED_FLAT, 0, 0, 0, path=str(tmp_path / "v2"),
                                   digest_kind=dg.TREE, digest_chunk_bytes=dg.DEFAULT_CHUNK_BYTES)  # fmt: skip
    with pytest.raises(WeightsRefused, match=f"digest {pub.digest} does not match"):
        VerifiedWeights.of_directory(flat_for_tree).state()  # hashed with the announced kind


def test_bad_blobs_are_rejected() -> None:
    blob, meta = blob_and_meta(_state())
    with pytest.raises(ValueError, match="covers"):
        state_from_blob(bytes(blob) + b"\0", meta)
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
