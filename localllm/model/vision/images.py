"""Image bytes -> a checked RGB Pillow image: what every front end calls before a prompt holds it."""

from __future__ import annotations

import base64
import binascii
import io
import warnings

from . import ImageInputError

# larger images are refused before their pixels are decoded (a 20000x20000 PNG of a few KB would
# take 1.2 GB as RGB); every family resizes far below this anyway
MAX_PIXELS = 64_000_000
MAX_BYTES = 64 << 20


def decode_image(data: bytes, what: str = "image") -> object:
    """-> a PIL.Image.Image in RGB, fully decoded. ImageInputError names the problem: not an
    image, too many pixels, truncated or corrupt data."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageInputError(f"{what} is empty")
    if len(data) > MAX_BYTES:
        raise ImageInputError(f"{what} is {len(data)} bytes; at most {MAX_BYTES} are accepted")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise ImageInputError(f"{what} is too large: {w}x{h} pixels, at most {MAX_PIXELS} are accepted")
            img.load()
    except ImageInputError:
        raise
    except UnidentifiedImageError:
        raise ImageInputError(f"{what} is not an image (PNG, JPEG, WebP, GIF, BMP... expected)") from None
    except Image.DecompressionBombError as e:  # Pillow's own guard, at open (its message has the size)
        raise ImageInputError(f"{what} is too large: {e}; at most {MAX_PIXELS} pixels are accepted") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageInputError(f"{what} is truncated or corrupt ({e})") from None
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def decode_base64(text: str, what: str = "image") -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{what} is not valid base64") from None


def decode_data_url(url: str, what: str = "image_url") -> bytes:
    """A data: URL's bytes (base64 only). http(s) URLs are refused here: they are fetched (fetch.py)
    only where the server allows it, before this is called."""
    if url[:8].lower().startswith(("http://", "https://")):
        raise ImageInputError(f"{what}: fetching images from http(s) URLs is off; start the server with "
                              "--allow-image-urls to fetch them, or send the image inline as a data: URL "
                              "(data:image/png;base64,...)")
    if not url.startswith("data:"):
        raise ImageInputError(f"{what} must be a data: URL (data:image/png;base64,...), got {url[:32]!r}")
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageInputError(f"{what}: a data: URL must be base64-encoded (data:image/png;base64,...)")
    return decode_base64(body, what)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


def read_image_file(path: str) -> bytes:
    """An image file's bytes (checked when the prompt is encoded); ImageInputError if unreadable."""
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        return p.read_bytes()
    except OSError as e:
        raise ImageInputError(f"cannot read image {path}: {e.strerror or e}") from None


def images_in_prompt(text: str) -> tuple[str, list[str]]:
    """Ollama's CLI convention: words of the prompt that are paths of existing image files are
    taken out of it and attached as images. -> (the prompt without them, their paths)."""
    import os
    import shlex

    try:
        words = shlex.split(text, posix=True)
    except ValueError:  # an unbalanced quote: plain words
        words = text.split()
    words = [w.rstrip("?!,;:)") for w in words]  # "what is in ./cat.png?"
    paths = list(dict.fromkeys(w for w in words if w.lower().endswith(IMAGE_SUFFIXES)
                               and os.path.isfile(os.path.expanduser(w))))
    for p in paths:
        text = text.replace(f"'{p}'", "").replace(f'"{p}"', "").replace(p, "")
    return " ".join(text.split()) if paths else text, paths
