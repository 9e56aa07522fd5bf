"""Tool calling (issue #17): the calls a model writes parsed out of its text in the three families'
formats, whole and over any cut of the stream; on a real server (a 2-layer model with Qwen3's
published template, which teaches Hermes-style <tool_call>), tools reach the template, required
and named calls are forced by a grammar and come back as tool_calls (whole and streamed, arguments
valid against the tool's schema), the deprecated functions API maps onto it, and assistant
tool_calls and tool turns are carried back into the prompt as transformers renders them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import pytest
from hub_mirror import HubMirror, make_repo, tiny_checkpoint_with_template
from server_proc import openai_client, running

from localllm.chat import render_chat
from localllm.server.tools import template_messages
from localllm.tool_calls import ToolCallStream, forcing_grammar, parse

TOOLS_MODEL = "test-org/tiny-tools"
QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


# ---- parsing ---------------------------------------------------------------------------------------
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CASES = [
    (HERMES, "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 1}"}\n</tool_call>', "",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1})]),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]', "", [("get_time", {"zone": "CET"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', "",
     [("get_weather", {"city": "Oslo", "days": 2})]),
    ('  {"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
    ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),  # JSON, not a call of an offered tool
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_and_every_cut_of_the_stream(text, content, calls):
    got_content, got = parse(text, SCHEMAS)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    for size in (1, 2, 5, 13):
        s = ToolCallStream(SCHEMAS)
        streamed = "".join(s.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, got = s.finish()
        assert [(c.name, c.arguments) for c in got] == calls
        if calls:  # no call markup ever reaches content
            assert "tool_call" not in streamed and "{" not in streamed and (streamed + rest).strip() == content
        else:
            assert streamed + rest == text


def test_template_messages_turn_argument_text_into_objects():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]
    assert template_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"zone": "UTC"}'  # the request is not changed


def test_forcing_grammars_compile():
    from localllm.structured import Constraint

    for choice in ("required", "get_time"):
        for style in ("hermes", "json"):
            Constraint.make("grammar", forcing_grammar(SCHEMAS, choice, style))


# ---- a real server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint_with_template(tmp_path_factory.mktemp("qwen3-tools") / "tiny-tools", QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """Plain `localllm serve` (every local model on demand) after the tool-calling model was pulled
    from a loopback hub mirror: the way a user gets a second model onto the README's server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    with HubMirror({TOOLS_MODEL: make_repo(model_dir)}) as mirror:
        env.update(HF_HOME=str(tmp_path_factory.mktemp("hf")), HF_ENDPOINT=mirror.url, HF_HUB_DISABLE_TELEMETRY="1")
        with running("--ctx", "1024", "--threads", "1", "--enforce-eager", model=None, env=env) as s:
            r = httpx.post(s.base + "/api/pull", json={"model": TOOLS_MODEL, "stream": False}, timeout=120)
            assert r.json() == {"status": "success"}, r.text
            yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def prompt_tokens(model_dir):
    from localllm.tokenizer import LLMTokenizer

    tok = LLMTokenizer.from_dir(model_dir)
    return lambda messages, **kw: len(tok.encode(render_chat(QWEN3_TEMPLATE, messages, bos_token=tok.bos_token,
                                                             eos_token=tok.eos_token, **kw)))


def valid(call) -> tuple[str, dict]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, args


def test_tools_reach_the_template_and_none_hides_them(client, model_dir, prompt_tokens):
    kw = dict(model=TOOLS_MODEL, messages=ASK, max_tokens=2, temperature=0)
    auto = client.chat.completions.create(tools=TOOLS, **kw)
    assert auto.usage.prompt_tokens == prompt_tokens(ASK, tools=TOOLS)
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    assert none.usage.prompt_tokens == prompt_tokens(ASK)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_are_forced(client, model_dir, stream):
    kw = dict(model=TOOLS_MODEL, messages=ASK, max_tokens=200, tools=TOOLS)
    for choice, names in (("required", set(SCHEMAS)),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        if not stream:
            r = client.chat.completions.create(tool_choice=choice, temperature=0.8, seed=5, n=2, **kw)
            for c in r.choices:
                assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
                assert {valid(t)[0] for t in c.message.tool_calls} <= names and not c.message.content
                assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)
            continue
        calls, content, reasons = {}, "", []
        for chunk in client.chat.completions.create(tool_choice=choice, temperature=0, stream=True, **kw):
            d = chunk.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                calls.setdefault(t.index, t)
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "tool_calls" and calls and not content.strip()
        assert {valid(t)[0] for t in calls.values()} <= names


def test_deprecated_functions_api(client, model_dir):
    r = client.chat.completions.create(model=TOOLS_MODEL, messages=ASK, max_tokens=200, temperature=0,
                                       functions=[t["function"] for t in TOOLS], function_call={"name": "get_weather"})
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(c.message.function_call.arguments), WEATHER)


def test_tool_turns_are_carried_back(client, model_dir, prompt_tokens):
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = client.chat.completions.create(model=TOOLS_MODEL, messages=convo, tools=TOOLS, max_tokens=2,
                                       temperature=0)
    want = prompt_tokens(template_messages([{**m, "content": m["content"] or ""} for m in convo]), tools=TOOLS)
    assert r.usage.prompt_tokens == want
    text = render_chat(QWEN3_TEMPLATE, template_messages([{**m, "content": m["content"] or ""} for m in convo]),
                       tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text and "sunny, 24 C" in text


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(server, body, param):
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": TOOLS_MODEL, "messages": ASK, "max_tokens": 2,
                                                            **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- Ollama's /api/chat ---------------------------------------------------------------------------------
def test_ollama_tools(server, model_dir, prompt_tokens):
    import ollama

    c = ollama.Client(host=server.base, timeout=120)
    opts = {"temperature": 0, "num_predict": 60}
    # (the client rewrites tools through its own model, dropping keys it does not know: sent raw here)
    r = httpx.post(server.base + "/api/chat", timeout=60, json={
        "model": TOOLS_MODEL, "messages": ASK, "tools": TOOLS, "stream": False,
        "options": {**opts, "num_predict": 2}}).json()
    assert r["prompt_eval_count"] == prompt_tokens(ASK, tools=TOOLS)
    # the reply held (by format) to Llama 3's call shape: it comes back as message.tool_calls
    # (x-guidance, llguidance's schema extension: compact JSON; this 2-layer model pads with spaces forever)
    shape = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": TIME},
             "required": ["name", "parameters"], "additionalProperties": False,
             "x-guidance": {"whitespace_flexible": False}}
    for stream in (False, True):
        parts = c.chat(model=TOOLS_MODEL, messages=ASK, tools=TOOLS, format=shape, options=opts, stream=stream)
        parts = list(parts) if stream else [parts]
        called = [t for p in parts for t in p.message.tool_calls or []]
        assert len(called) == 1 and called[0].function.name == "get_time", parts
        jsonschema.validate(dict(called[0].function.arguments), TIME)
        assert not "".join(p.message.content or "" for p in parts).strip()
    # a call and the tool's answer carried back, as Ollama's clients send them
    convo = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"}]
    r = httpx.post(server.base + "/api/chat", timeout=60, json={
        "model": TOOLS_MODEL, "messages": convo, "tools": TOOLS, "stream": False,
        "options": {**opts, "num_predict": 2}}).json()
    assert r["prompt_eval_count"] == prompt_tokens([{**m, "name": m["tool_name"]} if "tool_name" in m else m
                                                 for m in convo], tools=TOOLS)
    show = httpx.post(server.base + "/api/show", json={"model": TOOLS_MODEL}, timeout=30).json()
    assert {"tools", "thinking"} <= set(show["capabilities"])
    assert show["model_info"]["localllm.tool_calling"] == "template"
