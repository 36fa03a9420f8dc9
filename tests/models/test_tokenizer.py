"""The locally built tokenizer loads offline in transformers (and vLLM) and round-trips text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from models.tokenizer import (
    BOS_ID,
    EOS_ID,
    MIN_VOCAB_SIZE,
    PAD_ID,
    TOKENIZER_FILES,
    build_tokenizer,
    tokenizer_files,
)

TEXTS = ["12+7=19", "the answer is 42", "Héllo,  wörld!\n\tx = (3*4) - 5; ok?"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 512, 1000])
def test_loads_with_autotokenizer_and_has_exact_vocab(tmp_path: Path, vocab_size: int) -> None:
    out = build_tokenizer(tmp_path / "tok", vocab_size=vocab_size)
    assert sorted(p.name for p in out.iterdir()) == sorted(TOKENIZER_FILES)
    tok = load(out)
    assert len(tok) == vocab_size
    assert max(tok.get_vocab().values()) == vocab_size - 1
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)


def test_encode_decode_round_trip(tmp_path: Path) -> None:
    tok = load(build_tokenizer(tmp_path / "tok"))
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID and all(0 <= i < 512 for i in ids)
        assert EOS_ID not in ids and PAD_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    digits = tok.convert_ids_to_tokens(tok("12+7=19")["input_ids"])
    assert digits == ["<|bos|>", "1", "2", "+", "7", "=", "1", "9"]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|pad|>", "<|bos|>", "<|eos|>"]
    ids = tok("the answer is 42", add_special_tokens=False)["input_ids"] + [EOS_ID]
    assert tok.decode(ids) == "the answer is 42<|eos|>"


def test_batch_padding_uses_pad_id(tmp_path: Path) -> None:
    tok = load(build_tokenizer(tmp_path / "tok"))
    batch = tok(["1+1=2", "the answer is 42"], padding=True)
    short, long = batch["input_ids"]
    assert len(short) == len(long) and short[0] == PAD_ID  # left padding
    assert batch["attention_mask"][0][0] == 0


def test_same_size_gives_same_bytes_and_bad_size_is_refused(tmp_path: Path) -> None:
    assert tokenizer_files(512) == tokenizer_files(512)
    build_tokenizer(tmp_path / "a")
    for name, data in tokenizer_files(512).items():
        assert (tmp_path / "a" / name).read_bytes() == data
    for bad in [MIN_VOCAB_SIZE - 1, 0, 512.0]:
        with pytest.raises(ValueError, match=f"vocab_size must be an int >= {MIN_VOCAB_SIZE}"):
            tokenizer_files(bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_vllm_loads_it(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.decode(tok.encode("12+7=19"), skip_special_tokens=True) == "12+7=19"
