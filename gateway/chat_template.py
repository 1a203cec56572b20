"""Chat messages → one prompt string: the checkpoint's jinja2 ``chat_template`` (from
``tokenizer_config.json``) when it has one, else :data:`DEFAULT_TEMPLATE`.

The default is DeepSeek-V3's turn markers, written out in plain text so that the byte-level
presets can use it too::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜>...

with an assistant turn's tool calls and the tool turns that answer them in DeepSeek-V3's
format, and the tools (``tools``: OpenAI's function definitions) listed first.

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
    # the tools, if any, and how to call them: DeepSeek-V3's call format (gateway/tools.py)
    "{% if tools %}## Tools\n\nYou can call the functions below. To call them, write "
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS"
    "\n```<｜tool▁call▁end｜>, one after another, then <｜tool▁calls▁end｜>.\n\n"
    "{% for t in tools %}### {{ t['function']['name'] }}\n"
    "{% if t['function']['description'] %}{{ t['function']['description'] }}{{ '\\n' }}{% endif %}"
    "Parameters: {{ (t['function']['parameters'] or {'type': 'object'}) | tojson }}\n\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<｜tool▁call▁begin｜>{{ c['type'] }}<｜tool▁sep｜>"
    "{{ c['function']['name'] }}\n```json\n{{ c['function']['arguments'] }}\n```<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    # a run of tool turns: one outputs block
    "{% else %}{% if loop.first or loop.previtem['role'] != 'tool' %}<｜tool▁outputs▁begin｜>"
    "{% else %}{{ '\\n' }}{% endif %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<｜tool▁outputs▁end｜>{% endif %}"
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

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. ``continue_final_message``: cut after the final message's text, so
        that the model goes on with it; ``extra``: more variables (vLLM's chat_template_kwargs,
        such as a template's thinking switch)."""
        context = {
            **self.special,
            **(extra or {}),
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self.template.render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from e
        return _open_final(text, messages) if continue_final_message else text


def _open_final(text: str, messages: Sequence[dict[str, Any]]) -> str:
    """``text`` up to the end of the final message's text (trailing whitespace left out), as
    transformers' ``continue_final_message`` cuts it."""
    if not messages:
        raise ValueError("continue_final_message: there are no messages, so no final one to go on")
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text to go on with")
    at = text.rfind(content)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the final "
            "message's text as it is, so it cannot be left open"
        )
    return text[: at + len(content.rstrip())]


def _token_text(tok: object) -> str:
    if isinstance(tok, dict):  # {"content": "<s>", ...}
        return str(tok.get("content", ""))
    return str(tok) if tok else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
