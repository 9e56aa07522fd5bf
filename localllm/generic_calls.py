"""Replies in the generic tool-calling format (llama.cpp's "generic", common/chat.cpp), read back:
a model whose chat template takes no tools is held by a grammar to one JSON object, a call
`{"tool_call": {"name": ..., "arguments": {...}}}` or an answer `{"response": "..."}`, and this
module turns it into calls or content, whole (parse) or as it streams (GenericStream, the answer's
text sent as it is written). Below every front end, beside tool_calls.py (which hands a GenericTools
here); the request side (the tools told in a system message, the grammar) is the server's
(server/generic_tools.py).
"""

from __future__ import annotations

import json
from typing import Any

# the exact start of every text answer: the grammar writes compact JSON (server/generic_tools.py)
RESPONSE_HEAD = '{"response": "'


class GenericTools(dict):
    """The offered tools (name -> parameters schema) of a request answered in the generic format.
    A dict, so that it travels where the template path's tools do (ReplyStream's `tools`);
    tool_calls.parse and ToolCallStream read the generic reply when given one.
    `answer_schema`: the request's structured-output schema, which the text answer is held to
    (llama.cpp's `response` takes the json_schema so too)."""

    def __init__(self, tools: dict, answer_schema: dict | None = None):
        super().__init__(tools)
        self.answer_schema = answer_schema


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
