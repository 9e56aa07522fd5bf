"""Images through a real `localllm serve` with the official clients: OpenAI image_url data URLs,
Ollama's base64 images on /api/chat and /api/generate, /api/show's vision capability, bad
images as 400s naming the problem. The server is pinned to a tiny random Gemma 3 vision
checkpoint (written by transformers): no registry model takes images at test sizes."""

from __future__ import annotations

import base64
import io

import httpx
import ollama
import pytest
from conftest import make_engine
from server_proc import openai_client, running
from vision_models import gemma3, png_bytes, random_image

from localllm.model.loader import load_model
from localllm.sampling import SamplingParams

IMAGE = random_image(0, 70, 50)
PNG = png_bytes(IMAGE)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, fp32_model):
    return gemma3(tmp_path_factory.mktemp("vision-server") / "tiny-gemma3", fp32_model.tokenizer)


@pytest.fixture(scope="module")
def server(model_dir):
    with running("--ctx", "512", "--threads", "1", "--enforce-eager", model=str(model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def expected(model_dir) -> str:
    """The in-process engine's greedy reply (tests/test_vision.py holds it to transformers')."""
    engine = make_engine(load_model(model_dir, "float32"))
    msgs = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": QUESTION}]}]
    return [o for o in engine.generate(msgs, SamplingParams(temperature=0, max_tokens=12))][-1].text


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_openai_image_url(server, model_dir, expected):
    r = openai_client(server).chat.completions.create(
        model=str(model_dir), temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                               {"type": "text", "text": QUESTION}]}])
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens > 16  # the image's 16 tokens and the text


def test_ollama_chat_and_generate_images(server, model_dir, expected):
    client = ollama.Client(host=server.base, timeout=120)
    name = str(model_dir)
    r = client.chat(model=name, messages=[{"role": "user", "content": QUESTION, "images": [PNG]}],
                    options={"temperature": 0, "num_predict": 12})
    assert r.message.content == expected
    g = client.generate(model=name, prompt=QUESTION, images=[PNG], options={"temperature": 0, "num_predict": 12})
    assert g.response == expected
    assert "vision" in client.show(name).capabilities


def _post_chat(server, model: str, url: str) -> httpx.Response:
    return httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "Hi"}]}]})


def test_bad_images_are_400s_naming_the_problem(server, model_dir):
    from PIL import Image

    huge = io.BytesIO()
    Image.new("1", (20000, 20000)).save(huge, format="PNG")
    cases = [(data_url(PNG[: len(PNG) // 2]), "truncated or corrupt"),
             (data_url(b"not an image at all"), "is not an image"),
             (data_url(huge.getvalue()), "too large"),
             ("data:image/png;base64,@@@", "not valid base64"),
             ("https://example.com/cat.png", "http(s) URLs is not supported")]
    for url, problem in cases:
        r = _post_chat(server, str(model_dir), url)
        assert r.status_code == 400 and problem in r.json()["error"]["message"], (problem, r.text)
    r = httpx.post(server.base + "/api/chat", timeout=60, json={
        "model": str(model_dir), "stream": False,
        "messages": [{"role": "user", "content": "Hi", "images": [base64.b64encode(PNG[:100]).decode()]}]})
    assert r.status_code == 400 and "truncated or corrupt" in r.json()["error"], r.text
