"""The tools a request offers and the call it demands (tools / tool_choice, or the deprecated
functions / function_call), checked, and assistant tool calls carried back into a chat template.
The calls a model writes are parsed below the front ends (localllm/tool_calls.py)."""

from __future__ import annotations

import json
import re
from typing import Any


class ToolError(ValueError):
    """A malformed tools / tool_choice field; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: list, param: str = "tools") -> dict[str, dict]:
    """OpenAI/Ollama tools [{"type": "function", "function": {"name", "description", "parameters"}}]
    -> {name: parameters schema}."""
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(param, f"{param}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(param, f"{param}[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}")
        if not isinstance(params, dict):
            raise ToolError(param, f"{param}[{i}].function.parameters must be a JSON schema object")
        if name in out:
            raise ToolError(param, f"{param}: two tools are named {name!r}")
        out[name] = params
    return out


def choice_of(tool_choice: Any, names: dict[str, dict], param: str = "tool_choice") -> str:
    """tool_choice -> "none" | "auto" | "required" | a tool's name (a named call)."""
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto"):
        return tool_choice
    if tool_choice == "required":
        if not names:
            raise ToolError(param, "tool_choice 'required' needs tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(param, f"{param} must be 'none', 'auto', 'required' or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise ToolError(param, f"{param} names {name!r}, which is not among the tools offered")
    return name


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls as chat templates read them: arguments as an object (OpenAI sends
    them as JSON text; transformers' templates write `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # kept as text: templates write a string as is
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
