"""Tool calling for models whose chat template takes no `tools` (the embedded SmolLM2 among them),
the way llama.cpp's server does it ("generic" format, common/chat.cpp): the tools are described in
a system message, and the reply is held by a grammar to one JSON object, either a call
`{"tool_call": {"name": ..., "arguments": {...}}}` or an answer `{"response": "..."}`, parsed back
into tool_calls or content. One call per reply (llama.cpp's non-parallel shape): weak models asked
for a list repeat the call until max_tokens. Earlier calls and tool results in the conversation are
rendered as text turns the template accepts (a `tool` turn becomes a user turn when the template
has no tool role), in the same JSON the model is asked to write.
"""

from __future__ import annotations

import functools
import json
from typing import Any

# llama.cpp's instruction, word for word: models tuned on its generic format have seen it
INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
               "reply to the user's request")
# the grammar's separators: compact JSON, as the templates write calls (free whitespace let weak
# models pad forever); RESPONSE_HEAD is then the exact start of every text answer
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RESPONSE_HEAD = '{"response": "'


class GenericTools(dict):
    """The offered tools (name -> parameters schema) of a request answered in the generic format.
    A dict, so that it travels where the template path's tools do (chat_choice, ChatDeltas,
    Ollama's stream); tool_calls.parse and ToolCallStream read the generic reply when given one.
    `answer_schema`: the request's structured-output schema, which the text answer is held to
    (llama.cpp's `response` takes the json_schema so too)."""

    def __init__(self, tools: dict, answer_schema: dict | None = None):
        super().__init__(tools)
        self.answer_schema = answer_schema


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


def parse(text: str, names: Any) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls as (name, arguments)) of a generic reply; text that is not one (cut by
    max_tokens) is content."""
    try:
        obj = json.loads(text)
    except ValueError:
        return _cut_answer(text), []
    if isinstance(obj, dict):
        call = obj.get("tool_call")
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict):
            return "", [(call["name"], call["arguments"])]
        if "response" in obj:
            r = obj["response"]
            return (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)), []
    return text, []


def _cut_answer(text: str) -> str:
    """A text answer cut short (max_tokens): the part of its string that was written."""
    if not text.startswith(RESPONSE_HEAD):
        return text
    return _decode_prefix(text[len(RESPONSE_HEAD):])[0]


def _decode_prefix(raw: str) -> tuple[str, int, bool]:
    """(decoded text, characters of `raw` consumed, closed) of a JSON string body read so far:
    stops before an escape not yet complete (or a high surrogate whose pair may follow) and at the
    closing quote."""
    out, i = [], 0
    while i < len(raw):
        ch = raw[i]
        if ch == '"':
            return "".join(out), i, True
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            out.append(json.loads(f'"{raw[i:i + 2]}"'))
            i += 2
            continue
        if i + 6 > len(raw):
            break
        code = int(raw[i + 2:i + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a pair: both halves or neither
            if i + 12 > len(raw):
                break
            out.append(json.loads(f'"{raw[i:i + 12]}"'))
            i += 12
            continue
        out.append(chr(code))
        i += 6
    return "".join(out), i, False


class GenericStream:
    """A generic reply's deltas -> the answer's text as it is written (the JSON string's body,
    unescaped); a call is held and parsed at the end (finish)."""

    def __init__(self, names: Any):
        self.names = names
        self._text = ""  # everything so far
        self._sent = 0  # characters of the answer's raw string body already decoded and sent
        self._closed = False

    def feed(self, text: str) -> str:
        self._text += text
        if not self._text.startswith(RESPONSE_HEAD) or self._closed:
            return ""
        body = self._text[len(RESPONSE_HEAD) + self._sent:]
        decoded, used, self._closed = _decode_prefix(body)
        self._sent += used
        return decoded

    def finish(self) -> tuple[str, list[tuple[str, dict]]]:
        """(content still to send, the calls) once the reply has ended."""
        if self._text.startswith(RESPONSE_HEAD):
            return "", []  # the answer went out as it came (a cut escape at the very end is dropped)
        return parse(self._text, self.names)
