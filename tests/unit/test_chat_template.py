from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.gateway.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from ferry.gateway.tools import DeepSeekV3Calls

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def test_default_template_uses_deepseek_turn_markers() -> None:
    text = ChatTemplate().render(MESSAGES)
    assert text == (
        "Be brief.\n<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜>"
    )
    assert (
        not ChatTemplate().render(MESSAGES, add_generation_prompt=False).endswith("<｜Assistant｜>")
    )


def test_checkpoint_template_and_special_tokens_come_from_tokenizer_config(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    tpl = ChatTemplate.for_model(str(tmp_path))
    assert tpl.special == {"bos_token": "<s>", "eos_token": "</s>"}
    assert tpl.render(MESSAGES[:2]) == "<s>[system] Be brief.\n[user] Hi\n[assistant]"


def test_presets_and_checkpoints_without_a_template_get_the_default(tmp_path: Path) -> None:
    assert ChatTemplate.for_model("tiny").source == DEFAULT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.for_model(str(tmp_path)).source == DEFAULT_TEMPLATE


def test_a_template_that_raises_is_a_value_error() -> None:
    tpl = ChatTemplate("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(ValueError, match="only user turns, please"):
        tpl.render(MESSAGES)


def test_tools_and_tool_turns_in_deepseek_v3_format() -> None:
    """The tools come first; an assistant turn's calls and the tool turns answering them are
    written in the format gateway/tools.py reads back (consecutive tool turns: one block)."""
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "Does f.", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "g"}},
    ]
    calls = [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
    ]
    text = ChatTemplate().render(messages, tools=tools)
    head, turns = text.split("<｜User｜>")
    assert (
        head.startswith("## Tools\n") and '### f\nDoes f.\nParameters: {"type": "object"}' in head
    )
    assert '### g\nParameters: {"type": "object"}' in head
    assert turns == (
        "Go<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
        '```json\n{"a":1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n'
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>A<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>B<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜Assistant｜>"
    )
    reader = DeepSeekV3Calls()  # what the template writes, the reader reads
    call_text = turns.split("<｜Assistant｜>")[1].split("<｜end▁of▁sentence｜>")[0]
    reader.feed(call_text)
    assert reader.finish().content == ""
    assert [(c.name, c.arguments) for c in reader.calls] == [("f", '{"a":1}'), ("g", "{}")]
    assert (
        ChatTemplate().render(messages[:1]) == "<｜User｜>Go<｜Assistant｜>"
    )  # no tools: as before


def test_continue_final_message_leaves_the_last_turn_open() -> None:
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "Hello, I am "}]
    text = ChatTemplate().render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "Be brief.\n<｜User｜>Hi<｜Assistant｜>Hello, I am"  # as transformers cuts it
    for bad in ({"role": "assistant", "content": " "}, {"role": "assistant"}):
        with pytest.raises(ValueError, match="no text to go on with"):
            ChatTemplate().render([MESSAGES[1], bad], continue_final_message=True)
    with pytest.raises(ValueError, match="no messages, so no final one"):  # /tokenize allows []
        ChatTemplate().render([], add_generation_prompt=False, continue_final_message=True)
    shouting = ChatTemplate("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(ValueError, match="does not write the final message's text as it is"):
        shouting.render(messages, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template() -> None:
    tpl = ChatTemplate("{% if thinking %}<think>{% endif %}{{ messages[0]['content'] }}")
    assert tpl.render(MESSAGES[:1], extra={"thinking": True}) == "<think>Be brief."
    assert tpl.render(MESSAGES[:1]) == "Be brief."
