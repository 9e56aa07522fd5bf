"""A model's reply, as the engine streams it, split into what front ends show: reasoning, content
and tool calls. Every front end (`localllm run`, the chat REPL, each server API) reads replies
through this one stream, so a reply is split the same way everywhere; the front ends only spell
the parts in their own format (stdout, OpenAI deltas, Ollama's message fields, ...).

    s = ReplyStream(reasoning=True, inside=False, tools={"get_weather"})
    for text in deltas:              # the engine's RequestOutput.delta, any cut
        d = s.feed(text)             # ReplyDelta(reasoning, content, tool_calls): emit it now
    d = s.finish()                   # the end of the reply: what was held back, and the calls

- `reasoning`: the model may think, and how (reasoning.reasons: "think", its chat template
  knows <think>; "harmony", gpt-oss's channels; True reads as "think");
  `inside`: the prompt left <think> open, so the reply starts in the reasoning
  (reasoning.opened). Without `reasoning` the text is content as written, tags and all.
- `tools`: the names of the tools offered (None: no calls are looked for). Calls of them
  (tool_calls.py: Hermes, Mistral, Llama 3 formats) never reach `content`: once a call may be
  starting, the rest of the reply is held and parsed at finish(), which returns the calls.
  Text around calls stays content; a call of a tool not offered is content too.
- Text that could still become a tag (a partial `<think>`, `</think>` or call opening) is held
  back until the next delta decides it, or finish() flushes it: an unclosed <think> ends as
  reasoning, an unfinished tag as plain text.

However the text is cut, the deltas joined are the same as feeding it in one piece
(tests/test_reply_stream.py). `whole(text)` is that one piece, for answers that are not streamed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from .reasoning import HarmonySplitter, ThinkSplitter
from .tool_calls import ToolCall, ToolCallStream, tool_call


@dataclass
class ReplyDelta:
    """What to emit now: reasoning text, answer text, and (only from finish) the calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(self.reasoning + other.reasoning, self.content + other.content,
                          self.tool_calls + other.tool_calls)


class ReplyStream:
    """feed(text delta) -> ReplyDelta, then finish() once the reply has ended (see the module doc)."""

    def __init__(self, reasoning: bool | str | None = False, inside: bool = False,
                 tools: Collection[str] | None = None):
        self._think = (HarmonySplitter() if reasoning == "harmony" else ThinkSplitter(inside)) if reasoning else None
        self._calls = ToolCallStream(tools) if tools is not None else None

    def feed(self, text: str, final: bool = False) -> ReplyDelta:
        """The next delta's parts; `final` (the reply's last delta): finish() included."""
        reasoning, answer = self._think.feed(text) if self._think is not None else ("", text)
        if self._calls is not None:
            answer = self._calls.feed(answer)
        part = ReplyDelta(reasoning, answer)
        return part + self.finish() if final else part

    def finish(self) -> ReplyDelta:
        """The end of the reply: held-back text (an unfinished tag is text, an unclosed <think>
        reasoning) and the tool calls the reply made (a harmony reply's messages to functions: calls
        of offered tools whose arguments are a JSON object; otherwise their text is content)."""
        reasoning, answer = self._think.flush() if self._think is not None else ("", "")
        harmony = self._think.calls if isinstance(self._think, HarmonySplitter) else []
        if self._calls is None:
            return ReplyDelta(reasoning, answer + "".join(args for _, args in harmony))
        answer = self._calls.feed(answer)
        rest, calls = self._calls.finish()
        for name, args in harmony:
            call = tool_call(name, args, self._calls.names)
            if call is None:
                rest += args
            else:
                calls.append(call)
        return ReplyDelta(reasoning, answer + rest, calls)

    def whole(self, text: str) -> ReplyDelta:
        """A whole reply at once: feed(text) + finish()."""
        return self.feed(text, final=True)
