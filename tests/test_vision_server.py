"""Images through a real `localllm serve` with the official clients: OpenAI image_url data URLs,
http(s) image URLs (the server runs with --allow-image-urls and short limits; a loopback image
host in a thread serves them), Ollama's base64 images on /api/chat and /api/generate,
/api/show's vision capability, bad images and failed fetches as 400s naming the problem. The server is pinned to a tiny random Gemma 3 vision
checkpoint (written by transformers): no registry model takes images at test sizes."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import httpx
import ollama
import openai
import pytest
import typer
from conftest import make_engine
from image_host import image_host
from server_proc import openai_client, running
from vision_models import gemma3, huge_png, png_bytes, random_image

from localllm.model.loader import load_model
from localllm.sampling import SamplingParams

IMAGE = random_image(0, 70, 50)
PNG = png_bytes(IMAGE)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, fp32_model):
    return gemma3(tmp_path_factory.mktemp("vision-server") / "tiny-gemma3", fp32_model.tokenizer)


URL_LIMIT_MB, URL_TIMEOUT_S = 1, 2  # the server's --image-url-max-mb and --image-url-timeout here


@pytest.fixture(scope="module")
def server(model_dir):
    with running("--ctx", "512", "--threads", "1", "--enforce-eager", "--allow-image-urls",
                 "--image-url-max-mb", str(URL_LIMIT_MB), "--image-url-timeout", str(URL_TIMEOUT_S),
                 model=str(model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def host():
    with image_host(PNG, big_bytes=2 * URL_LIMIT_MB << 20) as h:
        yield h


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(load_model(model_dir, "float32"))


@pytest.fixture(scope="module")
def expected(engine) -> str:
    """The in-process engine's greedy reply (tests/test_vision.py holds it to transformers')."""
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
    cases = [(data_url(PNG[: len(PNG) // 2]), "truncated or corrupt"),
             (data_url(b"not an image at all"), "is not an image"),
             (data_url(huge_png(20000, 20000)), "too large"),
             ("data:image/png;base64,@@@", "not valid base64")]
    for url, problem in cases:
        r = _post_chat(server, str(model_dir), url)
        assert r.status_code == 400 and problem in r.json()["error"]["message"], (problem, r.text)
    r = httpx.post(server.base + "/api/chat", timeout=60, json={
        "model": str(model_dir), "stream": False,
        "messages": [{"role": "user", "content": "Hi", "images": [base64.b64encode(PNG[:100]).decode()]}]})
    assert r.status_code == 400 and "truncated or corrupt" in r.json()["error"], r.text


def _ask(server, model_dir, url: str, max_tokens: int = 12):
    return openai_client(server).chat.completions.create(
        model=str(model_dir), temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": QUESTION}]}])


def test_openai_http_image_url(server, model_dir, expected, host):
    """--allow-image-urls: the image fetched from the host (directly, or through a redirect) gives
    the reply the same image gives inline."""
    assert _ask(server, model_dir, host.url("/cat.png")).choices[0].message.content == expected
    assert _ask(server, model_dir, host.url("/moved")).choices[0].message.content == expected
    assert host.requests[-3:] == ["/cat.png", "/moved", "/cat.png"]


def test_failed_image_fetches_are_400s_naming_the_problem(server, model_dir, host):
    limit = URL_LIMIT_MB << 20
    cases = [("/streamed-big.png", f"is too large (more than {limit} bytes; at most {limit} are fetched)"),
             ("/declared-big.png", f"is too large ({2 * limit} bytes; at most {limit} are fetched)"),
             ("/slow.png", f"timed out (more than {URL_TIMEOUT_S} s)"),
             ("/missing.png", "answered HTTP 404 Not Found"),
             ("/notes.txt", "is not an image"),
             ("/to-ftp", "was redirected to a URL that is not http(s)")]
    for path, problem in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _ask(server, model_dir, host.url(path), max_tokens=2)
        assert e.value.status_code == 400 and problem in e.value.message, (path, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:  # no other scheme, with or without the flag
        _ask(server, model_dir, "file:///etc/passwd", max_tokens=2)
    assert "must be a data: URL" in e.value.message


def test_image_urls_off_by_default_say_how_to_allow_them():
    """Without --allow-image-urls nothing is fetched: the 400 names the flag."""
    import asyncio

    from localllm.model.vision.fetch import ImageURLPolicy
    from localllm.server import openai_schema as oai

    msgs = [oai.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}},
                                                  {"type": "text", "text": "Hi"}])]
    assert asyncio.run(oai.fetch_image_urls(msgs, ImageURLPolicy())) == {}
    with pytest.raises(oai.APIError) as e:
        oai.message_dicts(msgs, {})
    assert e.value.status == 400 and e.value.message == (
        "messages[0].content[0].image_url: fetching images from http(s) URLs is off; start the server with "
        "--allow-image-urls to fetch them, or send the image inline as a data: URL (data:image/png;base64,...)")


def test_cli_image_url_needs_the_flag(engine, host, capsys):
    """`run --image URL`: fetched only with --allow-image-urls (the same fetch as the server's)."""
    from localllm.cli import _with_images

    url = host.url("/cat.png")
    with pytest.raises(typer.Exit) as e:
        _with_images(engine, QUESTION, [url], False)
    assert e.value.exit_code == 2 and capsys.readouterr().err == (
        f"Error: --image {url}: fetching images from http(s) URLs is off; pass --allow-image-urls to fetch it\n")
    assert _with_images(engine, QUESTION, [url], False, allow_urls=True) == [
        {"type": "image", "image": PNG}, {"type": "text", "text": QUESTION}]
    with pytest.raises(typer.Exit) as e:
        _with_images(engine, QUESTION, [host.url("/missing.png")], False, allow_urls=True)
    assert e.value.exit_code == 1 and capsys.readouterr().err == (
        f"Error: --image {host.url('/missing.png')}: fetching {host.url('/missing.png')} answered HTTP 404 Not Found\n")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # four CLI processes (~20 s); images_in_prompt and the REPL's /image run in the default suite
def test_cli_run_with_images(model_dir, expected, tmp_path):
    """`localllm run MODEL --image FILE PROMPT`, and an image path written in the prompt (Ollama's
    CLI convention): the server's reply. Bad input: one-line errors."""
    photo = tmp_path / "photo.png"
    photo.write_bytes(PNG)
    r = cli("run", str(model_dir), "--temperature", "0", "-n", "12", "--image", str(photo), QUESTION)
    assert r.returncode == 0 and r.stdout == expected + "\n", r.stderr
    r = cli("run", str(model_dir), "--temperature", "0", "-n", "12", f"{photo} {QUESTION}")
    assert r.returncode == 0 and r.stdout == expected + "\n", r.stderr
    (tmp_path / "bad.png").write_bytes(PNG[:100])
    r = cli("run", str(model_dir), "-n", "2", "--image", str(tmp_path / "bad.png"), QUESTION)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == \
        "Error: image 1 is truncated or corrupt (image file is truncated)"
    r = cli("run", "smollm2-135m", "-n", "2", "--image", str(photo), QUESTION)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        "Error: --image: model smollm2-135m takes no images (a text-only model); use a vision model such as gemma3")


def test_repl_image_command(model_dir, expected, tmp_path):
    from localllm.repl import ChatSession

    photo = tmp_path / "photo.png"
    photo.write_bytes(PNG)
    engine = make_engine(load_model(model_dir, "float32"))  # its own: the counts below start from 0
    out, notes = [], []
    s = ChatSession(engine, "tiny-gemma3", out=out.append, note=notes.append, temperature=0.0, max_tokens=12)
    s.handle(f"/image {tmp_path / 'missing.png'}")
    assert notes[-1].startswith("Error: cannot read image")
    s.handle(f"/image {photo}")
    assert out[-1] == f"attached {photo} to the next message (1 image(s))\n"
    s.handle(QUESTION)
    assert "".join(out).endswith(expected + "\n")
    assert engine.runner.vision_encodes == 1
    s.handle("And now?")  # the image stays in the history: not encoded again
    assert engine.runner.vision_encodes == 1 and s.last.cached_tokens > 16
