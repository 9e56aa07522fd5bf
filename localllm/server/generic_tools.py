"""Tool calling for models whose chat template takes no `tools` (the embedded SmolLM2 among them),
the way llama.cpp's server does it ("generic" format, common/chat.cpp): the tools are described in
a system message, and the reply is held by a grammar to one JSON object, either a call
`{"tool_call": {"name": ..., "arguments": {...}}}` or an answer `{"response": "..."}`, parsed back
into tool_calls or content. One call per reply (llama.cpp's non-parallel shape): weak models asked
for a list repeat the call until max_tokens. Earlier calls and tool results in the conversation are
rendered as text turns the template accepts (a `tool` turn becomes a user turn when the template
has no tool role), in the same JSON the model is asked to write. The replies are read back below
the server (localllm/generic_calls.py: GenericTools, handed to ReplyStream as its `tools`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

# llama.cpp's instruction, word for word: models tuned on its generic format have seen it
INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
               "reply to the user's request")
# the grammar's separators: compact JSON, as the templates write calls (free whitespace let weak
# models pad forever); generic_calls.RESPONSE_HEAD is then the exact start of every text answer
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (the template path); else generic."""
    return bool(template) and "tools" in template


@functools.lru_cache(maxsize=16)
def _has_tool_role(template: str | None) -> bool:
    """Whether the template renders a `tool` turn (tried once per template: some raise on roles
    they do not know, some drop them, ChatML-style ones write any role)."""
    from ..chat import ChatTemplateError, render_chat

    probe = "\x00tool-probe\x00"
    try:
        return probe in render_chat(template, [{"role": "user", "content": "q"}, {"role": "tool", "content": probe}])
    except ChatTemplateError:
        return False


def answer_of(constraint: Any) -> dict | None:
    """The schema a structured-output Constraint (json_schema, or json: any object) holds an
    answer to; None for other kinds (a regex or grammar cannot sit inside the JSON)."""
    if constraint is None:
        return None
    if constraint.kind == "json_schema":
        return json.loads(constraint.spec)
    return {"type": "object"} if constraint.kind == "json" else None


def schema(tools: dict[str, dict], choice: str, answer: dict | None = None) -> dict:
    """The JSON schema of every reply: a call of an offered tool (of the named one, or any with
    'required'), or with 'auto' also an answer: text, or a value held to `answer` (the request's
    structured-output schema)."""
    names = list(tools) if choice in ("auto", "required") else [choice]
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    call = {"type": "object", "properties": {"tool_call": calls[0] if len(calls) == 1 else {"anyOf": calls}},
            "required": ["tool_call"], "additionalProperties": False}
    if choice != "auto":
        return {"x-guidance": _COMPACT, **call}
    reply = {"type": "object", "properties": {"response": answer if answer is not None else {"type": "string"}},
             "required": ["response"], "additionalProperties": False}
    return {"x-guidance": _COMPACT, "anyOf": [call, reply]}


def system_text(raw_tools: list[dict]) -> str:
    """The instruction and the tools, as the system message (or its tail) tells them."""
    listed = json.dumps([t["function"] for t in raw_tools], ensure_ascii=False, indent=2)
    example = json.dumps({"tool_call": {"name": "tool_name", "arguments": {"arg1": "some_value"}}})
    return (f"{INSTRUCTION}.\n\nYou can call any of the following tools to satisfy the user's requests:\n{listed}\n\n"
            f"Example tool call syntax:\n\n{example}\n\nAfter a tool's result, answer the user with `response`.")


def messages(msgs: list[dict], raw_tools: list[dict] | None, template: str | None) -> list[dict]:
    """The conversation as a template without tools can take it: the tools (when offered) told in
    the system message (added to the first one, or a new one first), assistant calls as the JSON
    the model is asked to write, tool results as `{"tool_response": {"name", "content"}}` (in a
    user turn when the template renders no tool turn). Without tools or tool turns: unchanged."""
    if not raw_tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs):
        return msgs
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> tool name, for tool turns that only give the id
    tool_role, last = _has_tool_role(template), ""
    for m in msgs:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            parts = [content] if content.strip() else []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                names[str(c.get("id"))] = last = fn.get("name", "")
                parts.append(json.dumps({"tool_call": {"name": fn.get("name"), "arguments": args}},
                                        ensure_ascii=False))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            # Ollama's clients may name neither the tool nor the call: the last call it answers
            name = m.get("name") or names.get(str(m.get("tool_call_id"))) or last
            text = json.dumps({"tool_response": {"name": name, "content": content}}, ensure_ascii=False)
            out.append({"role": "tool" if tool_role else "user", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if not raw_tools:
        return out
    tell = system_text(raw_tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tell}" if out[0]["content"] else tell}
    else:
        out.insert(0, {"role": "system", "content": tell})
    return out
