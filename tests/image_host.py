"""A loopback HTTP server in a thread that hosts images for the --allow-image-urls tests: a PNG, a
redirect to it, a redirect loop, a too-large body (declared, and streamed without a length), a
slow response and a trickling one, a 404, a body that is no image, a redirect to ftp://."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ImageHost:
    def __init__(self, png: bytes, big_bytes: int):
        self.png, self.big_bytes = png, big_bytes
        self.release = threading.Event()  # set at the end: a slow handler stops waiting
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def _handler(self):
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def send(self, code: int, body: bytes, ctype: str = "image/png", length: bool = True, **headers):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                host.requests.append(self.path)
                try:
                    self.route()
                except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as meant
                    pass

            def route(self):
                p = self.path
                if p == "/cat.png":
                    self.send(200, host.png)
                elif p == "/moved":
                    self.send(302, b"", "text/plain", Location="/cat.png")
                elif p.startswith("/loop"):
                    self.send(302, b"", "text/plain", Location=f"/loop{len(p)}")
                elif p == "/to-ftp":
                    self.send(302, b"", "text/plain", Location="ftp://127.0.0.1/cat.png")
                elif p == "/declared-big.png":  # says its size up front: refused before any body is read
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(host.big_bytes))
                    self.end_headers()
                    self.wfile.write(b"\0" * 65536)
                elif p == "/streamed-big.png":  # no length (HTTP/1.0: the body ends when the connection does)
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    for _ in range(host.big_bytes // 65536 + 1):
                        self.wfile.write(b"\0" * 65536)
                elif p == "/slow.png":  # no answer until the test ends
                    host.release.wait(30)
                    self.send(200, host.png)
                elif p == "/trickle.png":  # a byte at a time: every read is quick, the whole is not
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(host.png)))
                    self.end_headers()
                    for b in host.png:
                        if host.release.wait(0.1):
                            return
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                elif p == "/notes.txt":
                    self.send(200, b"just some text, no pixels here\n", "text/plain")
                else:
                    self.send(404, b"not found", "text/plain")

        return Handler


@contextmanager
def image_host(png: bytes, big_bytes: int) -> Iterator[ImageHost]:
    """An ImageHost serving for the length of the block (stopped, its threads released, after)."""
    host = ImageHost(png, big_bytes)
    thread = threading.Thread(target=host.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield host
    finally:
        host.release.set()
        host.server.shutdown()
        host.server.server_close()
        thread.join(10)
