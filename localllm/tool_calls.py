"""Tool calls as models write them: the calls parsed out of a reply's text (whole, or as it streams),
the format a chat template teaches its model, and the grammar that forces a call.

Models write calls in their family's format: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`,
Mistral `[TOOL_CALLS] [{"name", "arguments"}]`, Llama 3 a bare JSON object `{"name", "parameters"}`
(after `<|python_tag|>` or not). All three are recognised whatever the template, but only calls of
offered tools count: a JSON answer that happens to have a "name" is still an answer. A model whose
template takes no tools writes llama.cpp's generic JSON instead: given a GenericTools as the names,
parse and ToolCallStream read that (generic_calls.py). Below every front end (reply_stream.py uses
it); how an API spells a call on the wire is the server's business.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from . import generic_calls
from .reasoning import CHANNEL, partial_tag

HERMES, MISTRAL, PYTHON_TAG = "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    """One call of an offered tool: its name and arguments (an object), with an id of its own that
    the API answers carry and a tool turn names when it answers the call."""

    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def style_of(template: str | None) -> str:
    """The call format a chat template teaches its model: harmony (gpt-oss), hermes, mistral or json
    (Llama 3)."""
    if template and CHANNEL in template:
        return "harmony"
    if template and HERMES in template:
        return "hermes"
    if template and MISTRAL in template:
        return "mistral"
    return "json"


def forcing_grammar(tools: dict[str, dict], choice: str, style: str) -> str:
    """A Lark grammar (llguidance, with %json schemas) whose every sentence is one call of the named
    tool or (required) of any offered tool, in the model's own format. One call, not "one or more":
    a weak model repeats the call until max_tokens and the last one is cut."""
    names = list(tools) if choice == "required" else [choice]
    # compact JSON as the templates write calls: free whitespace let weak models pad forever
    compact = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    if style == "harmony":  # a commentary message to functions.NAME, its arguments JSON, ended by <|call|>
        return "start: " + " | ".join(
            f'<|channel|> {json.dumps(f"commentary to=functions.{n} ")} <|constrain|> "json" <|message|> '
            f"%json {json.dumps({**compact, **tools[n]})} <|call|>" for n in names)
    alts = [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools[n]},
             "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    call = json.dumps({**compact, **(alts[0] if len(alts) == 1 else {"anyOf": alts})})
    if style == "hermes":
        return f'start: "<tool_call>\\n" %json {call} "\\n</tool_call>"'
    return f"start: %json {call}"  # one JSON object: parsed as Llama 3's format


def _call(obj, names: Collection[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def tool_call(name: str, arguments: str, names: Collection[str]) -> ToolCall | None:
    """A call of tool `name` with `arguments` as JSON text (harmony's form: the name in the message's
    header), or None when the tool was not offered or the arguments are not a JSON object."""
    return _call({"name": name, "arguments": arguments or "{}"}, names)


def _calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls in a JSON object or list of them, or None if `text` is not that."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, names) for o in items]
    return calls if calls and all(calls) else None


def parse(text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """(content left, calls) of a reply; no calls: the text unchanged. `names` a GenericTools:
    the reply is in the generic JSON format (generic_calls)."""
    if isinstance(names, generic_calls.GenericTools):
        content, calls = generic_calls.parse(text, names)
        return content, [ToolCall(n, a) for n, a in calls]
    if HERMES in text:
        found = [_calls(m.group(1), names) for m in _HERMES_CALL.finditer(text)]
        if found and all(found):
            return _HERMES_CALL.sub("", text).strip(), [c for cs in found for c in cs]
    if MISTRAL in text:
        head, _, tail = text.partition(MISTRAL)
        calls = _calls(tail.strip(), names)
        if calls:
            return head.strip(), calls
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if body[:1] in ("{", "["):
        calls = _calls(body, names)
        if calls:
            return "", calls
    return text, []


class ToolCallStream:
    """A reply's text deltas -> the content to stream now; once a call may be starting, the rest is
    held and parsed at the end (finish), so that no call markup ever reaches `content`."""

    def __init__(self, names: Collection[str]):
        self.names = names
        generic = isinstance(names, generic_calls.GenericTools)
        self._generic = generic_calls.GenericStream(names) if generic else None
        self._held = ""
        self._calling = False
        self._started = False  # content other than whitespace was emitted: a bare JSON call is off

    def feed(self, text: str) -> str:
        if self._generic is not None:
            return self._generic.feed(text)
        buf = self._held + text
        self._held = ""
        if self._calling:
            self._held = buf
            return ""
        lead = buf.lstrip()
        if not self._started:
            if not lead or (len(lead) < len(PYTHON_TAG) and PYTHON_TAG.startswith(lead)):
                self._held = buf
                return ""
            if lead[0] in "{[" or lead.startswith(PYTHON_TAG):
                self._calling, self._held = True, buf
                return ""
        for marker in (HERMES, MISTRAL):
            i = buf.find(marker)
            if i >= 0:
                self._calling, self._held = True, buf[i:]
                self._started = self._started or bool(buf[:i].strip())
                return buf[:i]
        keep = max(partial_tag(buf, HERMES), partial_tag(buf, MISTRAL))
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self._started = self._started or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls) once the reply has ended."""
        if self._generic is not None:
            content, calls = self._generic.finish()
            return content, [ToolCall(n, a) for n, a in calls]
        held, self._held = self._held, ""
        return parse(held, self.names) if self._calling else (held, [])
