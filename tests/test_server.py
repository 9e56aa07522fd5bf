"""`localllm serve` end to end: the official `openai` client against a real server subprocess on
127.0.0.1 (default model, small context and KV cache), started once for this module."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import make_engine
from server_proc import openai_client, running

MODEL = "smollm2-135m"
CTX = 2048


@pytest.fixture(scope="module", params=["on-demand", "pinned"])
def server(request):
    """Both ways the README starts the server: plain `localllm serve` (every local model, loaded on
    the first request) and `localllm serve MODEL`; every test here runs against each."""
    with running("--ctx", str(CTX), "--threads", "1", model=None if request.param == "on-demand" else MODEL) as s:
        s.mode = request.param
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


@pytest.fixture(scope="module")
def reference(int4_model):
    """The in-process engine on the same weights: what the server must answer at temperature 0."""
    from localllm.sampling import SamplingParams

    engine = make_engine(int4_model, max_model_len=CTX)

    def run(prompt, max_tokens):
        outs = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))
        return outs[-1]
    return run


def post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.base + path, json=body, content=content, headers=headers, timeout=60)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- startup, models ---------------------------------------------------------------------------
def test_health_is_503_while_loading_then_200(server):
    assert server.health_codes[-1] == 200
    if server.mode == "pinned":
        assert 503 in server.health_codes, server.health_codes  # it listened before the model was loaded
    else:  # nothing is loaded up front: healthy at once
        assert server.health_codes == [200], server.health_codes
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


def test_models_list(client, server):
    if server.mode == "on-demand":  # a loaded model says its context, as the pinned one does
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    models = client.models.list().data
    assert [m.id for m in models].count(MODEL) == 1
    if server.mode == "pinned":
        assert len(models) == 1
    m = next(m for m in models if m.id == MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "localllm")
    assert isinstance(m.created, int) and m.model_extra["max_model_len"] == CTX
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == CTX


# ---- completions -------------------------------------------------------------------------------
def test_chat_completion_matches_engine(client, server, reference):
    messages = [{"role": "user", "content": "Name a large animal that lives in the ocean."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref = reference(messages, 12)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == ref.text
    assert c.finish_reason == ref.finish_reason
    n_prompt = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt == ref.num_prompt_tokens
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_text_completion_matches_engine(client, reference):
    prompt = "The three primary colors are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    ref = reference(prompt, 10)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == ref.text and ref.text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_model_may_be_alias_or_hub_repo(client):
    for name in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert r.model == MODEL


def test_token_id_prompt_and_stop_string(client, server):
    ids = post(server, "/tokenize", {"prompt": "1, 2, 3, 4,"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    text = by_text.choices[0].text
    stop = text.strip()[:2]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_prefix_cache_hits_show_in_usage(client):
    system = "You are a terse assistant. " * 12  # several full KV blocks shared by both requests
    usage = [client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": q}]).usage
        for q in ("What is 2+2?", "What is 3+3?")]
    assert usage[0].prompt_tokens > 64
    assert usage[1].prompt_tokens_details.cached_tokens >= 48  # the system prompt's blocks
    assert usage[1].prompt_tokens_details.cached_tokens < usage[1].prompt_tokens


def test_n_choices_and_prompt_list(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 2 * one.usage.completion_tokens
    batch = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky is"], max_tokens=5,
                                      temperature=0)
    assert batch.choices[0].text == one.choices[0].text and len(batch.choices) == 2


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the most likely
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens).startswith(c.choices[0].text) and lp.text_offset[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs)


# ---- streaming -----------------------------------------------------------------------------------
def sse_events(resp) -> list[str]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), raw
    return [e[len("data: "):] for e in events]


def test_chat_stream_wire_format_and_equals_non_stream(client, server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk, content_chunks = chunks[-1], chunks[1:-1]
    assert usage_chunk["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    finishes = [c["choices"][0]["finish_reason"] for c in content_chunks]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert streamed == plain.choices[0].message.content and streamed
    u = usage_chunk["usage"]
    assert u["completion_tokens"] == plain.usage.completion_tokens
    assert u["prompt_tokens"] == plain.usage.prompt_tokens
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_completion_stream_with_openai_client(client):
    stream = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    plain = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=10, temperature=0)
    assert text == plain.choices[0].text


# ---- errors ----------------------------------------------------------------------------------------
def test_invalid_json_is_400(server):
    r = post(server, "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "invalid JSON" in assert_error(r, 400)["message"]
    assert_error(post(server, "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400)


def test_schema_violations_name_the_field(server):
    assert "messages" in assert_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400,
                                      param="messages")["message"]
    assert_error(post(server, "/v1/chat/completions", {"messages": [], "model": MODEL}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "max_tokens": "lots"}), 400,
                 param="max_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, param="temperature")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"content": "x"}]}), 400,
                 param="messages.0.role")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "seed": 2 ** 70}), 400, param="seed")


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -5),
                                         ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -9),
                                         ("repetition_penalty", 0), ("max_tokens", 0)])
def test_bad_sampling_value_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       **({"max_tokens": 4} if field != "max_tokens" else {}),
                                       extra_body={field: value})
    assert e.value.param == field and field in e.value.message


def test_other_bad_requests_are_4xx(client, server):
    for body, param in [
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ]:
        assert_error(post(server, "/v1/chat/completions", body), 400, param=param)
    assert_error(post(server, "/v1/completions", {"prompt": [10 ** 9]}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, param="prompt")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, param="tokens")
    r = httpx.get(server.base + "/v1/nothing-here")
    assert_error(r, 404)


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, code="model_not_found")


def test_context_length_exceeded_names_both_counts(client, server):
    messages = [{"role": "user", "content": "Hello there"}]
    n_prompt = post(server, "/tokenize", {"messages": messages}).json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=CTX)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert f"{CTX} tokens" in e.value.message and f"{n_prompt} in the messages" in e.value.message
    assert f"{CTX} in the completion" in e.value.message
    long_prompt = "hello " * (CTX + 100)  # never silently cut
    n_long = post(server, "/tokenize", {"prompt": long_prompt}).json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert str(n_long) in e.value.message and str(CTX) in e.value.message


def test_no_api_key_needed_when_off(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


# ---- tokenize, metrics -------------------------------------------------------------------------------
def test_tokenize_detokenize_roundtrip(server):
    t = post(server, "/tokenize", {"prompt": "Hello, world!", "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == CTX
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json() == {"prompt": "Hello, world!"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello, world!"}]}).json()
    assert chat["count"] > t["count"]  # the chat template adds its markers
    assert_error(post(server, "/tokenize", {}), 400)


def test_metrics_exposition(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="Metrics are", max_tokens=3, temperature=0)
    m = server.metrics()
    assert m["localllm_model_loaded"] == 1
    assert m['localllm_requests_total{finish_reason="length"}'] == before['localllm_requests_total{finish_reason="length"}'] + 1
    assert m["localllm_generation_tokens_total"] >= before["localllm_generation_tokens_total"] + 3
    assert m["localllm_prompt_tokens_total"] > before["localllm_prompt_tokens_total"]
    assert m["localllm_time_to_first_token_seconds_count"] == before["localllm_time_to_first_token_seconds_count"] + 1
    assert m["localllm_e2e_request_latency_seconds_count"] == before["localllm_e2e_request_latency_seconds_count"] + 1
    assert m['localllm_e2e_request_latency_seconds_bucket{le="+Inf"}'] == m["localllm_e2e_request_latency_seconds_count"]
    for name in ("kv_blocks_used", "kv_blocks_total", "num_requests_running", "num_requests_waiting",
                 "prefix_cache_hit_rate", "max_batch_size"):
        assert f"localllm_{name}" in m
    assert m["localllm_kv_blocks_used"] == 0 and m["localllm_num_requests_running"] == 0
    assert 0 <= m["localllm_prefix_cache_hit_rate"] <= 1


# ---- disconnects and concurrency -------------------------------------------------------------------
def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_kv_blocks(client, server):
    base = server.metrics()
    assert base["localllm_kv_blocks_used"] == 0
    aborted = base['localllm_requests_total{finish_reason="abort"}']
    stream = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 3:
            break
    mid = server.metrics()
    assert mid["localllm_kv_blocks_used"] > 0 and mid["localllm_num_requests_running"] == 1
    stream.close()  # drop the connection mid-stream
    assert wait_for(lambda: server.metrics()["localllm_num_requests_running"] == 0, 10)
    after = server.metrics()
    assert after["localllm_kv_blocks_used"] == 0
    assert after['localllm_requests_total{finish_reason="abort"}'] == aborted + 1
    assert after["localllm_generation_tokens_total"] - base["localllm_generation_tokens_total"] < 1500


def test_sixteen_concurrent_streams_are_batched(server):
    aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    topics = ["cats", "dogs", "rain", "snow", "tea", "bread", "ships", "trains", "stars", "music", "paper",
              "glass", "rivers", "maps", "clocks", "bees"]

    async def one(topic):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write one sentence about {topic}."}],
            max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                usage = c.usage
        return text, finish, usage

    async def main():
        try:
            return await asyncio.gather(*(one(t) for t in topics))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 16
    for text, finish, usage in results:
        assert text and finish in ("stop", "length")
        assert 1 <= usage.completion_tokens <= 16
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    m = server.metrics()
    assert m["localllm_max_batch_size"] >= 4  # they shared engine steps
    assert m["localllm_kv_blocks_used"] == 0 and m["localllm_num_requests_in_flight"] == 0


def test_disconnect_while_waiting_for_non_streamed_answer_aborts(server):
    aborted = server.metrics()['localllm_requests_total{finish_reason="abort"}']
    with pytest.raises(httpx.TimeoutException):  # the client gives up and hangs up
        post_timeout = httpx.Timeout(60, read=1.0)
        httpx.post(server.base + "/v1/completions", timeout=post_timeout,
                   json={"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True})
    assert wait_for(lambda: server.metrics()["localllm_num_requests_running"] == 0, 10)
    m = server.metrics()
    assert m["localllm_kv_blocks_used"] == 0
    assert m['localllm_requests_total{finish_reason="abort"}'] == aborted + 1


def test_clients_hanging_up_at_once_leave_nothing_behind(server):
    """Requests whose clients vanish right after sending (before any event is read) are aborted and
    leave no in-flight count or KV blocks behind."""
    import socket

    body = json.dumps({"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": True,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for i in range(12):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head + body)
            if i % 2:
                s.recv(1)  # half of them wait for the first byte of the answer
    def idle():
        m = server.metrics()
        return (m["localllm_num_requests_in_flight"], m["localllm_num_requests_running"],
                m["localllm_num_requests_waiting"], m["localllm_kv_blocks_used"]) == (0, 0, 0, 0)
    assert wait_for(idle, 20), server.metrics()
    assert server.metrics()["localllm_generation_tokens_total"] < 12 * 1000  # aborted, not run to the end
