"""http(s) image URLs (model/vision/fetch.py) against a loopback image host: the body of a 200 as
sent, redirects followed up to the limit, and every failure an ImageInputError naming it (off,
not http(s), too large declared or streamed, timed out waiting or trickling, an HTTP status, a
connection refused). The server's and the CLI's use of it: tests/test_vision_server.py."""

from __future__ import annotations

import asyncio
import socket

import pytest
from image_host import image_host
from vision_models import png_bytes, random_image

from localllm.model.vision import ImageInputError
from localllm.model.vision.fetch import ImageURLPolicy, fetch_image
from localllm.model.vision.images import decode_image

PNG = png_bytes(random_image(3, 40, 30))
LIMIT = 256 << 10


@pytest.fixture(scope="module")
def host():
    with image_host(PNG, big_bytes=4 * LIMIT) as h:
        yield h


def fetch(url: str, **policy) -> bytes:
    return asyncio.run(fetch_image(url, ImageURLPolicy(**{"allow": True, "max_bytes": LIMIT, "timeout_s": 2.0,
                                                           **policy}), "image_url"))


def test_fetches_the_image_and_follows_redirects(host):
    assert fetch(host.url("/cat.png")) == PNG
    assert fetch(host.url("/moved")) == PNG
    assert decode_image(fetch(host.url("/moved"))).size == (40, 30)


@pytest.mark.parametrize(("path", "policy", "problem"), [
    ("/declared-big.png", {}, f"is too large ({4 * LIMIT} bytes; at most {LIMIT} are fetched)"),
    ("/streamed-big.png", {}, f"is too large (more than {LIMIT} bytes; at most {LIMIT} are fetched)"),
    ("/missing.png", {}, "answered HTTP 404 Not Found"),
    ("/loop", {"max_redirects": 3}, "took more than 3 redirects"),
    ("/to-ftp", {}, "was redirected to a URL that is not http(s)"),
    ("/slow.png", {"timeout_s": 0.5}, "timed out (more than 0.5 s)"),
    ("/trickle.png", {"timeout_s": 0.5}, "timed out (more than 0.5 s)"),  # each read quick, the whole not
])
def test_failures_name_the_problem(host, path, policy, problem):
    with pytest.raises(ImageInputError) as e:
        fetch(host.url(path), **policy)
    assert str(e.value) == f"image_url: fetching {host.url(path)} {problem}" or \
        str(e.value) == f"image_url: {host.url(path)} {problem}", str(e.value)


def test_not_allowed_bad_urls_and_refused_connections():
    with pytest.raises(ImageInputError, match="is off; start the server with --allow-image-urls"):
        asyncio.run(fetch_image("http://127.0.0.1:9/cat.png", ImageURLPolicy()))
    for url in ("ftp://127.0.0.1/cat.png", "http:///cat.png", "file:///etc/passwd"):
        with pytest.raises(ImageInputError, match="is not an http\\(s\\) URL with a host"):
            fetch(url)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/cat.png"
    with pytest.raises(ImageInputError, match=f"cannot fetch {url} \\(ConnectError"):
        fetch(url)


def test_body_that_is_no_image_is_refused_by_the_decoder(host):
    data = fetch(host.url("/notes.txt"))  # fetched as is: the content is judged by Pillow, as for data: URLs
    with pytest.raises(ImageInputError, match="is not an image"):
        decode_image(data)
