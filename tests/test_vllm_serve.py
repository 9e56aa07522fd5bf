"""`localllm serve MODEL --engine vllm`: a real server with vLLM's CPU backend as its child, started with
the README's command as printed (the embedded GGUF, which vLLM gets as an HF checkpoint written from
it once), driven by the official `openai` and `ollama` clients. Every
answer is checked against vLLM's own at temperature 0 (asked directly on its port, which /api/ps
reports), cancellation against vLLM's /metrics (its running requests back to 0), and the child's
end against the process table (no orphan even when we are SIGKILLed).

In `make test` (which makes the vLLM environment first, `make setup-vllm`: ~2 min on an idle
machine): the file takes ~95 s on the idle 2-core machine (4 min 47 s on a heavily loaded one),
vLLM's start (`--enforce-eager`) most of it."""

import json
import os
import shlex
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_proc import ServerProc, openai_client
from test_vllm_args import REPO

# short enough to close within max_tokens (the 135M model's greedy integers never end)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def readme_command() -> list[str]:
    """The README's `serve --engine vllm` line (Scaling out), as printed: the embedded GGUF, which
    vLLM gets as an HF checkpoint written from it."""
    lines = [ln.strip() for ln in (REPO / "README.md").read_text().splitlines()
             if ln.strip().startswith("localllm serve smollm2 --engine vllm ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    argv = readme_command()
    bin_ = argv[argv.index("--vllm-bin") + 1]
    if os.environ.get("LOCALLLM_VLLM_BIN"):  # the README's relative path, or the environment `make test` names
        assert Path(os.environ["LOCALLLM_VLLM_BIN"]).resolve() == (REPO / bin_).resolve(), "another vLLM"
    assert (REPO / bin_).is_file(), f"no vLLM at {bin_}: `make setup-vllm`"
    home = tmp_path_factory.mktemp("vllm-home")  # a fresh home: the GGUF's export is written in the run
    s = ServerProc(*argv[3:], model=argv[2], cwd=REPO, env={**os.environ, "LOCALLLM_HOME": str(home)})
    try:
        s.wait_ready(timeout=900)
        assert "vLLM serves Hugging Face checkpoints" in s.output()
        assert len(list((home / "vllm-checkpoints").iterdir())) == 1  # one export, no partial folder left
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def backend(server) -> dict:
    rows = httpx.get(server.base + "/api/ps", timeout=10).json()["models"]
    assert len(rows) == 1
    return rows[0]["backend"]


def direct(backend: dict):
    """The official client on vLLM itself: the reference."""
    import openai

    return openai.OpenAI(base_url=backend["url"] + "/v1", api_key="unused", max_retries=0, timeout=900)


def running(backend: dict) -> float:
    from localllm.server.metrics import parse

    values = parse(httpx.get(backend["url"] + "/metrics", timeout=10).text)
    return sum(v for k, v in values.items() if k.startswith("vllm:num_requests_running"))


def wait_idle(backend: dict, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while (n := running(backend)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return n


def test_openai_chat_stream_and_json_schema_equal_vllms_own(server, backend):
    ours, ref = openai_client(server, timeout=900), direct(backend)
    kw = dict(model="smollm2-135m", messages=ASK, temperature=0, max_tokens=8)
    want = ref.chat.completions.create(**kw).choices[0].message.content
    assert want and ours.chat.completions.create(**kw).choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in ours.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == want
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    kw = dict(model="smollm2-135m", messages=ASK, temperature=0, max_tokens=24, response_format=fmt)
    got = ours.chat.completions.create(**kw).choices[0].message.content
    assert got == ref.chat.completions.create(**kw).choices[0].message.content
    assert set(json.loads(got)) == {"city"}
    assert [m.id for m in ours.models.list().data][0] == backend["model"]


def test_ollama_chat_generate_tags_ps(server, backend):
    import ollama

    client = ollama.Client(host=server.base, timeout=900)
    ref = direct(backend)
    direct_r = ref.chat.completions.create(model=backend["model"], messages=ASK, temperature=0, max_tokens=8)
    want = direct_r.choices[0].message.content
    r = client.chat(model="smollm2-135m", messages=ASK, options={"temperature": 0, "num_predict": 8})
    # (the 8th greedy token is the end of turn: vLLM says "stop", and so must we, with its count)
    assert (r.message.content, r.done_reason, r.eval_count) == (
        want, direct_r.choices[0].finish_reason, direct_r.usage.completion_tokens)
    parts = list(client.chat(model="smollm2-135m", messages=ASK, stream=True,
                             options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done
    g = client.generate(model="smollm2-135m", prompt=ASK[0]["content"], options={"temperature": 0, "num_predict": 8})
    assert g.response == want
    # format (a JSON schema): held by vLLM's llguidance backend, as response_format is on /v1 above
    j = client.chat(model="smollm2-135m", messages=ASK, format=SCHEMA, options={"temperature": 0, "num_predict": 24})
    assert set(json.loads(j.message.content)) == {"city"}
    names = [m.model for m in client.list().models]
    assert len(names) == 1 and "smollm2-135m" in names[0]
    ps = httpx.get(server.base + "/api/ps", timeout=10).json()["models"][0]
    card = httpx.get(backend["url"] + "/v1/models", timeout=10).json()["data"][0]
    assert ps["backend"]["engine"] == "vllm" and ps["context_length"] == card["max_model_len"]
    text = httpx.get(server.base + "/metrics", timeout=10).text
    assert "localllm_http_requests_total" in text and "vllm:num_requests_running" in text


def test_cancelling_frees_vllms_request(server, backend):
    """A client that hangs up mid-stream, on /v1 (passed through) and on /api/chat (translated):
    vLLM's running requests go back to 0 (bounded wait), long before the 1500 tokens are done."""
    assert wait_idle(backend) == 0
    body = {"model": "smollm2-135m", "messages": ASK, "max_tokens": 1500, "temperature": 0.8, "stream": True,
            "ignore_eos": True}
    for url, payload in ((server.base + "/v1/chat/completions", body),
                         (server.base + "/api/chat", {"model": "smollm2-135m", "messages": ASK, "stream": True,
                                                      "options": {"num_predict": 1500, "temperature": 0.8}})):
        with httpx.stream("POST", url, json=payload, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            deadline = time.monotonic() + 30  # vLLM's gauges follow its steps: a bounded wait
            while running(backend) != 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert running(backend) == 1  # still generating while we hold the stream
        assert wait_idle(backend) == 0, url


def test_the_child_ends_with_us_even_when_we_are_killed(server, backend):
    pgid = backend["pid"]
    os.killpg(pgid, 0)  # vLLM's group is alive
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.monotonic() + 90
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
            time.sleep(0.5)
        except ProcessLookupError:
            alive = False
    assert not alive, f"vLLM's process group {pgid} outlived us"
