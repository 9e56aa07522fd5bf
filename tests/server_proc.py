"""Start a real `localllm serve` subprocess on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`localllm serve [MODEL] ARGS` on a free loopback port; records the /health codes seen while starting."""

    def __init__(self, *args: str, model: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None):
        """`model=None` (the default, as the README starts it): no MODEL argument, i.e. every local
        model on demand; a test that pins a model says why. `cwd`: where relative paths in `args`
        start (a README command run as printed, from the checkout)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="localllm-serve-", suffix=".log", delete=False)
        env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", *([model] if model else []), "--host", "127.0.0.1",
             "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.health_codes: list[int] = []

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> ServerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                code = httpx.get(self.base + "/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            self.health_codes.append(code)
            if code == 200:
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.output()}")

    def signal_and_wait(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> tuple[int, float]:
        """Send `sig`; return (exit code, seconds it took to exit). Kills it if it hangs."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9, time.monotonic() - t0
        return rc, time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal_and_wait(signal.SIGTERM, 15)
        self.log.close()
        os.unlink(self.log.name)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        from localllm.server.metrics import parse

        r = httpx.get(self.base + "/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        return parse(r.text)


@contextmanager
def running(*args: str, **kw) -> Iterator[ServerProc]:
    """A ready `ServerProc(*args, **kw)` for the length of the block (a module fixture's body)."""
    s = ServerProc(*args, **kw)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def openai_client(server: ServerProc, timeout: float = 120):
    """The official client on the server; max_retries=0: a 5xx or 429 must surface as is, not be retried."""
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=timeout)
