"""A small Hugging Face fast tokenizer built locally, for tiny test models (no downloads).

At every `vocab_size` >= 4 (`MIN_VOCAB_SIZE`), with every digit its own token (arithmetic
stays readable to the model) and "0".."9" at ids 18..27 whenever the vocabulary holds them:

- `vocab_size` >= 259 (`BYTE_LEVEL_MIN`): byte-level BPE (so any text round-trips) trained in
  code on `CORPUS`. Ids: 0 <|pad|>, 1 <|bos|>, 2 <|eos|>, 3.. the byte alphabet and BPE
  merges, then <|reserved_0|>, <|reserved_1|>, ... up to exactly `vocab_size` when the
  corpus supports fewer merges than asked for (special tokens, never produced from text).
- smaller: one token per character. Ids: 0 <|pad|>, 1 <|bos|>, 2 <|eos|>, then the
  printable ASCII characters "!".."~" in code-point order, space, newline, tab, as many as
  fit, then reserved tokens up to vocab_size - 1, and <|unk|> last (any other character).

Encoding prepends <|bos|>. tokenizer_config.json carries `CHAT_TEMPLATE` (plain-text roles,
``User: ...`` / ``Assistant: ...``; models/chat.py and transformers render it). The directory
holds tokenizer.json, tokenizer_config.json and special_tokens_map.json, which
`transformers.AutoTokenizer.from_pretrained` and vLLM load offline. Built with the
`tokenizers` library only (no `transformers` import here); the same `vocab_size` always gives
the same bytes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers import models as bpe_models

from models.checkpoint import json_bytes

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""In id order; bos 1 / eos 2 are what `models.config.tiny_config` declares."""
UNK_TOKEN = "<|unk|>"
BYTE_LEVEL_MIN = len(SPECIAL_TOKENS) + 256
"""Smallest vocabulary of the byte-level BPE (the 256 bytes and the special tokens)."""
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 1
"""Smallest vocabulary at all: the special tokens and <|unk|> (character level below 259)."""
CHARACTERS = [chr(c) for c in range(33, 127)] + [" ", "\n", "\t"]
"""Character-level alphabet in id order from id 3 ("0" lands on id 18, as in the BPE)."""
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""Jinja chat template written into tokenizer_config.json (transformers' convention)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

CORPUS = """\
The answer is 42. What is 12+7? 12+7=19, so the answer is 19.
Compute 3*4-5. First 3*4=12, then 12-5=7. The final answer is 7.
If a train travels 60 miles in 2 hours, its speed is 60/2=30 miles per hour.
Question: what is the sum of the first ten positive integers? Answer: 55.
Let x be a number such that 2x + 3 = 11. Then 2x = 8 and x = 4.
There are 24 hours in a day, 60 minutes in an hour and 60 seconds in a minute.
She bought three apples and two oranges; how many pieces of fruit did she buy?
We think step by step: the problem asks for the product, not the sum.
A prime number has exactly two divisors: one and itself. 2, 3, 5, 7, 11 and 13 are prime.
The quick brown fox jumps over the lazy dog, and the dog does not mind at all.
Please reason about the question, then write the final answer in a box.
Therefore the result is correct, because each step follows from the previous one.
The area of a rectangle with width 5 and height 8 is 5*8=40 square units.
When we divide 100 by 4 we get 25, and 25 is also 5 squared.
Numbers, letters, spaces and punctuation (commas, periods, colons; brackets [ ] { }) all work.
Is the statement true or false? It is true: 9 is greater than 8, and 8 is greater than 7.
Add the tens, then add the ones, and carry when the ones make more than nine.
A student read a book with 120 pages over 6 days, reading the same number each day.
The teacher asked the class to check their work and explain every answer they gave.
"""


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(bpe_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    fill = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if fill > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(fill)])
    return tok


def _characters(vocab_size: int) -> Tokenizer:
    """One token per character (see the module doc): BPE without merges, <|unk|> last."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    room = vocab_size - len(vocab) - 1
    for ch in CHARACTERS[:room]:
        vocab[ch] = len(vocab)
    reserved = [f"<|reserved_{i}|>" for i in range(room - len(CHARACTERS))]
    for name in reserved:
        vocab[name] = len(vocab)
    vocab[UNK_TOKEN] = len(vocab)
    tok = Tokenizer(bpe_models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.add_special_tokens([*SPECIAL_TOKENS, *reserved, UNK_TOKEN])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def tokenizer_files(vocab_size: int = 512) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer with exactly `vocab_size` tokens."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB_SIZE} ({len(SPECIAL_TOKENS)} special "
            f"tokens + {UNK_TOKEN}), got {vocab_size!r}"
        )
    tok = _train(vocab_size) if vocab_size >= BYTE_LEVEL_MIN else _characters(vocab_size)
    got = tok.get_vocab_size(with_added_tokens=True)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert got == vocab_size, (got, vocab_size)
    assert ids == [PAD_ID, BOS_ID, EOS_ID], ids
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    if vocab_size < BYTE_LEVEL_MIN:
        specials["unk_token"] = UNK_TOKEN
    config = {
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer.json": (tok.to_str(pretty=True) + "\n").encode("utf-8"),
        "tokenizer_config.json": json_bytes(config),
        "special_tokens_map.json": json_bytes(specials),
    }


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512) -> Path:
    """Write the tokenizer files into `out_dir` (created if needed); return it.

    Each file is written to a temporary file and renamed into place. Raises ValueError for a
    `vocab_size` below `MIN_VOCAB_SIZE` (4).
    """
    files = tokenizer_files(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return out
