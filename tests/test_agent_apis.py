"""The APIs agents speak (issue #33), through their official clients against one real plain
`localllm serve --api-key` (every local model on demand; the embedded SmolLM2-135M, whose chat
template takes no tools, is the default): OpenAI's Responses API (`client.responses.create` plain,
streamed, a function-tool round trip, `text.format` json_schema), the openai-agents SDK on its
Responses model and on OpenAIChatCompletionsModel, Anthropic's Messages API (`messages.create`
plain, streamed, a tool_use/tool_result round trip, `count_tokens`, its error shape and
`x-api-key`), and generic tool calling (llama.cpp's format: the tools told in a system message,
the reply held to `{"tool_call": ...}` or `{"response": ...}`) through the openai SDK, LangChain's
`bind_tools` (langchain-openai and langchain-ollama) and the ollama client. Every reply is greedy
(temperature 0), so the same prompt gives the same tokens on every API: each front end is checked
against /v1/chat/completions on the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_proc import running

from localllm.generic_calls import GenericStream, parse
from localllm.server.generic_tools import messages as generic_messages

KEY = "sk-agents"
MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                                "parameters": WEATHER}}]
ASK = "What is the weather in Paris?"
RESULT = "sunny, 24 C"
FRANCE = "What is the capital of France?"
CALL_TEXT = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'


@pytest.fixture(scope="module")
def server():
    with running("--threads", "1", "--enforce-eager", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def tokens(server, text: str) -> int:
    r = httpx.post(server.base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return r.json()["count"]


# ---- the generic format, parsed ------------------------------------------------------------------
ANSWER = '{"response": "Say \\"hi\\" \\u00e9\\ud83d\\ude00\\n\\\\ end"}'


def test_generic_replies_parse_and_stream_over_every_cut():
    names = {"get_weather": WEATHER}
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    assert parse(call, names) == ("", [("get_weather", {"city": "Paris"})])
    assert parse(ANSWER, names) == (json.loads(ANSWER)["response"], [])
    assert parse('{"tool_call": {"name": "rm_rf", "arguments": {}}}', names)[1] == []  # not an offered tool
    assert parse('{"response": "cut sho', names) == ("cut sho", [])  # max_tokens ended it
    assert parse('{"response": {"city": "Oslo"}}', names) == ('{"city": "Oslo"}', [])  # a structured answer
    for size in (1, 2, 3, 7):
        for text, content, calls in ((ANSWER, json.loads(ANSWER)["response"], []),
                                     (call, "", [("get_weather", {"city": "Paris"})])):
            s = GenericStream(names)
            streamed = "".join(s.feed(text[i:i + size]) for i in range(0, len(text), size))
            rest, got = s.finish()
            assert (streamed + rest, got) == (content, calls), size


# a template that knows only user/assistant/system turns (as Gemma's and Llama 2's raise on others)
STRICT_ROLES = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                "[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}")


def test_generic_turns_fit_the_template():
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": RESULT}]
    out = generic_messages(convo, CHAT_TOOLS, STRICT_ROLES)
    tool_turn = json.dumps({"tool_response": {"name": "get_weather", "content": RESULT}})
    assert [(m["role"], m["content"]) for m in out[1:]] == [("user", ASK), ("assistant", CALL_TEXT),
                                                           ("user", tool_turn)]  # no tool role here
    assert out[0]["content"].startswith("Be brief.\n\nRespond in JSON format") and '"get_weather"' in out[0]["content"]
    assert generic_messages(convo, None, None)[3] == {"role": "tool", "content": tool_turn}  # ChatML writes any role
    assert generic_messages(convo[:2], None, STRICT_ROLES) == convo[:2]  # no tools, no tool turns: unchanged


# ---- generic tool calling through the clients ------------------------------------------------------
def expected_prompt(turns: list[tuple[str, str]]) -> str:
    """SmolLM2's ChatML rendering of the conversation as the generic format writes its tool turns
    (no tools offered in the last turn: no system message of ours, the template's default one)."""
    head = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    return head + "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


CARRIED = [("user", ASK), ("assistant", CALL_TEXT),
           ("tool", json.dumps({"tool_response": {"name": "get_weather", "content": RESULT}}))]


def test_openai_sdk_tool_round_trip(server, client):
    first = chat(client, [{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=60)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools are told in a system message: longer than the template's default one
    assert first.usage.prompt_tokens > tokens(server, expected_prompt([("user", ASK)]))
    convo = [{"role": "user", "content": ASK}, first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = chat(client, convo, tools=CHAT_TOOLS, tool_choice="none", max_tokens=12)
    assert final.usage.prompt_tokens == tokens(server, expected_prompt(CARRIED))
    assert final.choices[0].message.content.strip() and not final.choices[0].message.tool_calls
    # streamed: the call comes as one delta.tool_calls, no JSON in content
    calls, content = [], ""
    for chunk in chat(client, [{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=60, stream=True):
        content += chunk.choices[0].delta.content or ""
        calls += chunk.choices[0].delta.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content == ""


def test_langchain_bind_tools(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        return RESULT

    for llm in (ChatOpenAI(base_url=server.base + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=60,
                           max_retries=0),
                ChatOllama(base_url=server.base, model=MODEL, temperature=0, num_predict=60,
                           client_kwargs={"headers": {"Authorization": f"Bearer {KEY}"}})):
        ask = [HumanMessage(ASK)]
        ai = llm.bind_tools([get_weather]).invoke(ask)
        assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})], type(llm)
        result = get_weather.invoke(ai.tool_calls[0])  # a ToolMessage answering the call
        assert isinstance(result, ToolMessage) and result.content == RESULT
        final = llm.invoke([*ask, ai, result])  # the answer, with the result in its prompt
        assert isinstance(final.content, str) and final.content.strip() and not final.tool_calls, type(llm)
        prompt_tokens = (final.usage_metadata or {}).get("input_tokens")
        assert prompt_tokens == tokens(server, expected_prompt(CARRIED)), type(llm)


def test_ollama_client_tool_round_trip(server):
    import ollama

    c = ollama.Client(host=server.base, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    opts = {"temperature": 0, "num_predict": 60}
    ask = [{"role": "user", "content": ASK}]
    r = c.chat(model=MODEL, messages=ask, tools=CHAT_TOOLS, options=opts)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}
    assert not r.message.content
    convo = [*ask, r.message, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    final = c.chat(model=MODEL, messages=convo, options=opts)
    assert final.message.content.strip() and not final.message.tool_calls
    assert final.prompt_eval_count == tokens(server, expected_prompt(CARRIED))
    show = c.show(MODEL)
    assert "tools" in show.capabilities and show.modelinfo["localllm.tool_calling"] == "generic"


# ---- the Responses API -------------------------------------------------------------------------------
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
               "parameters": WEATHER, "strict": True}]


def test_responses_plain_and_streamed_equal_chat(client):
    want = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FRANCE}],
                max_tokens=20)
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=FRANCE, temperature=0,
                                max_output_tokens=20)
    assert r.status == "completed" and r.output_text == want.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.store is False
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input=FRANCE, temperature=0,
                                          max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    cut = client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_function_tool_round_trip(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=RESP_TOOLS, temperature=0, max_output_tokens=60)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    streamed = list(client.responses.create(model=MODEL, input=ASK, tools=RESP_TOOLS, temperature=0,
                                            max_output_tokens=60, stream=True))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"} and streamed[-1].type == "response.completed"
    # the call and its output carried back (as the SDK's items), answered without tools
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    final = client.responses.create(model=MODEL, input=items, tools=RESP_TOOLS, tool_choice="none", temperature=0,
                                    max_output_tokens=12)
    same = chat(client, [{"role": "user", "content": ASK},
                         {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                             "name": "get_weather", "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}],
                tools=CHAT_TOOLS, tool_choice="none", max_tokens=12)
    assert final.output_text == same.choices[0].message.content and final.output_text.strip()
    assert final.usage.input_tokens == same.usage.prompt_tokens


def test_responses_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a city and its country as JSON.", temperature=0,
                                max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    # with tools too (an agent with an output type): a call, or an answer held to the schema inside
    # the generic JSON and unwrapped from it
    both = client.responses.create(model=MODEL, input="Name a city and its country as JSON.", temperature=0,
                                   max_output_tokens=60, tools=RESP_TOOLS,
                                   text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    (item,) = both.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), WEATHER)
    else:
        jsonschema.validate(json.loads(both.output_text), schema)


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_errors_name_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/responses", json={"model": MODEL, "input": "hi", **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- the openai-agents SDK ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["default", "chat_completions"])
def test_openai_agents_run_a_function_tool(server, kind):
    """`default`: the SDK's own model for a model name, through its OpenAI provider pointed at us:
    its Responses model (the response ids it records are ours, resp_...)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIProvider,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing leaves the machine (the SDK would upload traces to OpenAI)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        calls.append(city)
        return RESULT

    aclient = AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = MODEL if kind == "default" else OpenAIChatCompletionsModel(MODEL, aclient)
    # the tool's result is the final output: a 135M model asked again would call the tool again
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, ASK, run_config=RunConfig(model_provider=OpenAIProvider(openai_client=aclient)))
    assert calls == ["Paris"] and result.final_output == RESULT
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    if kind == "default":
        assert [r.response_id[:5] for r in result.raw_responses] == ["resp_"]


# ---- Anthropic's Messages API ------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # this SDK no longer has the parameter; the API still takes it


def test_anthropic_plain_streamed_and_count_tokens(client, claude):
    want = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FRANCE}],
                max_tokens=20)
    kw = dict(model=MODEL, max_tokens=20, system="Be brief.", messages=[{"role": "user", "content": FRANCE}])
    m = claude.messages.create(**kw, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.choices[0].message.content
    assert m.stop_reason == "end_turn" and m.role == "assistant" and m.id.startswith("msg_")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=kw["messages"])
    assert count.input_tokens == m.usage.input_tokens
    events = list(claude.messages.create(**kw, stream=True, extra_body=GREEDY))
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == m.usage.output_tokens
    with claude.messages.stream(**kw, extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == m.content[0].text
    stopped = claude.messages.create(**kw, stop_sequences=["Paris"], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert stopped.content[0].text == m.content[0].text.split("Paris")[0]


def test_anthropic_tool_use_round_trip(client, claude):
    tools = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": ASK}]
    m = claude.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=ask, extra_body=GREEDY)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and (use.name, use.input) == ("get_weather",
                                                                                              {"city": "Paris"})
    # the tools told in the system message count too
    assert claude.messages.count_tokens(model=MODEL, tools=tools, messages=ask).input_tokens == m.usage.input_tokens
    events = list(claude.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=ask, stream=True,
                                         extra_body=GREEDY))
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"} and events[-2].delta.stop_reason == "tool_use"
    convo = [*ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    final = claude.messages.create(model=MODEL, max_tokens=12, tools=tools, tool_choice={"type": "none"},
                                   messages=convo, extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    same = chat(client, [*ask, {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": RESULT}], max_tokens=12)
    assert final.content[0].text == same.choices[0].message.content and final.content[0].text.strip()
    count = claude.messages.count_tokens(model=MODEL, tools=tools, tool_choice={"type": "none"}, messages=convo)
    assert count.input_tokens == final.usage.input_tokens == same.usage.prompt_tokens
    # tool_choice any: a call is forced
    forced = claude.messages.create(model=MODEL, max_tokens=60, tools=tools, tool_choice={"type": "any"},
                                    messages=[{"role": "user", "content": "Hello!"}], extra_body=GREEDY)
    assert forced.stop_reason == "tool_use" and forced.content[-1].name == "get_weather"


def test_anthropic_errors_and_key(server, claude):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-no-such", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.base + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    bad = anthropic.Anthropic(base_url=server.base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Incorrect API key provided."}}


# ---- fuzz: never a 5xx, always the API's own error shape ---------------------------------------------
def _fuzz_bodies(path: str):
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=20), st.sampled_from(["", "a\ud800b", "<|im_end|>", "😀"]))
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 40), 2 ** 40), st.floats(allow_nan=False), text)
    junk = st.recursive(scalar, lambda c: st.one_of(st.lists(c, max_size=3),
                                                  st.dictionaries(st.text(max_size=8), c, max_size=3)),
                        max_leaves=6)
    tool = st.one_of(st.just(RESP_TOOLS[0] if "responses" in path else
                             {"name": "get_weather", "input_schema": WEATHER}), junk)
    few = st.one_of(st.integers(1, 3), st.sampled_from([0, -1, True, "2", 1.5]))
    if "responses" in path:
        item = st.one_of(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "wizard"]),
                                   "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                       {"type": st.sampled_from(["input_text", "input_image"]), "text": text}),
                                       max_size=2))}),
            st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text,
                                   "arguments": st.one_of(text, junk)}),
            st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": junk}),
            junk)
        required = {"input": st.one_of(text, st.lists(item, min_size=1, max_size=3)), "max_output_tokens": few}
        optional = {"instructions": st.one_of(text, junk), "tools": st.lists(tool, max_size=2),
                    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), junk),
                    "text": junk, "reasoning": junk, "stream": st.booleans(), "temperature": st.floats(0, 2)}
    else:
        block = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                          st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                                                 "input": junk}),
                          st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text,
                                                 "content": st.one_of(text, junk)}), junk)
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                         "content": st.one_of(text, st.lists(block, max_size=2))})
        required = {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), junk), "max_tokens": few}
        optional = {"system": st.one_of(text, junk), "tools": st.lists(tool, max_size=2),
                    "tool_choice": junk, "thinking": junk, "stop_sequences": junk, "stream": st.booleans(),
                    "temperature": st.floats(0, 2)}
    return st.fixed_dictionaries(required, optional=optional)


@pytest.mark.slow  # ~30 s of requests on a busy 2-core machine: make test-slow
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_fuzzed_requests_never_5xx(server, path):
    from hypothesis import HealthCheck, given, settings

    statuses = []

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_fuzz_bodies(path))
    def check(body):
        raw = json.dumps({"model": MODEL, **body}).encode()  # lone surrogates as \\u escapes: legal JSON
        r = httpx.post(server.base + path, content=raw, headers={"x-api-key": KEY, "content-type": "application/json"},
                       timeout=60)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            err = r.json()
            shape = set(err["error"]) == {"type", "message"} and err["type"] == "error" if "messages" in path \
                else set(err["error"]) == {"message", "type", "param", "code"}
            assert shape, r.text
        elif body.get("stream"):
            assert ("message_stop" if "messages" in path else "response.completed") in r.text or \
                "response.incomplete" in r.text, r.text[-300:]
        statuses.append(r.status_code)

    check()
    assert statuses.count(200) >= 3 and statuses.count(400) >= 10, statuses  # both paths taken


@pytest.mark.slow  # a second server (~20 s on a busy 2-core machine): make test-slow
def test_speculation_gives_every_api_the_same_replies(client, claude):
    """`serve smollm2-135m --draft ngram` (a draft pairing is per model, so pinned): a Responses function call, a json_schema answer, an Anthropic tool_use
    and a generic chat tool call come out token for token as without speculation (greedy: the
    verified tokens are the target's own), with proposals accepted on the way."""
    import anthropic
    import openai

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}]

    def replies(oc, ac) -> list:
        call = oc.responses.create(model=MODEL, input=ASK, tools=RESP_TOOLS, temperature=0, max_output_tokens=60)
        text = oc.responses.create(model=MODEL, input="Name a city as JSON.", temperature=0, max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
        use = ac.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=[{"role": "user", "content": ASK}],
                                 extra_body=GREEDY)
        gen = chat(oc, [{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=60)
        return [(call.output[0].name, call.output[0].arguments), text.output_text,
                [(b.type, getattr(b, "input", None)) for b in use.content],
                [(c.function.name, c.function.arguments) for c in gen.choices[0].message.tool_calls or []]]

    plain = replies(client, claude)
    with running("--threads", "1", "--enforce-eager", "--api-key", KEY, "--draft", "ngram", model=MODEL) as spec:
        oc = openai.OpenAI(base_url=spec.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        ac = anthropic.Anthropic(base_url=spec.base, api_key=KEY, max_retries=0, timeout=120)
        assert replies(oc, ac) == plain
        metrics = httpx.get(spec.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("localllm_spec_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, metrics
