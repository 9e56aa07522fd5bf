"""Structured output and logit_bias through `localllm serve` (issue #17), with the official `openai`
and `ollama` clients against one real server: OpenAI's response_format (json_object, json_schema as
LangChain / the client's .parse send it), vLLM's guided_* and structured_outputs, Ollama's format;
outputs parse and validate with jsonschema, streamed and not, n > 1; bad schemas, regexes and
grammars are a 400 naming the field with llguidance's message."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import ollama
import pytest
from pydantic import BaseModel
from server_proc import openai_client, running

MODEL = "smollm2-135m"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def server():
    with running("--ctx", "1024", "--threads", "1", "--enforce-eager") as s:  # plain serve: on demand
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


def error_of(resp, param: str) -> str:
    """The 400's message; its param is `param` (or a path under it, e.g. logit_bias.1)."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
    return err["message"]


# ---- response_format ----------------------------------------------------------------------------
def test_json_schema_n2_sampled_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, temperature=0.9, seed=3, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_streamed_equals_not_streamed(client):
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole.message.content and reasons[-1] == "stop"


class Person(BaseModel):
    name: str
    age: int


def test_strict_json_schema_as_the_client_parse_sends_it(client):
    """client.chat.completions.parse (what LangChain's with_structured_output uses): a strict
    json_schema built from a pydantic model; the reply parses back into the model."""
    r = client.chat.completions.parse(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                      response_format=Person)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and isinstance(p.age, int)


def test_text_format_is_free_text(client):
    free = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    text = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


# ---- vLLM's fields, on both routes -------------------------------------------------------------------
def test_guided_fields_on_completions(client):
    def complete(**extra):
        return client.completions.create(model=MODEL, prompt="My phone number is", temperature=0, max_tokens=20,
                                         extra_body=extra).choices[0]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", complete(guided_regex=r"[0-9]{3}-[0-9]{4}").text)
    assert complete(guided_choice=["home", "work"]).text in ("home", "work")
    jsonschema.validate(json.loads(complete(guided_json=json.dumps(PERSON)).text), PERSON)  # JSON text too
    g = complete(guided_grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/')
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", g.text), g.text


def test_structured_outputs_field(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, stream=True,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in r if c.choices)), PERSON)
    c = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.8, seed=1, max_tokens=5,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert c.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema", "invalid json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ("/v1/completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid grammar"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "choice"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "JSON"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ("/v1/chat/completions", {"guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex", "not both"),
    ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one structured"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, body, param, says):
    base = {"messages": ASK} if "chat" in path else {"prompt": "Hi"}
    msg = error_of(post(server, path, {**base, "max_tokens": 4, **body}), param)
    assert says in msg, msg


# ---- logit_bias ---------------------------------------------------------------------------------------
def test_logit_bias_moves_greedy_tokens(client, server):
    def tokens(**extra):
        r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
                                      logprobs=0, extra_body=extra)
        return r.choices[0].text
    ids = post(server, "/tokenize", {"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    forced = ids[0]
    piece = httpx.post(server.base + "/detokenize", json={"tokens": [forced] * 3}).json()["prompt"]
    assert tokens(logit_bias={str(forced): 100}) == piece
    greedy = tokens()
    first = post(server, "/tokenize", {"prompt": greedy, "add_special_tokens": False}).json()["tokens"][0]
    banned = tokens(logit_bias={str(first): -100})
    assert banned != greedy and not banned.startswith(
        httpx.post(server.base + "/detokenize", json={"tokens": [first]}).json()["prompt"])
    # on chat, streamed, with the client's own field
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=2, stream=True,
                                            logit_bias={str(forced): 100})
    two = httpx.post(server.base + "/detokenize", json={"tokens": [forced] * 2}).json()["prompt"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == two


@pytest.mark.parametrize("bias", [{"abc": 1}, {"1": 101}, {"1": -100.5}, {"99999999": 1}, {"-1": 1}, {"1": "x"},
                                  "junk"])
def test_malformed_logit_bias_is_400(server, bias):
    for path, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
        msg = error_of(post(server, path, {**base, "max_tokens": 2, "logit_bias": bias}), "logit_bias")
        assert "logit_bias" in msg


# ---- Ollama's format ----------------------------------------------------------------------------------
def test_ollama_format_json_and_schema(server):
    c = ollama.Client(host=server.base, timeout=120)
    r = c.chat(model=MODEL, messages=ASK, format=PERSON, options={"temperature": 0, "num_predict": 60}, stream=False)
    jsonschema.validate(json.loads(r.message.content), PERSON)
    parts = list(c.generate(model=MODEL, prompt="What is the capital of France? Answer in JSON.", format="json",
                            stream=True, options={"temperature": 0, "num_predict": 200}))
    assert parts[-1].done_reason == "stop"
    assert isinstance(json.loads("".join(p.response for p in parts)), dict)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=MODEL, messages=ASK, format={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    assert e.value.status_code == 400 and "format" in e.value.error
    r = httpx.post(server.base + "/api/generate", json={"model": MODEL, "prompt": "x", "format": "yaml"})
    assert r.status_code == 400 and "format" in r.json()["error"]
