"""`localllm serve MODEL --engine vllm --engine-url URL`: our front attached to a vLLM server that is
already running. A stand-in speaks vLLM's side of the protocol (/health, /v1/models, /v1/completions
streaming token ids, /v1/chat/completions, /metrics) and records what it is sent, so these tests check
our side of the wire in the default run: the Ollama routes' prompts as token ids (against
transformers' chat template on the same checkpoint), their options translated to vLLM's fields, the
text streamed back, /v1 passed through as it is, an upstream error answered with vLLM's message, and a
client leaving mid-stream closing the upstream request. The end-to-end run with vLLM's own CPU
backend is tests/test_vllm_serve.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import Request  # at module level: the routes' annotations are looked up here
from server_proc import ServerProc, free_port, openai_client

REPLY = "The capital of France is Paris. It is a big city."


class FakeVLLM:
    """vLLM's OpenAI server as our front sees it, on a loopback port in this process."""

    def __init__(self, tokenizer_file: str, served: str = "tiny", max_len: int = 1024):
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from tokenizers import Tokenizer

        self.tok = tok = Tokenizer.from_file(tokenizer_file)
        self.reply_ids = tok.encode(REPLY, add_special_tokens=False).ids
        self.bodies: list[dict] = []  # /v1/completions requests
        self.chat_bodies: list[dict] = []
        self.headers: list[dict] = []
        self.active = 0  # streams in progress
        self.finished = 0  # streams sent to the end
        self.delay = 0.0
        app = FastAPI()

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": served, "object": "model", "max_model_len": max_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if "FAIL" in body.get("stop", []):
                return JSONResponse({"error": {"message": "stop strings may not say FAIL", "type": "BadRequestError",
                                               "param": "stop", "code": 400}}, status_code=400)
            ids = self.reply_ids[:body["max_tokens"]]

            async def stream():
                self.active += 1
                try:
                    for i, t in enumerate(ids):  # vLLM's incremental detokenization: each chunk's new text
                        text = tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):]
                        last = i == len(ids) - 1
                        reason = ("length" if len(ids) == body["max_tokens"] else "stop") if last else None
                        chunk = {"id": "cmpl-1", "object": "text_completion", "model": served,
                                 "choices": [{"index": 0, "text": text, "token_ids": [t], "finish_reason": reason}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        await asyncio.sleep(self.delay)
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                             "total_tokens": len(body["prompt"]) + len(ids)}
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                    self.finished += 1
                finally:
                    self.active -= 1
            return StreamingResponse(stream(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.chat_bodies.append(body)
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "from vLLM: " + body["messages"][-1]["content"]}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f'vllm:num_requests_running{{model_name="{served}"}} {float(self.active)}\n')

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeVLLM:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the stand-in vLLM did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model.source


@pytest.fixture(scope="module")
def attached(tiny_dir):
    with FakeVLLM(f"{tiny_dir}/tokenizer.json") as fake:
        s = ServerProc("--engine", "vllm", "--engine-url", fake.url, "--api-key", "sk-front", model=tiny_dir)
        try:
            yield s.wait_ready(timeout=120), fake
        finally:
            s.stop()


def key() -> dict:
    return {"Authorization": "Bearer sk-front"}


def chat_ids(tiny_dir: str, messages: list[dict]) -> list[int]:
    """The reference: transformers' rendering of the checkpoint's own chat template."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(tiny_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=True)
    return list(out["input_ids"])


def test_ollama_chat_sends_the_templates_ids_and_streams_vllms_text(attached, tiny_dir):
    import ollama

    server, fake = attached
    client = ollama.Client(host=server.base, headers=key())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    n = len(fake.bodies)
    r = client.chat(model="tiny-llama", messages=messages,
                    options={"temperature": 0, "num_predict": 6, "seed": 7, "stop": ["\n\n"], "top_k": 20})
    body = fake.bodies[n]
    assert body["prompt"] == chat_ids(tiny_dir, messages)
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"], body["top_k"], body["stop"]) == \
        ("tiny", 6, 0.0, 7, 20, ["\n\n"])
    assert body["stream"] and body["return_token_ids"]
    want = fake.tok.decode(fake.reply_ids[:6])
    assert want and REPLY.startswith(want)
    assert r.message.content == want and r.done_reason == "length"
    assert (r.prompt_eval_count, r.eval_count) == (len(body["prompt"]), 6)
    streamed = "".join(part.message.content for part in client.chat(model="tiny-llama", messages=messages, stream=True,
                                                                    options={"temperature": 0, "num_predict": 6}))
    assert streamed == want
    # the whole reply: vLLM's "stop" is Ollama's done_reason stop; raw prompts go as the tokenizer's ids
    r = client.generate(model="tiny-llama", prompt="Paris?", raw=True, options={"num_predict": 100})
    assert r.response == REPLY and r.done_reason == "stop"
    from transformers import AutoTokenizer

    assert fake.bodies[-1]["prompt"] == AutoTokenizer.from_pretrained(tiny_dir)("Paris?")["input_ids"]
    # the key vLLM was started with (VLLM_API_KEY: the front's --api-key) goes with every request
    assert fake.headers[-1]["authorization"] == "Bearer sk-front"


def test_v1_is_passed_through_and_metrics_and_ps_name_the_backend(attached):
    server, fake = attached
    client = openai_client(server)
    client.api_key = "sk-front"
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=3)
    assert r.choices[0].message.content == "from vLLM: hello"
    assert fake.chat_bodies[-1] == {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}],
                                    "max_tokens": 3}
    rows = httpx.get(server.base + "/api/ps", headers=key(), timeout=10).json()["models"]
    assert [row["backend"] for row in rows] == [{"engine": "vllm", "url": fake.url, "model": "tiny"}]
    assert 'vllm:num_requests_running{model_name="tiny"}' in httpx.get(server.base + "/metrics", headers=key(),
                                                                       timeout=10).text


def test_vllms_error_is_the_answer(attached):
    server, _ = attached
    r = httpx.post(server.base + "/api/generate", headers=key(), timeout=30,
                   json={"model": "tiny-llama", "prompt": "hi", "stream": False, "options": {"stop": ["FAIL"]}})
    assert r.status_code == 400 and r.json()["error"] == "stop strings may not say FAIL"


def test_a_client_leaving_mid_stream_ends_vllms_request(attached):
    server, fake = attached
    fake.delay = 0.2  # ~10 s for the whole reply: the client leaves long before
    try:
        finished = fake.finished
        with httpx.stream("POST", server.base + "/api/chat", headers=key(), timeout=30,
                          json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                                "options": {"num_predict": 50}}) as r:
            first = json.loads(next(r.iter_lines()))
            assert first["message"]["content"] and not first["done"]
        deadline = time.monotonic() + 10
        while fake.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.active == 0 and fake.finished == finished
    finally:
        fake.delay = 0.0
