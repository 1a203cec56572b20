"""Chat messages → one prompt string: the checkpoint's jinja2 ``chat_template`` (from
``tokenizer_config.json``) when it has one, else :data:`DEFAULT_TEMPLATE`.

The default is DeepSeek-V3's turn markers, written out in plain text so that the byte-level
presets can use it too::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜>...

The BOS marker is left to the tokenizer (``add_bos``), as DeepSeek's own template does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_TEMPLATE, special: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self.template = env.from_string(source)
        self.special = special or {}  # bos_token, eos_token for templates that use them

    @classmethod
    def for_model(cls, model: str) -> ChatTemplate:
        """The checkpoint's template, or the default for presets and checkpoints without one."""
        config = Path(model) / "tokenizer_config.json"
        if not config.is_file():
            return cls()
        data = json.loads(config.read_text())
        source = data.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        special = {k: _token_text(data.get(k)) for k in ("bos_token", "eos_token")}
        return cls(source, special) if source else cls()

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)  # fmt: skip
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from e


def _token_text(tok: object) -> str:
    if isinstance(tok, dict):  # {"content": "<s>", ...}
        return str(tok.get("content", ""))
    return str(tok) if tok else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
