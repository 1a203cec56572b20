from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.chat_template import DEFAULT_TEMPLATE, ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]  # fmt: skip


def test_default_template_uses_deepseek_turn_markers() -> None:
    text = ChatTemplate().render(MESSAGES)
    assert text == ("Be brief.\n<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
                    "<｜User｜>Bye<｜Assistant｜>")  # fmt: skip
    assert (
        not ChatTemplate().render(MESSAGES, add_generation_prompt=False).endswith("<｜Assistant｜>")
    )


def test_checkpoint_template_and_special_tokens_come_from_tokenizer_config(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))  # fmt: skip
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
