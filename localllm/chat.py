"""Chat templates rendered the way transformers renders them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML: what we use when a model ships no template of its own.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VALID_ROLES = {"system", "user", "assistant", "tool", "developer"}


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (jinja's default would turn < into \u003c)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in VALID_ROLES:
            raise ChatTemplateError(f"messages[{i}].role {m['role']!r} is not one of {sorted(VALID_ROLES)}")
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: text and images (a vision model's template renders them)
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise ChatTemplateError(f"messages[{i}].content[{j}] must be a text or image part")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None, **kwargs) -> str:
    validate_messages(messages)
    try:
        return _compile(template or DEFAULT_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "", eos_token=eos_token or "", **kwargs)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
