"""What a new user meets first (issue #28): plain `localllm serve` (every local model on demand, no
flags) answers every API for every name of the embedded model; Ollama's documented `curl -d` form
(no JSON Content-Type) works on every /api/ route; a load failure says what to change with a 4xx or
503; a long prompt argument is a prompt, and a name too long for any file system is an unknown model
everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from server_proc import running

EXE = [sys.executable, "-m", "localllm.cli"]
NAMES = ["smollm2:135m", "smollm2-135m:latest", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"]
LONG_NAME = "m" * 300  # over the 255 bytes a file name may have


def cli(*args: str, stdin: str = "", timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*EXE, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def server():
    """`localllm serve` exactly as the README's quick start has it: no MODEL, no sizing flags."""
    with running(model=None) as s:
        yield s


def post_raw(server, path: str, body: dict, content_type: str | None) -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(server.base + path, content=json.dumps(body).encode(), headers=headers, timeout=120)


def chat_body(name: str, **kw) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": False, "options": {"temperature": 0, "num_predict": 8}, **kw}


# ---- plain `localllm serve` loads the default model on demand ------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_plain_serve_answers_every_api_for_every_name(server, name):
    r = httpx.post(server.base + "/api/chat", json=chat_body(name), timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["message"]["content"]
    r = httpx.post(server.base + "/api/generate", json={"model": name, "prompt": "The capital of France is",
                                                         "stream": False, "options": {"num_predict": 4}}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
        "model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_plain_serve_takes_num_ctx(server):
    r = httpx.post(server.base + "/api/chat", json=chat_body("smollm2:135m", options={"num_ctx": 2048,
                                                                                      "num_predict": 4}), timeout=120)
    assert r.status_code == 200, r.text
    ps = httpx.get(server.base + "/api/ps", timeout=30).json()["models"]
    assert [m["context_length"] for m in ps if m["name"].startswith("smollm2-135m")] == [2048], ps


def test_official_ollama_client_on_plain_serve(server):
    import ollama

    c = ollama.Client(host=server.base, timeout=120)
    assert any(m.model.startswith("smollm2-135m") for m in c.list().models)
    r = c.chat(model="smollm2:135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
               options={"temperature": 0, "num_predict": 8})
    assert "Paris" in r.message.content
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = c.generate(model="smollm2:135m", prompt="Name a city as JSON.", format=schema,
                   options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(r.response)["city"], str)


def test_logit_bias_on_plain_serve(server):
    def first_token(**kw) -> int:
        r = httpx.post(server.base + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
            "logprobs": 0, **kw})
        assert r.status_code == 200, r.text
        ids = httpx.post(server.base + "/tokenize", timeout=30, json={
            "model": "smollm2", "prompt": r.json()["choices"][0]["text"], "add_special_tokens": False}).json()
        return ids["tokens"][0]

    free = first_token()
    assert first_token(logit_bias={str(free): -100}) != free
    assert first_token(logit_bias={"42": 100}) == 42


# ---- Ollama's curl -d form: the body is JSON whatever the Content-Type says ----------------------
@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_api_routes_read_json_whatever_the_content_type(server, content_type):
    r = post_raw(server, "/api/chat", chat_body("smollm2:135m"), content_type)
    assert r.status_code == 200 and "Paris" in r.json()["message"]["content"], r.text
    r = post_raw(server, "/api/generate", {"model": "smollm2:135m", "prompt": "Hi", "stream": False,
                                           "options": {"num_predict": 2}}, content_type)
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    r = post_raw(server, "/api/show", {"model": "smollm2:135m"}, content_type)
    assert r.status_code == 200 and "template" in r.json(), r.text
    r = post_raw(server, "/api/pull", {"model": "smollm2:135m", "stream": False}, content_type)
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    r = post_raw(server, "/api/embed", {"model": "all-minilm", "input": "hi"}, content_type)
    assert r.status_code == 200 and len(r.json()["embeddings"][0]) == 384, r.text


def test_curl_as_ollamas_docs_write_it(server):
    """The request exactly as Ollama's API docs print it: `curl URL -d '{...}'` (form content type)."""
    curl = shutil.which("curl")
    assert curl, "curl is part of the test machine's image"
    body = '{"model": "smollm2:135m", "messages": [{"role": "user", "content": "why is the sky blue?"}], ' \
           '"stream": false, "options": {"num_predict": 8}}'
    out = subprocess.run([curl, "-s", server.base + "/api/chat", "-d", body], capture_output=True, text=True,
                         timeout=120)
    reply = json.loads(out.stdout)
    assert reply["done"] is True and reply["message"]["role"] == "assistant" and reply["message"]["content"]


def test_litellm_ollama_chat_request_shape(server):
    """aider's `--model ollama_chat/...` goes through litellm, which posts this body with no
    Content-Type header at all (and `ollama/...` the /api/generate one)."""
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Hi"}],
            "options": {"num_predict": 4, "temperature": 0}, "stream": False}
    r = httpx.post(server.base + "/api/chat", content=json.dumps(body).encode(), timeout=120)
    assert "content-type" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 200, r.text
    body = {"model": "smollm2:135m", "prompt": "Hi", "options": {"num_predict": 4}, "stream": False}
    r = httpx.post(server.base + "/api/generate", content=json.dumps(body).encode(), timeout=120)
    assert r.status_code == 200 and r.json()["response"] is not None, r.text


# ---- names too long to be paths ------------------------------------------------------------------
def test_long_names_are_unknown_models_on_the_server(server):
    r = httpx.post(server.base + "/api/pull", json={"model": LONG_NAME, "stream": False}, timeout=30)
    assert r.status_code == 404 and "not found" in r.json()["error"], r.text  # Ollama's words for it
    r = httpx.request("DELETE", server.base + "/api/delete", json={"model": LONG_NAME}, timeout=30)
    assert r.status_code == 404 and "not found" in r.json()["error"], r.text
    r = httpx.post(server.base + "/api/chat", json=chat_body(LONG_NAME), timeout=30)
    assert r.status_code == 404, r.text


@pytest.mark.parametrize("command", [["show"], ["rm"], ["pull"], ["run"]])
def test_long_names_are_unknown_models_on_the_cli(command):
    r = cli(*command, "./" + LONG_NAME, *(["hi"] if command == ["run"] else []))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("Error: unknown model") and "(302 characters)" in r.stderr, r.stderr


def test_a_long_prompt_argument_is_a_prompt():
    prompt = "Repeat the word cat. " * 476 + "Now say: done"  # 10,009 characters, one argument
    assert len(prompt) > 10_000
    r = cli("run", "--temperature", "0", "-n", "2", "-v", prompt)
    assert r.returncode == 0, r.stderr
    assert "completion tokens: 2" in r.stderr and "Traceback" not in r.stderr


# ---- sizing: what the planner counts is what the engine allocates ---------------------------------
def test_max_memory_plan_is_the_engines_allocation():
    """`--max-memory` made the engine refuse the planner's own KV budget (it lacked the null block)."""
    from localllm.config import EngineConfig
    from localllm.llm import build_engine
    from localllm.planner import plan_for

    p = plan_for("smollm2-135m", "auto", 4.0)
    engine = build_engine("smollm2-135m", "auto", "cpu", EngineConfig(compile=False), max_memory=4.0)
    c = engine.model_config
    per_block = c.kv_bytes_per_token(engine.loaded.kv_dtype.itemsize) * engine.config.block_size
    assert engine.max_model_len == p.ctx
    assert engine.num_blocks * per_block == p.kv_bytes


def test_run_with_max_memory_answers():
    r = cli("run", "--max-memory", "4", "--temperature", "0", "-n", "8", "What is the capital of France?")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr


def test_load_failures_say_what_to_change():
    from localllm.hub import HubError
    from localllm.planner import PlanError
    from localllm.server.pool import load_error

    e = load_error("m", ValueError("--kv-memory 0.01 GiB holds 400 tokens, less than one 4096-token context"))
    assert (e.status, e.code, e.param) == (400, "model_load_failed", "model") and "--kv-memory" in e.message
    assert load_error("m", PlanError("needs 9 GiB")).status == 400
    e = load_error("m", MemoryError())
    assert e.status == 503 and e.headers == {"Retry-After": "5"} and "memory" in e.message
    assert load_error("m", RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")).status == 503
    assert load_error("m", HubError("connection refused")).status == 502
    assert load_error("m", RuntimeError("a bug of ours")).status == 500


def test_a_kv_memory_the_user_set_too_small_is_a_400_naming_it():
    with running("--kv-memory", "1MiB", model=None) as s:
        r = httpx.post(s.base + "/api/chat", json=chat_body("smollm2:135m"), timeout=120)
        assert r.status_code == 400 and "--kv-memory" in r.json()["error"], r.text
        r = httpx.post(s.base + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 400 and "--kv-memory" in r.json()["error"]["message"], r.text


def test_pinned_model_that_cannot_load_ends_the_server(tmp_path):
    """`localllm serve FILE` whose file is broken: one line saying why, exit 1 (nothing to serve)."""
    from server_proc import free_port

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 996)
    r = cli("serve", str(bad), "--port", str(free_port()), timeout=120)
    assert r.returncode == 1, r.stderr
    assert f"Error: could not load {bad}: " in r.stderr and "unsupported GGUF version" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
