"""Token in, token out: observations rendered incrementally with the chat
template, compared with a full re-render of the whole conversation."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.chat import ChatError, ChatRenderer
from models.tokenizer import EOS_ID, build_tokenizer

PROMPT = "Guess my number from 1 to 8."


def test_incremental_ids_match_a_full_render_until_a_sampled_turn_that_retokenizes(
    tmp_path: Path,
) -> None:
    r = ChatRenderer.from_checkpoint(build_tokenizer(tmp_path, 512))
    tok = r.tokenizer
    prompt = r.render(PROMPT)
    turn1 = [*tok.encode(" 3", add_special_tokens=False).ids, EOS_ID]  # canonical ids
    obs1 = r.continuation("higher", turn1)
    # turn 2 as a model may sample it: " the" spelled as four tokens, which BPE merges
    split = [tok.token_to_id(c) for c in ("Ġ", "t", "h", "e")]
    turn2 = [*split, *tok.encode(" 5", add_special_tokens=False).ids, EOS_ID]
    ids = prompt + turn1 + obs1 + turn2
    msgs = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "the 5"},
    ]
    full_text = r.conversation_text(msgs, generation_prompt=False)
    full = tok.encode(full_text, add_special_tokens=False).ids
    # the same text (the full render only adds the template's newline after the last turn) ...
    assert tok.decode(ids, skip_special_tokens=False) + "\n" == full_text
    # ... and the same ids up to turn 2: prompt (30), turn 1 (3) and the observation (17)
    assert (len(prompt), len(turn1), len(obs1)) == (30, 3, 17)
    at = len(prompt) + len(turn1) + len(obs1)
    assert ids[:at] == full[:at]
    assert tok.decode(obs1, skip_special_tokens=False) == "\nUser: higher\nAssistant:"
    # where they differ: the re-render merges the four sampled tokens into one
    first = next(i for i, (a, b) in enumerate(zip(ids, full)) if a != b)
    assert first == at == 50
    assert ids[at : at + 4] == split and full[at] == tok.token_to_id("Ġthe")
    assert (len(ids), len(full)) == (57, 55)  # 4 sampled ids became 1, plus the final "\n"


def test_a_turn_cut_for_length_gets_its_end_of_turn_token_from_the_environment(
    tmp_path: Path,
) -> None:
    r = ChatRenderer.from_checkpoint(build_tokenizer(tmp_path, 512))
    stopped = r.continuation("lower", [21, EOS_ID])
    cut = r.continuation("lower", [21])
    assert cut == [EOS_ID, *stopped] and EOS_ID not in stopped
    msgs = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatError, match="unknown chat role: tool"):
        r.continuation(msgs, [21])
    with pytest.raises(ChatError, match="observation message 0"):
        r.continuation([{"role": "user"}], [21])


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path) -> None:
    r = ChatRenderer.from_checkpoint(build_tokenizer(tmp_path, 512))
    r.template = (  # keeps only the last two messages: earlier ones vanish when one is added
        "{% for m in messages[-2:] %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(ChatError, match="cannot be rendered incrementally"):
        r.continuation("higher", [21, EOS_ID])


def test_the_generator_renders_observations_under_task_template(tmp_path: Path) -> None:
    """task.template reaches the generators (run-managed key ``template``) and chooses how the
    multi-turn driver renders observations: plain text under ``plain``, the chat template
    under ``auto`` / ``chat``; ``chat`` on a checkpoint without one is refused naming the key."""
    import json

    from generator.config import GeneratorConfig
    from models.errors import ConfigError
    from models.random_init import init_checkpoint
    from pipeline.commands.generator_engine import multi_turn
    from pipeline.commands.generator_flags import config_argv, generator_config
    from pipeline.config.run import load_config

    model = init_checkpoint("llama", "tiny", tmp_path / "m", seed=0)

    class Engine:
        full_depth = 1

    turn = [*ChatRenderer.from_checkpoint(model).tokenizer.encode(" 3").ids, EOS_ID]
    cfg = load_config(None, ["task.kind=dataset", "task.path=x", "task.template=plain",
                             "task.environment=generator.environments:Scripted"])  # fmt: skip
    gen = generator_config(cfg, "tcp://h:5", "tcp://h:6", model, 0)
    assert gen.template == "plain" and "--template" in config_argv(gen)
    plain = multi_turn(gen, Engine(), None).renderer
    assert plain.template is None
    assert plain.tokenizer.decode(plain.continuation("higher", turn)) == "\n\nhigher\n\n"
    chat = multi_turn(GeneratorConfig(model=str(model)), Engine(), None).renderer
    assert chat.template is not None
    assert chat.tokenizer.decode(chat.continuation("higher", turn),
                                 skip_special_tokens=False) == "\nUser: higher\nAssistant:"  # fmt: skip
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    with pytest.raises(ConfigError, match=r"generator config template='chat': .*no chat template"):
        multi_turn(GeneratorConfig(model=str(model), template="chat"), Engine(), None)
    with pytest.raises(ConfigError, match=r"generators\.template=.*task\.template"):
        load_config(None, ["generators.template=plain"])
    with pytest.raises(ConfigError, match=r"generator config template='html'"):
        GeneratorConfig(template="html")
