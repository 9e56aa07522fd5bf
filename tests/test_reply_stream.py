"""The one reply stream every front end reads (localllm/reply_stream.py): reasoning, content and tool
calls come out the same however the engine's text is cut into deltas, held-back text is flushed at
the end (an unclosed <think> is reasoning, an unfinished tag or call is text), and text after a
call stays content."""

from __future__ import annotations

import random

import pytest

from localllm.reply_stream import ReplyDelta, ReplyStream

TOOLS = {"get_weather", "get_time"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
WEATHER = ("get_weather", {"city": "Paris", "days": 3})

CASES = [
    # (reply, reasoning model?, starts inside <think>?, tools offered?, (reasoning, content, calls))
    (f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{CALL}\n</tool_call>",
     True, False, True, ("\nThe user wants weather.\n", "Let me check.\n", [WEATHER])),
    (f"Paris it is.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>", True, True, True,
     ("Paris it is.\n", "", [WEATHER])),  # the prompt opened <think>
    ("<think>\nStill weighing it </thi", True, False, True, ("\nStill weighing it </thi", "", [])),  # unclosed
    ("<think>never closed", True, False, False, ("never closed", "", [])),
    (f"<tool_call>\n{CALL}\n</tool_call>\nI asked for the forecast.", False, False, True,
     ("", "I asked for the forecast.", [WEATHER])),  # text after a call
    (f"<think>ok</think>[TOOL_CALLS] [{CALL}]", True, False, True, ("ok", "", [WEATHER])),
    (f"<|python_tag|>{CALL}", False, False, True, ("", "", [WEATHER])),
    ('<tool_call>\n{"name": "get_weather", "argu', False, False, True,  # cut by max_tokens: text, not lost
     ("", '<tool_call>\n{"name": "get_weather", "argu', [])),
    ('{"name": "Ada", "age": 36}', False, False, True, ("", '{"name": "Ada", "age": 36}', [])),  # not a tool
    ("Use the <tool_", False, False, True, ("", "Use the <tool_", [])),  # a partial opening, flushed
    (f"<think>x</think>y <tool_call>{CALL}</tool_call>", False, False, False,  # neither: text as written
     ("", f"<think>x</think>y <tool_call>{CALL}</tool_call>", [])),
    ("<think>\n\n</think>\n\nHi <think> there", True, False, False, ("\n\n", "Hi <think> there", [])),
]


def stream(text: str, cuts: list[int], reasoning: bool, inside: bool, tools: bool) -> tuple[ReplyDelta, list]:
    """The deltas joined, and the deltas, of `text` fed cut at `cuts`."""
    s = ReplyStream(reasoning, inside, TOOLS if tools else None)
    parts = [s.feed(text[lo:hi]) for lo, hi in zip([0] + cuts, cuts + [len(text)])] + [s.finish()]
    joined = ReplyDelta()
    for p in parts:
        joined += p
    return joined, parts


def shape(d: ReplyDelta) -> tuple[str, str, list]:
    return d.reasoning, d.content, [(c.name, c.arguments) for c in d.tool_calls]


@pytest.mark.parametrize("text,reasoning,inside,tools,want", CASES)
def test_every_cut_gives_the_one_chunk_result(text, reasoning, inside, tools, want):
    whole = ReplyStream(reasoning, inside, TOOLS if tools else None).whole(text)
    assert shape(whole) == want
    cuttings = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]  # one cut anywhere; every char
    rng = random.Random(0)
    cuttings += [sorted(rng.sample(range(1, len(text)), rng.randint(2, 6))) for _ in range(30)]
    for cuts in cuttings:
        joined, parts = stream(text, cuts, reasoning, inside, tools)
        assert shape(joined) == want, cuts
        assert all(not p.tool_calls for p in parts[:-1]), cuts  # calls come whole, from finish()
        if want[2]:  # no call markup ever reaches content
            assert "tool_call" not in joined.content and "{" not in joined.content, cuts
        kinds = ["content" if p.content else "reasoning" for p in parts if p.content or p.reasoning]
        assert kinds == sorted(kinds, key=lambda k: k == "content"), cuts  # reasoning, then the answer


def test_a_plain_stream_passes_text_through_at_once():
    s = ReplyStream()
    assert [s.feed(t).content for t in ("<thi", "nk>", " [TOOL_CALLS] {")] == ["<thi", "nk>", " [TOOL_CALLS] {"]
    assert not s.finish()


def test_calls_carry_ids_of_their_own():
    a, b = (ReplyStream(tools=TOOLS).whole(f"<tool_call>{CALL}</tool_call>").tool_calls[0] for _ in range(2))
    assert a.id.startswith("call_") and a.id != b.id
