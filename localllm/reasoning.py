"""A reasoning model's reasoning kept apart from its answer, in a stream of text deltas.

Qwen3, QwQ and the DeepSeek-R1 distills write their reasoning between <think> tags before the
answer (or their template opens the tag in the prompt and the model only closes it): ThinkSplitter.
gpt-oss writes OpenAI's harmony format, messages on channels, the reasoning on `analysis` and the
answer on `final` (<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...): HarmonySplitter (the tokenizer renders those markup tokens for it, see
tokenizer.HARMONY_MARKUP). Front ends show the reasoning dimmed, hide it or return it as
`reasoning_content`; the answer alone goes to stdout, into the conversation and into `content`.
Tokens are untouched: this only splits text.
"""

from __future__ import annotations

from .tokenizer import HARMONY_EOG, HARMONY_MARKUP

START, END = "<think>", "</think>"
START_MESSAGE, END_MESSAGE, CHANNEL, MESSAGE, _ = HARMONY_MARKUP
_HARMONY_MARKERS = (*HARMONY_MARKUP, *HARMONY_EOG)
_LONGEST_MARKER = max(map(len, _HARMONY_MARKERS))


def reasons(template: str | None) -> str | None:
    """How the model's chat template lets it reason: "harmony" (channels), "think" (the <think>
    tags), or None (it does not). ReplyStream takes this as its `reasoning`."""
    if not template:
        return None
    if CHANNEL in template:
        return "harmony"
    return "think" if END in template else None


def opened(prompt_text: str) -> bool:
    """The rendered prompt leaves a <think> open: the model's output starts inside its reasoning."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


class ThinkSplitter:
    """feed(delta) -> (reasoning, answer) text to emit now. A tag may arrive split over deltas,
    so text that could still become one is held back until the next delta (or flush)."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self._held = ""
        self._answered = False  # answer text has been emitted: a later <think> is just text
        self._after_think = thinking  # strip the blank lines between </think> and the answer

    def feed(self, text: str) -> tuple[str, str]:
        buf, reasoning, answer = self._held + text, [], []
        self._held = ""
        while buf:
            if self.thinking:
                i = buf.find(END)
                if i < 0:
                    keep = partial_tag(buf, END)
                    reasoning.append(buf[:len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    break
                reasoning.append(buf[:i])
                buf, self.thinking, self._after_think = buf[i + len(END):], False, True
                continue
            if self._after_think:
                buf = buf.lstrip()
                if not buf:
                    break
                self._after_think = False
            if not self._answered:
                lead = len(buf) - len(buf.lstrip())
                if buf[lead:].startswith(START):  # the model opens its reasoning
                    buf, self.thinking = buf[lead + len(START):], True
                    continue
                if START.startswith(buf[lead:]):  # blank, or the tag's beginning: wait for more
                    self._held = buf
                    break
            answer.append(buf)
            self._answered = True
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is held back, once the stream has ended (an unfinished tag is plain text)."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


class HarmonySplitter:
    """feed(delta) -> (reasoning, answer) of a harmony reply (see the module doc): text on the
    `analysis` channel is reasoning, on any other (final, commentary) or before any header the
    answer; headers, the role after <|start|> and the markers themselves are dropped, as is what
    follows <|return|> / <|call|>. A message to a function (`to=functions.NAME` in its role or
    header: a tool call) is neither: its text is kept in `calls` as (NAME, arguments text). A marker
    may arrive split over deltas: from a "<|" on, text is held until it is a marker or cannot be one."""

    def __init__(self):
        self._held = ""
        self._mode = "body"  # body | header (after <|channel|>) | role (after <|start|>) | ended
        self._channel = ""
        self._header = ""
        self._role = ""
        self._to = ""  # the message's recipient function, if any
        self.calls: list[tuple[str, str]] = []

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning, answer = [], []
        while buf:
            i = buf.find("<|")
            if i < 0:
                keep = 1 if buf.endswith("<") else 0
                self._text(buf[:len(buf) - keep], reasoning, answer)
                self._held = buf[len(buf) - keep:]
                break
            self._text(buf[:i], reasoning, answer)
            j = buf.find("|>", i + 2)
            if j < 0 and len(buf) - i < _LONGEST_MARKER:
                self._held = buf[i:]
                break
            marker = buf[i:j + 2] if j >= 0 else ""
            if marker not in _HARMONY_MARKERS:  # "<|" that starts no marker: text
                self._text("<|", reasoning, answer)
                buf = buf[i + 2:]
                continue
            self._marker(marker)
            buf = buf[j + 2:]
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is held back, once the stream has ended (an unfinished marker is text; an unended
        call is a call)."""
        reasoning, answer = [], []
        held, self._held = self._held, ""
        self._text(held, reasoning, answer)
        self._end_message()
        return "".join(reasoning), "".join(answer)

    def _marker(self, marker: str) -> None:
        if self._mode == "ended":
            return
        if marker == CHANNEL:
            if self._mode != "header":
                self._header = ""
            self._mode = "header"
        elif marker == MESSAGE:
            # the header: "analysis", "final", "commentary to=functions.f <|constrain|>json"; the
            # recipient may also follow the role ("<|start|>assistant to=functions.f<|channel|>...")
            if self._mode == "header":
                self._channel = self._header.split(" ")[0].strip()
            to = next((w[3:] for w in f"{self._role} {self._header}".split() if w.startswith("to=")), "")
            self._to = to[len("functions."):] if to.startswith("functions.") else ""
            self._mode, self._role, self._header = "body", "", ""
            if self._to:
                self.calls.append((self._to, ""))
        elif marker == START_MESSAGE:
            self._end_message()
            self._mode, self._channel, self._role = "role", "", ""
        elif marker == END_MESSAGE:
            self._end_message()
            self._mode = "role"  # until the next message's header: nothing shown
        elif marker in HARMONY_EOG:
            self._end_message()
            self._mode = "ended"
        # (<|constrain|> inside a header is part of the header: dropped with it)

    def _end_message(self) -> None:
        self._to = ""

    def _text(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        if not text:
            return
        if self._mode == "header":
            self._header += text
        elif self._mode == "role":
            self._role += text
        elif self._mode == "body":
            if self._to:
                name, args = self.calls[-1]
                self.calls[-1] = (name, args + text)
            else:
                (reasoning if self._channel == "analysis" else answer).append(text)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def chat_prompt(engine, messages: list[dict], think: bool | None) -> tuple[list[int], bool]:
    """(prompt token ids, whether the reply starts inside the reasoning) of a conversation.
    think=False asks the template not to think (Qwen3's enable_thinking); None: its default."""
    ids = engine.encode_prompt(messages, **({} if think is None else {"enable_thinking": think}))
    tail = engine.tokenizer.decode(getattr(ids, "ids", ids)[-16:], skip_special_tokens=False)  # (an ImagePrompt's)
    return ids, opened(tail)
