"""Prompt rendering (models/chat.py) against transformers' own ``apply_chat_template`` on the
same files, EOS ids, and the tiny tokenizer at every vocabulary size (models/tokenizer.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from models.chat import ChatError, ChatRenderer, chat_template_of, eos_token_ids
from models.tokenizer import (
    BOS_ID,
    BYTE_LEVEL_MIN,
    CHAT_TEMPLATE,
    EOS_ID,
    MIN_VOCAB_SIZE,
    build_tokenizer,
)

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|bos|>system\nBe brief.<|eos|>\n{% endif %}"
    "<|bos|>{{ message['role'] }}\n{{ message['content'] | trim }}<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
"""A second template in the style of ChatML: loops, filters, a default system message."""

CONVERSATIONS: list[Any] = [
    "What is 3 + 4?",
    [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
    [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "84"},
        {"role": "user", "content": "  And 84 / 4?  "},
    ],
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def hf_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def with_template(src: Path, dst: Path, template: Any, *, jinja: bool = False) -> Path:
    build_tokenizer(dst, 512) if not dst.exists() else None
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    if jinja:
        cfg.pop("chat_template")
        (dst / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("vocab", [512, 120])
@pytest.mark.parametrize("which", ["builtin", "chatml", "list", "jinja_file"])
def test_render_matches_transformers_apply_chat_template(
    tmp_path: Path, vocab: int, which: str
) -> None:
    d = build_tokenizer(tmp_path / "tok", vocab)
    if which == "chatml":
        with_template(d, d, CHATML)
    elif which == "list":
        with_template(d, d, [{"name": "tool_use", "template": "x"},
                             {"name": "default", "template": CHATML}])  # fmt: skip
    elif which == "jinja_file":
        with_template(d, d, CHATML, jinja=True)
    renderer = ChatRenderer.from_checkpoint(d, template="chat")
    assert renderer.template == (CHAT_TEMPLATE if which == "builtin" else CHATML)
    for conv in CONVERSATIONS:
        msgs = renderer.messages(conv)
        ids = renderer.render(conv)
        assert ids == hf_ids(d, msgs), (which, conv)
        assert ids[0] == BOS_ID and ids.count(BOS_ID) == (
            1 if which == "builtin" else ids.count(BOS_ID)
        )
        assert all(0 <= i < vocab for i in ids)


def test_builtin_template_text_system_prompt_and_suffix(tmp_path: Path) -> None:
    d = build_tokenizer(tmp_path / "tok", 512)
    r = ChatRenderer.from_checkpoint(
        d, system_prompt="Solve it.", suffix=" Answer with #### and the number."
    )
    text = r.text("What is 2 + 2?")
    assert text == (
        "<|bos|>Solve it.\n\nUser: What is 2 + 2? Answer with #### and the number.\nAssistant:"
    )
    assert r.render("What is 2 + 2?") == hf_ids(d, r.messages("What is 2 + 2?"))
    given = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}]
    assert [m["content"] for m in r.messages(given)] == [
        "Own system.",
        "Hi Answer with #### and the number.",
    ]
    assert (
        r.decode(r.render("7"))
        == "Solve it.\n\nUser: 7 Answer with #### and the number.\nAssistant:"
    )


def test_plain_rendering_adds_bos_as_the_tokenizer_says(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = build_tokenizer(tmp_path / "tok", 512)
    r = ChatRenderer.from_checkpoint(d, template="plain", system_prompt="Be brief.")
    hf = AutoTokenizer.from_pretrained(str(d))
    assert r.text("What is 3 + 4?") == "Be brief.\n\nWhat is 3 + 4?"
    assert r.render("What is 3 + 4?") == hf("Be brief.\n\nWhat is 3 + 4?")["input_ids"]
    assert r.render("x")[0] == BOS_ID
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False,
                                                          "add_eos_token": True}))  # fmt: skip
    r2 = ChatRenderer.from_checkpoint(d, template="plain")
    ids = r2.render("3 + 4")
    assert ids[0] != BOS_ID and ids[-1] == EOS_ID
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert chat_template_of(d) is None
    assert ChatRenderer.from_checkpoint(d).template is None  # auto: plain without a template


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    d = build_tokenizer(tmp_path / "tok", 512)
    with pytest.raises(ChatError, match="must be one of"):
        ChatRenderer.from_checkpoint(d, template="fancy")
    with pytest.raises(ChatError, match="no tokenizer.json"):
        ChatRenderer.from_checkpoint(tmp_path)
    r = ChatRenderer.from_checkpoint(d, suffix="!")
    with pytest.raises(ChatError, match="message 0 is"):
        r.render([{"role": "user"}])
    with pytest.raises(ChatError, match="no user message"):
        r.render([{"role": "system", "content": "s"}])
    with pytest.raises(ChatError, match="unknown chat role: tool"):
        r.render([{"role": "tool", "content": "x"}, {"role": "user", "content": "y"}])
    with_template(d, d, "{% for m in messages %}")
    with pytest.raises(ChatError, match="does not compile"):
        ChatRenderer.from_checkpoint(d).render("x")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatError, match="no chat template"):
        ChatRenderer.from_checkpoint(d, template="chat")


def test_eos_ids_from_generation_config_then_config_then_tokenizer(tmp_path: Path) -> None:
    d = build_tokenizer(tmp_path / "tok", 512)
    assert eos_token_ids(d) == [EOS_ID]  # tokenizer_config's eos_token only
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(d) == [7]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 2, 9]}))
    assert eos_token_ids(d) == [2, 9]
    assert eos_token_ids(tmp_path / "nothing") == []


@pytest.mark.parametrize("vocab", [MIN_VOCAB_SIZE, 5, 29, 64, 100, 101, 200, BYTE_LEVEL_MIN - 1])
def test_tokenizer_at_every_small_vocab_loads_and_round_trips(tmp_path: Path, vocab: int) -> None:
    """Point 7: below 259 the tokenizer is character level, with exactly `vocab` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "t", vocab)))
    assert len(tok) == vocab and max(tok.get_vocab().values()) == vocab - 1
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, 0)
    assert tok.unk_token_id == vocab - 1
    text = "What is 12 + 7?\nIt is 19."
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and all(0 <= i < vocab for i in ids)
    if vocab >= 101:  # every printable ASCII character, space, newline and tab fit
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(ids) == 1 + len(text)
        assert tok("é")["input_ids"] == [BOS_ID, vocab - 1]  # anything else: <|unk|>
    if vocab >= 29:
        assert tok.convert_tokens_to_ids(list("0123456789")) == list(range(18, 28))
    else:
        assert set(ids[1:]) <= set(range(3, vocab))
