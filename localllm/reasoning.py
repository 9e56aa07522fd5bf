"""A reasoning model's <think>...</think> kept apart from its answer, in a stream of text deltas.

Qwen3, QwQ and the DeepSeek-R1 distills write their reasoning between these tags before the
answer (or their template opens the tag in the prompt and the model only closes it). Front ends
show the reasoning dimmed, hide it or return it as `reasoning_content`; the answer alone goes to
stdout, into the conversation and into `content`. Tokens are untouched: this only splits text.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def reasons(template: str | None) -> bool:
    """Whether the model's chat template knows the reasoning tags (and so may think)."""
    return bool(template) and END in template


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
