"""Reasoning models on `localllm serve` (issue #17): vLLM's reasoning_content beside the answer in
content (whole and streamed), chat_template_kwargs reaching the template, Ollama's think and
message.thinking. A 2-layer model whose chat template is Qwen3's published one is served for real
(it will not write <think> itself: what reaches the prompt is checked against the template rendered
here); the split of a reply that does reason is checked on the server's own assembly code with a
scripted stream, as tests/test_reasoning.py does for the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import ollama
import openai
import pytest
from hub_mirror import tiny_checkpoint_with_template
from server_proc import running

from localllm.chat import render_chat
from localllm.reply_stream import ReplyDelta, ReplyStream
from localllm.server import openai_schema as oai

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
ASK = [{"role": "user", "content": "Is 7 prime?"}]
REPLY = "<think>\nSeven has no divisors but 1 and itself.\n</think>\n\nYes, 7 is prime."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint_with_template(tmp_path_factory.mktemp("qwen3-template") / "tiny-reasoner", QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    # pinned by path: a tiny checkpoint with Qwen3's template, in no registry or hub cache
    with running("--ctx", "512", "--kv-memory", "20MiB", "--threads", "1", "--enforce-eager",
                 model=str(model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def prompt_tokens(model_dir):
    """What the prompt must count: Qwen3's template rendered here, tokenized by the model's tokenizer."""
    from localllm.tokenizer import LLMTokenizer

    tok = LLMTokenizer.from_dir(model_dir)

    def count(messages, **kw) -> int:
        return len(tok.encode(render_chat(QWEN3_TEMPLATE, messages, bos_token=tok.bos_token,
                                          eos_token=tok.eos_token, **kw)))
    return count


def test_chat_template_kwargs_reach_the_template(server, model_dir, prompt_tokens):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    default = c.chat.completions.create(model=str(model_dir), messages=ASK, max_tokens=3, temperature=0)
    off = c.chat.completions.create(model=str(model_dir), messages=ASK, max_tokens=3, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert default.usage.prompt_tokens == prompt_tokens(ASK)
    assert off.usage.prompt_tokens == prompt_tokens(ASK, enable_thinking=False) > default.usage.prompt_tokens
    msg = default.choices[0].message
    assert msg.model_extra.get("reasoning_content", "absent") is None  # a reasoning model: the key is there
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                   json={"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_ollama_think_reaches_the_template(server, model_dir, prompt_tokens):
    c = ollama.Client(host=server.base, timeout=60)
    opts = {"temperature": 0, "num_predict": 3}
    off = c.chat(model=str(model_dir), messages=ASK, think=False, options=opts)
    on = c.chat(model=str(model_dir), messages=ASK, think=True, options=opts)
    assert off.prompt_eval_count == prompt_tokens(ASK, enable_thinking=False)
    assert on.prompt_eval_count == prompt_tokens(ASK, enable_thinking=True)
    gen = c.generate(model=str(model_dir), prompt="Is 7 prime?", think=False, options=opts)
    assert gen.prompt_eval_count == prompt_tokens(ASK, enable_thinking=False)
    show = httpx.post(server.base + "/api/show", json={"model": str(model_dir)}, timeout=30)
    assert "thinking" in show.json()["capabilities"]
    r = httpx.post(server.base + "/api/chat", json={"model": str(model_dir), "messages": ASK, "think": "high"}, timeout=30)
    assert r.status_code == 400 and "think" in r.json()["error"]


# ---- the server's assembly of a reasoning reply, on a scripted stream -------------------------------
def test_chat_choice_splits_reasoning_from_the_answer():
    def choice(text: str, inside: bool | None = None) -> dict:  # inside None: not a reasoning model
        reply = ReplyStream(inside is not None, bool(inside)).whole(text)
        return oai.chat_choice(0, reply, "stop", None, reasons=inside is not None)

    c = choice(REPLY, inside=False)
    assert c["message"] == {"role": "assistant", "content": "Yes, 7 is prime.",
                            "reasoning_content": "\nSeven has no divisors but 1 and itself.\n"}
    # the template opened <think> in the prompt: the reply starts inside it
    opened = choice(REPLY.removeprefix("<think>"), inside=True)
    assert opened["message"]["content"] == "Yes, 7 is prime."
    plain = choice("Yes.", inside=False)["message"]
    assert plain == {"role": "assistant", "content": "Yes.", "reasoning_content": None}
    assert choice(REPLY)["message"] == {"role": "assistant", "content": REPLY}


class _ScriptedGen:
    """What openai_routes._chat_events reads of a Generation, replaying fixed deltas for one choice."""

    def __init__(self, deltas: list[str]):
        self.deltas, self.jobs = deltas, [None]
        self.metrics = SimpleNamespace(errors={})

    async def outputs(self):
        for k, d in enumerate(self.deltas):
            last = k == len(self.deltas) - 1
            yield 0, SimpleNamespace(delta=d, finished=last, finish_reason="stop" if last else None,
                                     new_token_ids=[1], logprobs=[])

    def usage(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(REPLY)])
def test_streamed_deltas_carry_reasoning_content_then_content(size):
    from localllm.server.openai_routes import _chat_events

    deltas = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]

    async def run() -> list[dict]:
        return [json.loads(e.removeprefix("data: ")) async for e in
                _chat_events(_ScriptedGen(deltas), "id", 0, "m", False, False, str, True, False) if "[DONE]" not in e]
    chunks = asyncio.run(run())
    got = [c["choices"][0]["delta"] for c in chunks]
    assert got[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in got)
    answer = "".join(d.get("content", "") for d in got)
    assert (reasoning, answer) == ("\nSeven has no divisors but 1 and itself.\n", "Yes, 7 is prime.")
    assert "<think>" not in answer and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # no reasoning once the answer began: the deltas never interleave
    kinds = [k for d in got[1:] for k in d]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


# ---- the agent APIs on a reasoning model (issue #33) --------------------------------------------------
def test_responses_effort_and_anthropic_thinking_reach_the_template(server, model_dir, prompt_tokens):
    import anthropic

    c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=str(model_dir), input="Is 7 prime?", max_output_tokens=2, temperature=0)
    assert c.responses.create(**kw).usage.input_tokens == prompt_tokens(ASK)
    assert c.responses.create(**kw, reasoning={"effort": "minimal"}).usage.input_tokens == prompt_tokens(
        ASK, enable_thinking=False)
    assert c.responses.create(**kw, reasoning={"effort": "high"}).usage.input_tokens == prompt_tokens(
        ASK, enable_thinking=True)
    a = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    for thinking, on in (({"type": "disabled"}, False), ({"type": "enabled", "budget_tokens": 1024}, True)):
        m = a.messages.create(model=str(model_dir), max_tokens=2, messages=ASK, thinking=thinking)
        assert m.usage.input_tokens == prompt_tokens(ASK, enable_thinking=on)
        assert a.messages.count_tokens(model=str(model_dir), messages=ASK, thinking=thinking).input_tokens == \
            m.usage.input_tokens


@pytest.mark.parametrize("size", [1, 3, len(REPLY)])
def test_reasoning_replies_become_reasoning_items_and_thinking_blocks(size):
    from localllm.server.anthropic import ContentBlocks
    from localllm.server.responses import OutputItems

    deltas = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]
    items, blocks = OutputItems(), ContentBlocks()
    events, block_events = [], []
    splitters = ReplyStream(True, False), ReplyStream(True, False)
    for k, d in enumerate(deltas):
        last = k == len(deltas) - 1
        parts = [s.feed(d) + (s.finish() if last else ReplyDelta()) for s in splitters]
        events += items.add(parts[0])
        block_events += blocks.add(parts[1])
    events += items.finish("completed")
    block_events += blocks.finish()
    thought = "\nSeven has no divisors but 1 and itself.\n"
    assert [(i["type"], i["status"]) for i in items.items] == [("reasoning", "completed"), ("message", "completed")]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert items.items[1]["content"][0]["text"] == "Yes, 7 is prime."
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.content_part.added")  # one after the other
    assert blocks.blocks == [{"type": "thinking", "thinking": thought, "signature": ""},
                             {"type": "text", "text": "Yes, 7 is prime."}]
    starts = [e["content_block"]["type"] for e in block_events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in block_events if e["type"] == "content_block_stop"]
    assert starts == ["thinking", "text"] and stops == [0, 1]


# harmony's shape (gpt-oss): the effort in a system message, the assistant's turns on channels
HARMONY_TEMPLATE = ("{%- if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}"
                    "<|end|>{%- endif %}{%- for m in messages %}<|start|>{{ m.role }}{%- if m.role == 'assistant' %}"
                    "<|channel|>final{%- endif %}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def test_reasoning_effort_reaches_a_harmony_template(tmp_path):
    """gpt-oss's effort: OpenAI's reasoning_effort and Ollama's think levels reach the template's
    `reasoning_effort`; another think value is refused in one line."""
    from localllm.tokenizer import LLMTokenizer

    model_dir = tiny_checkpoint_with_template(tmp_path / "tiny-harmony", HARMONY_TEMPLATE)
    tok = LLMTokenizer.from_dir(model_dir)

    def count(**kw) -> int:
        return len(tok.encode(render_chat(HARMONY_TEMPLATE, ASK, bos_token=tok.bos_token, eos_token=tok.eos_token,
                                          **kw)))
    with running("--ctx", "512", "--kv-memory", "20MiB", "--threads", "1", "--enforce-eager",
                 model=str(model_dir)) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        default = c.chat.completions.create(model=str(model_dir), messages=ASK, max_tokens=2, temperature=0)
        high = c.chat.completions.create(model=str(model_dir), messages=ASK, max_tokens=2, temperature=0,
                                         reasoning_effort="high")
        assert default.usage.prompt_tokens == count() < high.usage.prompt_tokens == count(reasoning_effort="high")
        o = ollama.Client(host=s.base, timeout=60)
        low = o.chat(model=str(model_dir), messages=ASK, think="low", options={"temperature": 0, "num_predict": 2})
        assert low.prompt_eval_count == count(reasoning_effort="low", enable_thinking=True)
        r = httpx.post(s.base + "/api/chat", timeout=30, json={"model": str(model_dir), "messages": ASK,
                                                              "think": "extreme", "stream": False})
        assert r.status_code == 400 and "think must be" in r.json()["error"]


GPT_OSS_TEMPLATE = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string", "description": "Its name."},
                                                "days": {"type": "integer"}}}}}


def test_an_agent_turn_renders_gpt_oss_published_template(tmp_path):
    """gpt-oss's published chat template (openai/gpt-oss-*'s, as llama.cpp keeps it) read as harmony
    (its reasoning and its calls), and an agent's second turn as the OpenAI SDK sends it (tools, the
    assistant's call with null content and its arguments as JSON text, the tool's answer) served:
    the prompt is the template's own rendering of the call (arguments as an object, after `to=functions.`)
    and of the answer (after `functions.get_weather to=assistant`)."""
    from localllm.reasoning import reasons
    from localllm.tokenizer import LLMTokenizer
    from localllm.tool_calls import style_of

    assert reasons(GPT_OSS_TEMPLATE) == "harmony" and style_of(GPT_OSS_TEMPLATE) == "harmony"
    model_dir = tiny_checkpoint_with_template(tmp_path / "tiny-gpt-oss", GPT_OSS_TEMPLATE)
    tok = LLMTokenizer.from_dir(model_dir)
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    text = render_chat(GPT_OSS_TEMPLATE, [*turn[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        turn[3]], tools=[WEATHER], bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny, 21 C"<|end|>'
            '<|start|>assistant') in text and "city: string,\n" in text and text.endswith("<|start|>assistant")
    with running("--ctx", "1024", "--kv-memory", "20MiB", "--threads", "1", "--enforce-eager",
                 model=str(model_dir)) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=str(model_dir), messages=turn, tools=[WEATHER], max_tokens=2,
                                      temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(text))
