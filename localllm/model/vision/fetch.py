"""http(s) image URLs -> the image's bytes, only where the user allowed it (`serve --allow-image-urls`,
`run --allow-image-urls`): bounded in size (streamed, reading stops past the limit), total time and
redirects. The bytes are checked as every image is (images.decode_image, with the prompt)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

from . import ImageInputError

SCHEMES = ("http", "https")


@dataclass
class ImageURLPolicy:
    """Whether and how image URLs are fetched (ServerConfig.image_urls; off by default: a server
    that fetches URLs its clients name can be pointed at any address it reaches)."""

    allow: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0  # the whole fetch: connect, redirects and body together
    max_redirects: int = 5


def is_http_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def _shown(url: str) -> str:
    return url if len(url) <= 120 else url[:100] + "..."


async def fetch_image(url: str, policy: ImageURLPolicy, what: str = "image_url") -> bytes:
    """The body of a GET of `url` (http or https, redirects followed up to policy.max_redirects).
    ImageInputError names each failure: not allowed, a bad URL, too large, timed out, an HTTP
    status other than 200, a connection error."""
    import httpx

    if not policy.allow:
        raise ImageInputError(f"{what}: fetching images from http(s) URLs is off; start the server with "
                              "--allow-image-urls to fetch them, or send the image inline as a data: URL "
                              "(data:image/png;base64,...)")
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES or not parts.hostname:
        raise ImageInputError(f"{what}: {_shown(url)!r} is not an http(s) URL with a host")
    shown = _shown(url)
    limit = policy.max_bytes

    async def get() -> list[bytes]:
        async with httpx.AsyncClient(follow_redirects=True, max_redirects=policy.max_redirects,
                                     timeout=policy.timeout_s, headers={"Accept": "image/*"}) as client, \
                client.stream("GET", url) as r:
            if r.status_code != 200:
                raise ImageInputError(f"{what}: fetching {shown} answered HTTP {r.status_code} {r.reason_phrase}")
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise ImageInputError(f"{what}: {shown} is too large ({int(declared)} bytes; at most {limit} "
                                      "are fetched)")
            body, size = [], 0
            async for chunk in r.aiter_bytes():  # decoded bytes: a gzip body is held to the limit unpacked
                size += len(chunk)
                if size > limit:
                    raise ImageInputError(f"{what}: {shown} is too large (more than {limit} bytes; at most "
                                          f"{limit} are fetched)")
                body.append(chunk)
            return body

    try:  # wait_for, not asyncio.timeout: Python 3.10 has no asyncio.timeout
        body = await asyncio.wait_for(get(), policy.timeout_s)
    except asyncio.TimeoutError:  # the one deadline over connect, redirects and body
        raise ImageInputError(f"{what}: fetching {shown} timed out (more than {policy.timeout_s:g} s)") from None
    except httpx.TooManyRedirects:
        raise ImageInputError(f"{what}: fetching {shown} took more than {policy.max_redirects} redirects") from None
    except httpx.UnsupportedProtocol:  # a redirect to another scheme
        raise ImageInputError(f"{what}: fetching {shown} was redirected to a URL that is not http(s)") from None
    except httpx.TimeoutException:
        raise ImageInputError(f"{what}: fetching {shown} timed out (more than {policy.timeout_s:g} s)") from None
    except httpx.HTTPError as e:
        raise ImageInputError(f"{what}: cannot fetch {shown} ({type(e).__name__}: {e})") from None
    return b"".join(body)


def fetch_image_sync(url: str, policy: ImageURLPolicy, what: str = "image") -> bytes:
    """fetch_image for the CLI (no event loop running there)."""
    return asyncio.run(fetch_image(url, policy, what))
