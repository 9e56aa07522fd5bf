"""Structured output and logit_bias through `localllm serve` (issue #17), with the official `openai`
and `ollama` clients against one real server: OpenAI's response_format (json_object, json_schema as
LangChain / the client's .parse send it), vLLM's guided_* and structured_outputs, Ollama's format;
outputs parse and validate with jsonschema, streamed and not, n > 1; bad schemas, regexes and
grammars are a 400 naming the field with llguidance's message."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import ollama
import pytest
from hostile_schemas import chain, deep
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


# ---- hostile constraints (issue #29): never a crash, a freeze, or a violating 200 ------------------


LARK_CHAIN = "start: r_0\n" + "\n".join(f'r_{i}: "t_{i}" | r_{i + 1}' for i in range(2999)) + '\nr_2999: "end"'
RECURSIVE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
HOSTILE = [  # (path, body, the field the 400 names, what its message says)
    ("/api/chat", {"format": chain(1000)}, "format", "65536"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "c", "schema": chain(1000)}}}, "response_format.json_schema.schema", "65536"),
    ("/v1/completions", {"guided_json": chain(1000)}, "guided_json", "65536"),
    ("/v1/completions", {"guided_grammar": LARK_CHAIN}, "guided_grammar", "65536"),
    ("/v1/completions", {"guided_choice": [f"choice number {i}" for i in range(100_000)]}, "guided_choice",
     "100000 choices"),
    ("/v1/completions", {"guided_choice": [f"c{i}" for i in range(50_000)]}, "guided_choice", "50000 choices"),
    ("/v1/completions", {"guided_json": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                                     "required": [f"k{i}"]} for i in range(5000)]}},
     "guided_json", "bytes"),
    ("/v1/completions", {"guided_regex": "(" + "|".join(f"w{i}" for i in range(120_000)) + ")"}, "guided_regex",
     "bytes"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                          for i in range(10_000)},
                                         "required": [f"p{i}" for i in range(10_000)]}}, "guided_json", "bytes"),
    ("/v1/chat/completions", {"guided_json": RECURSIVE}, "guided_json", "no output can satisfy it"),
    ("/api/chat", {"format": RECURSIVE}, "format", "no output can satisfy it"),
    ("/v1/completions", {"guided_regex": "(a{1000}){1000}"}, "guided_regex", "unroll to 999985"),
    ("/v1/completions", {"guided_grammar": 'start: s\ns: s "x"'}, "guided_grammar", "no output can satisfy it"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "d", "schema": deep(64)}}}, "response_format.json_schema.schema", "nests too deep"),
    ("/v1/completions", {"guided_json": deep(200)}, "guided_json", "nests too deep"),
    ("/api/chat", {"format": deep(64)}, "format", "nests too deep"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "f", "schema": False}}}, "response_format.json_schema.schema", "accepts no value"),
    ("/v1/completions", {"guided_json": False}, "guided_json", "accepts no value"),
]


class HealthWatch:
    """Polls /health from a thread while a block runs; `worst` is the slowest answer (s)."""

    def __init__(self, server):
        self.server, self.times, self._stop = server, [], threading.Event()

    def __enter__(self):
        def poll():
            while not self._stop.is_set():
                t0 = time.monotonic()
                assert httpx.get(self.server.base + "/health", timeout=10).status_code == 200
                self.times.append(time.monotonic() - t0)
                time.sleep(0.05)
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)

    @property
    def worst(self) -> float:
        return max(self.times)


def _kv_idle(server) -> bool:
    m = server.metrics()
    return (m["localllm_num_requests_in_flight"], m["localllm_kv_blocks_used"]) == (0, 0)


def _body(path: str, extra: dict) -> dict:
    if path == "/api/chat":
        return {"model": MODEL, "messages": ASK, "stream": False, "options": {"num_predict": 4}, **extra}
    base = {"messages": ASK} if "chat" in path else {"prompt": "Hi"}
    return {"model": MODEL, **base, "max_tokens": 4, **extra}


def test_hostile_constraints_are_quick_400s_and_the_server_keeps_answering(server, client):
    """Each of the issue's cases (a $defs chain of 1,000 and a Lark chain of 3,000 that segfaulted
    the server; 100,000 choices, an anyOf of 5,000, a 1 MB regex, 10,000 required properties that
    froze it; recursive $ref, (a{1000}){1000}, an empty left recursion answered as a "stop";
    nesting >= 64, schema false answered 500) is a 400 naming the field within 3 s, while /health
    answers within 1.5 s throughout; then a constrained request answers, and no KV block is held."""
    with HealthWatch(server) as health:
        for path, extra, param, says in HOSTILE:
            t0 = time.monotonic()
            r = post(server, path, _body(path, extra))
            took = time.monotonic() - t0
            if path.startswith("/api/"):  # Ollama's shape: {"error": message}
                assert r.status_code == 400 and param in r.json()["error"], (param, r.text[:300])
                msg = r.json()["error"]
            else:
                msg = error_of(r, param)
            assert says in msg and "Traceback" not in msg and "\n" not in msg, (param, msg)
            assert took < 3.0, (param, took)
    assert health.worst < 1.5, health.times
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                               "schema": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert server.proc.poll() is None and _kv_idle(server), server.metrics()
    assert server.metrics().get('localllm_request_errors_total{code="500"}', 0) == 0


SLOW = 'start: s\ns: s s s s | s s s | s s | "x"'  # ambiguous: each token slower than the last


def test_matcher_failing_mid_way_is_an_error_never_a_stop(server):
    """A grammar that compiles but gets slower per token (past the server's 0.25 s per token after
    ~100 tokens) ends as an error carrying why, streamed: an error event, never a "stop" (not
    streamed, the same error is the 400 of Generation.outputs); /health answers within 2 s
    meanwhile (the matcher holds the GIL while it consumes a token: up to the 0.25 s budget per
    token, on a busy machine more) and no KV block is held afterwards."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "guided_grammar": SLOW, "stream": True}
    with HealthWatch(server) as health:
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert "could not be held to the constraint" in events[-1]["error"]["message"], events[-1]
    assert all(c["finish_reason"] != "stop" for e in events for c in e.get("choices", [])), events
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    assert re.fullmatch("x+", text), text
    assert health.worst < 2.0, health.times
    assert wait_idle(server), server.metrics()


def wait_idle(server, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _kv_idle(server):
            return True
        time.sleep(0.05)
    return False
