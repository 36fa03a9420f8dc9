"""Prompts the way a checkpoint expects them: its tokenizer, its chat template, its EOS ids.

``ChatRenderer.from_checkpoint(DIR)`` reads, from the model directory:

    tokenizer.json          the fast tokenizer (the `tokenizers` library; no transformers)
    chat_template.jinja     the chat template, if present (newer transformers save it there)
    tokenizer_config.json   else its "chat_template" (a string, or a list of {name, template}:
                            the one named "default"); special tokens; add_bos/eos_token
    generation_config.json  eos_token_id (int or list): the ids that end a completion
    config.json             eos_token_id, when generation_config.json has none

and renders one prompt (a string, or chat messages [{"role", "content"}]) into token ids:

- chat template: messages := [system prompt] + the prompt's messages (or one user message),
  the instruction suffix appended to the last user message; the template is rendered with
  Jinja2 as transformers' ``apply_chat_template(..., add_generation_prompt=True)`` does
  (sandboxed, trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``,
  ``strftime_now``, the special tokens as variables) and encoded without adding special
  tokens (a template writes its own BOS);
- plain (no template, or ``template="plain"``): system prompt, a blank line, the prompt
  text and the suffix, encoded with the tokenizer's own special tokens (its post-processor,
  then ``add_bos_token`` / ``add_eos_token`` of tokenizer_config.json when it sets them).

Invariant: for a checkpoint with a chat template, ``render(messages)`` gives the ids of
``AutoTokenizer.from_pretrained(DIR).apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)`` (tests/tasks/test_chat.py checks it on the same files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATES = ("auto", "chat", "plain")
_TURN = "\x00looprl-turn\x00"  # placeholder of a model turn (models.chat.continuation)
Message = Mapping[str, Any]


class ChatError(ValueError):
    """A checkpoint cannot render prompts as asked, or a prompt is malformed."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ChatError(f"{path}: not readable JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def chat_template_of(model_dir: str | Path) -> str | None:
    """The checkpoint's chat template text, or None if it has none (see the module doc)."""
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    raw = _read_json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    return raw if isinstance(raw, str) and raw.strip() else None


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The ids that end a completion: generation_config.json's eos_token_id, else
    config.json's, else the tokenizer's eos_token; [] when none is declared."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        raw = _read_json(d / name).get("eos_token_id")
        if isinstance(raw, int) and not isinstance(raw, bool):
            return [raw]
        if isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
            return sorted(set(raw))
    eos = _token_text(_read_json(d / "tokenizer_config.json").get("eos_token"))
    if eos is not None and (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tid = Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(eos)
        return [] if tid is None else [int(tid)]
    return []


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise ChatError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template does not compile: {e}") from e


@dataclass
class ChatRenderer:
    """Renders prompts into token ids for one checkpoint (see the module doc)."""

    tokenizer: Any
    """A ``tokenizers.Tokenizer``."""
    template: str | None
    """The chat template, or None to render plain text."""
    special: dict[str, str] = field(default_factory=dict)
    """Special tokens by name (bos_token, eos_token, ...), as the template sees them."""
    add_bos: bool | None = None
    """tokenizer_config.json add_bos_token (plain text only; None: the post-processor decides)."""
    add_eos: bool | None = None
    """tokenizer_config.json add_eos_token (plain text only; None: the post-processor decides)."""
    system_prompt: str = ""
    """Put first, as a system message (chat) or a paragraph (plain); empty: none."""
    suffix: str = ""
    """Appended to the (last) user message, e.g. an instruction on the answer format."""

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, *, template: str = "auto", system_prompt: str = "",
        suffix: str = "",
    ) -> ChatRenderer:  # fmt: skip
        """``template``: auto (the checkpoint's chat template if it has one, else plain),
        chat (its chat template; ChatError without one) or plain."""
        if template not in TEMPLATES:
            raise ChatError(f"template {template!r} must be one of {TEMPLATES}")
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ChatError(
                f"{d}: no tokenizer.json (a fast tokenizer is needed to render prompts)"
            )
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        text = None if template == "plain" else chat_template_of(d)
        if template == "chat" and text is None:
            raise ChatError(
                f"{d}: no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use template 'plain' or 'auto'"
            )
        cfg = _read_json(d / "tokenizer_config.json")
        special = {**_read_json(d / "special_tokens_map.json"), **cfg}
        names = {k: _token_text(v) for k, v in special.items() if k.endswith("_token")}
        flags = {k: cfg.get(k) for k in ("add_bos_token", "add_eos_token")}
        return cls(tok, text, {k: v for k, v in names.items() if v is not None},
                   flags["add_bos_token"] if isinstance(flags["add_bos_token"], bool) else None,
                   flags["add_eos_token"] if isinstance(flags["add_eos_token"], bool) else None,
                   system_prompt, suffix)  # fmt: skip

    def messages(self, prompt: str | Sequence[Message]) -> list[dict[str, Any]]:
        """The conversation to render: system prompt, then the prompt (a user message or the
        given messages), the suffix appended to the last user message."""
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        else:
            msgs = [dict(m) for m in prompt]
            for i, m in enumerate(msgs):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ChatError(
                        f"message {i} is {m!r}: expected {{'role': str, 'content': str}}"
                    )
        if self.system_prompt and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        if self.suffix:
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            if not users:
                raise ChatError("the prompt has no user message to append the suffix to")
            msgs[users[-1]]["content"] += self.suffix
        return msgs

    def text(self, prompt: str | Sequence[Message]) -> str:
        """The prompt as the model reads it (before tokenization)."""
        msgs = self.messages(prompt)
        if self.template is not None:
            return str(_compile(self.template).render(
                messages=msgs, add_generation_prompt=True, **self.special
            ))  # fmt: skip
        parts = [m["content"] for m in msgs]
        return "\n\n".join(parts)

    def render(self, prompt: str | Sequence[Message]) -> list[int]:
        """Token ids of the prompt (see the module doc)."""
        text = self.text(prompt)
        if self.template is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        for flag, name, at in ((self.add_bos, "bos_token", 0), (self.add_eos, "eos_token", -1)):
            tid = (
                self.tokenizer.token_to_id(self.special.get(name, "")) if flag is not None else None
            )
            if tid is None:
                continue
            has = bool(ids) and ids[at] == tid
            if flag and not has:
                ids = [tid, *ids] if at == 0 else [*ids, tid]
            elif not flag and has:
                ids = ids[1:] if at == 0 else ids[:-1]
        return ids

    def conversation_text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """``messages`` as the chat template writes them (no system prompt or suffix added)."""
        if self.template is None:
            raise ChatError("conversation_text needs a chat template")
        return str(_compile(self.template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=generation_prompt,
            **self.special,
        ))  # fmt: skip

    def continuation(
        self, observation: str | Sequence[Message], sampled: Sequence[int]
    ) -> list[int]:
        """Token ids to append after a model turn whose sampled ids are ``sampled``: the end of
        the assistant turn that the model did not sample itself (its end-of-turn token, when
        the turn stopped for length), the observation's messages (text: one user message) and
        the generation prompt; earlier ids are never re-tokenized (token in, token out).

        Chat template: the text the template adds between an assistant message and the
        generation prompt after ``observation``, found by rendering a placeholder conversation
        with and without it (ChatError when the longer one does not extend the shorter: a
        template that rewrites earlier turns cannot be rendered incrementally). Plain: a blank
        line, the observation's contents (blank-line separated), a blank line."""
        msgs = (
            [{"role": "user", "content": observation}]
            if isinstance(observation, str)
            else [dict(m) for m in observation]
        )
        for i, m in enumerate(msgs):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ChatError(f"observation message {i} is {m!r}: expected {{'role', 'content'}}")
        if self.template is None:
            text = "\n\n" + "\n\n".join(m["content"] for m in msgs) + "\n\n"
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _TURN}]
        before = self.conversation_text(base, generation_prompt=False)
        after = self.conversation_text(base + msgs, generation_prompt=True)
        if not after.startswith(before):
            raise ChatError(
                "the chat template rewrites earlier turns when a message is added: it cannot "
                "be rendered incrementally (token-in-token-out needs a template that appends)"
            )
        end = before[before.index(_TURN) + len(_TURN) :]
        if sampled:  # the model sampled the end-of-turn token itself: not written twice
            last = str(self.tokenizer.decode([int(sampled[-1])], skip_special_tokens=False))
            if last and end.startswith(last):
                end = end[len(last) :]
        text = end + after[len(before) :]
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of completion ids, special tokens skipped (as the generator hands rewards)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
