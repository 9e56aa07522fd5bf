"""Ollama's API on `localllm serve`, with the official `ollama` client against real server processes:
one serving every local model on demand (the embedded SmolLM2-135M and a 2-layer model pulled from a
loopback hub mirror, under a --max-memory that holds one of them at a time), one pinned to a model
with an API key."""

from __future__ import annotations

import os

import httpx
import ollama
import openai
import pytest
from hub_mirror import HubMirror, make_repo, tiny_checkpoint
from server_proc import running

SMOL, TINY = "smollm2-135m", "test-org/tiny"
CTX, KV = 512, "20MiB"
KEY = "sk-ollama-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def need(facts, quant: str) -> int:
    from localllm.planner import device_facts, plan

    p = plan(facts, device_facts("cpu"), quant, CTX, None, 20 << 20)
    assert p.fits, p.reason
    return p.needed_bytes


@pytest.fixture(scope="module")
def mirror():
    with HubMirror({TINY: make_repo(tiny_checkpoint())}) as m:
        yield m


@pytest.fixture(scope="module")
def server(mirror, tmp_path_factory):
    from localllm.planner import facts_for, facts_for_path

    # room for SmolLM2 and the tiny model in its smallest form (auto: 16-bit weights and tables on
    # CPU, now below bfloat16's fp32 tables), less 1 MiB: never both at once
    tiny = facts_for_path(tiny_checkpoint())
    smallest = min(need(tiny, q) for q in ("auto", "float32", "bfloat16", "int8", "int4"))
    budget = need(facts_for(SMOL), "auto") + smallest - (1 << 20)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path_factory.mktemp("hf")), HF_ENDPOINT=mirror.url, HF_HUB_DISABLE_TELEMETRY="1")
    with running("--ctx", str(CTX), "--kv-memory", KV, "--threads", "1", "--enforce-eager",
                 "--max-memory", f"{budget // 1024}KiB", model=None, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base, timeout=120)


def greedy(n: int, **kw) -> dict:
    return {"temperature": 0, "num_predict": n, **kw}


def ps(server) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(server.base + "/api/ps", timeout=10).json()["models"]}


# ---- probing: version, tags, show ----------------------------------------------------------------
def test_version_tags_show(server, client):
    assert httpx.get(server.base + "/api/version").json()["version"]
    names = [m.model for m in client.list().models]
    assert SMOL in names and TINY not in names  # not pulled yet
    info = client.show("smollm2:135m")
    # SmolLM2's template takes no tools: it calls them in the generic JSON format (generic_tools)
    assert info.capabilities == ["completion", "tools"] and info.modelinfo["localllm.tool_calling"] == "generic"
    assert info.modelinfo["llama.context_length"] == 8192 and info.details.family == "llama"
    assert "<|im_start|>" in info.template
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404 and "no-such-model" in e.value.error


# ---- chat / generate -------------------------------------------------------------------------
def test_chat_stream_equals_nonstream_and_openai_route(server, client):
    whole = client.chat(model=SMOL, messages=QUESTION, options=greedy(24), stream=False)
    parts = list(client.chat(model=SMOL, messages=QUESTION, options=greedy(24), stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content and whole.message.content
    last = parts[-1]
    assert last.done and not any(p.done for p in parts[:-1])
    assert (last.eval_count, last.prompt_eval_count, last.done_reason) == (
        whole.eval_count, whole.prompt_eval_count, whole.done_reason)
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0
    assert all(isinstance(x, int) and x >= 0 for x in (whole.total_duration, whole.eval_duration,
                                                          whole.prompt_eval_duration, whole.load_duration))
    assert whole.total_duration >= whole.eval_duration
    oai = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    ref = oai.chat.completions.create(model=SMOL, messages=QUESTION, temperature=0, max_tokens=24)
    assert ref.choices[0].message.content == whole.message.content
    assert ref.usage.completion_tokens == whole.eval_count and ref.usage.prompt_tokens == whole.prompt_eval_count


def test_generate_stream_equals_nonstream(client):
    for kw in ({"prompt": "Why is the sky blue?", "system": "Answer in one sentence."},
               {"prompt": "1, 2, 3,", "raw": True}):
        whole = client.generate(model=SMOL, options=greedy(12), stream=False, **kw)
        parts = list(client.generate(model=SMOL, options=greedy(12), stream=True, **kw))
        assert "".join(p.response for p in parts) == whole.response and whole.response
        assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    assert client.generate(model=SMOL, prompt="1, 2, 3,", raw=True, options=greedy(4)).response.startswith(" 4")


def test_options_num_predict_stop_seed(client):
    r = client.generate(model=SMOL, prompt="Count from one to twenty.", options=greedy(3))
    assert (r.eval_count, r.done_reason) == (3, "length")
    full = client.generate(model=SMOL, prompt="Count from one to twenty.", options=greedy(40)).response
    stop = full.split()[2]
    cut = client.generate(model=SMOL, prompt="Count from one to twenty.", options=greedy(40, stop=[stop]))
    assert cut.response == full[:full.index(stop)] and cut.done_reason == "stop"
    sampled = [client.generate(model=SMOL, prompt="Tell me a story.",
                               options={"temperature": 1.0, "seed": seed, "num_predict": 24}).response
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_unsupported_fields_and_routes(server, client):
    # (format: tests/test_server_structured.py; think on a reasoning model: tests/test_server_reasoning.py)
    # (tools on SmolLM2, whose template takes none, are called the generic way: tests/test_agent_apis.py)
    for kw, field in (({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]},
                       "tools"),
                      ({"think": True}, "think")):  # SmolLM2's template has no <think>
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=SMOL, messages=QUESTION, stream=False, **kw)
        assert e.value.status_code == 400 and field in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2:7b", messages=QUESTION)
    assert e.value.status_code == 404
    for path in ("/api/create", "/api/push", "/api/copy"):  # the embedding routes: test_server_embeddings.py
        r = httpx.post(server.base + path, json={"model": SMOL}, timeout=10)
        assert r.status_code == 501 and set(r.json()) == {"error"}, (path, r.text)
    r = httpx.post(server.base + "/api/chat", content=b"{not json", timeout=10)
    assert r.status_code == 400 and set(r.json()) == {"error"}


# ---- pull, two models on demand, keep_alive, delete ----------------------------------------------
def test_pull_streams_progress(client):
    events = list(client.pull(TINY, stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    sized = [e for e in events if e.total]
    assert sized and all(0 <= e.completed <= e.total for e in sized)
    assert any(e.completed == e.total > 1 << 20 for e in sized)  # the weights, to the last byte
    assert TINY in [m.model for m in client.list().models]


def test_two_models_alternate_lru_unloaded_no_leak(server, client):
    first: dict[str, str] = {}
    for model in (TINY, SMOL, TINY, SMOL):
        r = client.chat(model=model, messages=QUESTION, options=greedy(8))
        assert first.setdefault(model, r.message.content) == r.message.content  # the same engine answer
        loaded = ps(server)
        assert list(loaded) == [model], loaded  # the other one was unloaded to fit --max-memory
        assert loaded[model]["kv_blocks_used"] == 0 and loaded[model]["kv_blocks_total"] > 0
    assert first[TINY] != first[SMOL]
    oai = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert {m.id for m in oai.models.list().data} >= {SMOL, TINY}
    ref = oai.chat.completions.create(model=TINY, messages=QUESTION, temperature=0, max_tokens=8)
    assert ref.choices[0].message.content == first[TINY] and list(ps(server)) == [TINY]


def test_keep_alive_load_and_unload(server, client):
    r = client.generate(model=SMOL, prompt="", keep_alive=-1)
    assert r.done and r.done_reason == "load"
    assert ps(server)[SMOL]["expires_at"].startswith("2318")
    r = client.generate(model=SMOL, prompt="", keep_alive=0)
    assert r.done_reason == "unload" and SMOL not in ps(server)
    client.chat(model=SMOL, messages=QUESTION, options=greedy(2), keep_alive="10m")
    assert SMOL in ps(server)


def test_num_ctx_loads_the_model_with_that_context(server, client):
    """As Ollama: options.num_ctx is the context the model runs with; an idle model loaded with
    another one is reloaded."""
    client.generate(model=SMOL, prompt="hi", options=greedy(2, num_ctx=256))
    assert ps(server)[SMOL]["context_length"] == 256
    r = client.generate(model=SMOL, prompt="hi", options=greedy(2, num_ctx=384))
    assert r.done and ps(server)[SMOL]["context_length"] == 384
    bad = httpx.post(server.base + "/api/generate", timeout=30,
                     json={"model": SMOL, "prompt": "hi", "stream": False, "options": {"num_ctx": 0}})
    assert bad.status_code == 400 and "num_ctx" in bad.json()["error"]


def test_delete(server, client):
    client.delete(TINY)
    assert TINY not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=TINY, messages=QUESTION)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(TINY)
    assert e.value.status_code == 404


# ---- a pinned model with an API key -------------------------------------------------------------
@pytest.fixture(scope="module")
def pinned():
    # pinned (the other fixture serves on demand): the Ollama routes in both modes
    with running("--ctx", str(CTX), "--kv-memory", KV, "--threads", "1", "--enforce-eager", "--api-key", KEY,
                 model=SMOL) as s:
        yield s


def test_pinned_model_with_api_key(pinned):
    for path in ("/api/tags", "/api/ps"):
        r = httpx.get(pinned.base + path, timeout=10)
        assert r.status_code == 401 and set(r.json()) == {"error"}
    r = httpx.post(pinned.base + "/api/chat", json={"model": SMOL, "messages": QUESTION}, timeout=10)
    assert r.status_code == 401
    client = ollama.Client(host=pinned.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert [m.model for m in client.list().models] == [SMOL]
    assert [m.model for m in client.ps().models] == [SMOL]
    whole = client.chat(model="smollm2", messages=QUESTION, options=greedy(16), stream=False)
    streamed = "".join(p.message.content for p in client.chat(model="smollm2", messages=QUESTION,
                                                               options=greedy(16), stream=True))
    oai = openai.OpenAI(base_url=pinned.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ref = oai.chat.completions.create(model=SMOL, messages=QUESTION, temperature=0, max_tokens=16)
    assert whole.message.content == streamed == ref.choices[0].message.content
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="qwen3", messages=QUESTION)
    assert e.value.status_code == 404


def test_images_to_a_text_only_model_are_a_400(server, client):
    """A text-only model given an image, on either API: a 400 saying so (never the image dropped)."""
    from vision_models import png_bytes, random_image

    png = png_bytes(random_image(0, 8, 8))
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=SMOL, messages=[{"role": "user", "content": "What is this?", "images": [png]}])
    assert e.value.status_code == 400
    assert e.value.error == f"messages: model {SMOL} takes no images (a text-only model); send text only, or use a vision model"
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                               {"type": "image_url", "image_url": {"url": url}}]}])
