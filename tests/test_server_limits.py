"""`localllm serve` with an API key, a one-sequence batch and a one-request queue: 401s, 429s, CORS,
and a SIGTERM that ends in-flight streams and exits 0 within seconds. One small real server."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from server_proc import running

KEY = "test-key-123"
MODEL = "smollm2-135m"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://localhost:5173"


@pytest.fixture(scope="module")
def server():
    with running("--ctx", "1024", "--kv-memory", "0.05", "--threads", "1", "--api-key", KEY,
                 "--max-num-seqs", "1", "--max-queue", "1", "--cors-origin", ORIGIN) as s:
        yield s


def make_client(server, key=KEY):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60)


def long_stream(client):
    """A streaming request that would run for a long time (ignore_eos), started and first token seen."""
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    return stream, it


def test_health_is_public(server):
    r = httpx.get(server.base + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_wrong_or_missing_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        make_client(server, "wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(server.base + "/v1/chat/completions", headers=headers,
                       json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/metrics").status_code == 401
    # the key is checked before the body is even parsed
    assert httpx.post(server.base + "/v1/completions", content=b"{oops").status_code == 401


def test_right_key_works(server):
    client = make_client(server)
    assert client.models.list().data[0].id == MODEL
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.base + "/metrics", headers=AUTH).status_code == 200


def test_cors_preflight_and_headers(server):
    r = httpx.options(server.base + "/v1/chat/completions",
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.base + "/health", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.base + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_full_queue_is_429_with_retry_after(server):
    client = make_client(server)
    running, _ = long_stream(client)  # takes the only batch slot
    waiting = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True)  # the queue slot
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        running.close()
        waiting.close()
    # the hang-ups free the slots (asynchronously); then requests go through and nothing leaked
    deadline = time.monotonic() + 10
    while server.metrics(AUTH)["localllm_num_requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    m = server.metrics(AUTH)
    assert m["localllm_kv_blocks_used"] == 0 and m["localllm_num_requests_in_flight"] == 0
    assert m['localllm_request_errors_total{code="429"}'] == 1


def test_sigterm_ends_streams_and_exits_0_quickly(server):
    client = make_client(server)
    stream, it = long_stream(client)
    rc, took = server.signal_and_wait(signal.SIGTERM, timeout=20)
    assert rc == 0, server.output()
    assert took < 8, took
    # the in-flight stream was ended with an error event (the client raises it), not left hanging
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            pass
    assert "shutting down" in str(e.value)
    stream.close()
