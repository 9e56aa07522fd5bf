"""`localllm serve MODEL --engine vllm`: vLLM's OpenAI server as the engine, our front in front.

- VLLMChild: vLLM's server as our child process (its own process group, ended with us: on our
  shutdown the group gets SIGTERM then SIGKILL, and the kernel sends SIGTERM to it if we die
  without a word, PR_SET_PDEATHSIG); its output goes to a log file under LOCALLLM_HOME, and its
  failure is reported in one line (the log's last error and where the log is).
- VLLMBackend: the server we talk to (our child, or one at --engine-url): its URL, key and names;
  `start` waits until it is healthy and returns the ProxyEngine, `serve` makes the ServedModel.
- ProxyEngine + ProxyLoop: what the routes read of a served model (generation.ServedModel), so the
  Ollama routes (ollama.py) run unchanged on vLLM: prompts are rendered and tokenized here with the
  model's own template (as for our engine), the token ids go to vLLM's /v1/completions, and its
  stream comes back as RequestOutputs. The loop is one thread with its own asyncio loop and httpx
  client, as EngineLoop is the one thread that steps our engine; aborting a request closes its
  upstream stream, which vLLM takes as a cancel.
- router: /v1/* (and /tokenize, /detokenize) passed through to vLLM as they are, streams included;
  a client that goes away closes the upstream request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from .generation import ServedModel, ShutdownError, max_token_bytes
from .openai_schema import APIError

if TYPE_CHECKING:
    from ..sampling import SamplingParams
    from ..structured import Constraint
    from ..tokenizer import LLMTokenizer
    from .generation import _Pending
    from .state import ServerState

# request headers not to forward: the connection's own, and what httpx sets itself
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-authorization", "proxy-connection", "authorization", "x-api-key", "accept-encoding"}
_HOP_OUT = {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding", "date", "server"}


class BackendError(RuntimeError):
    """vLLM could not be started or reached; the message is the one line the user sees."""


# ---- the child process --------------------------------------------------------------------------
def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when we die, even by SIGKILL (Linux; elsewhere a no-op,
    and our shutdown still ends its group). Resolved before the fork: nothing is loaded after it."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # we died between the fork and the prctl
            os._exit(1)
    return preexec


class VLLMChild:
    """vLLM's server run by us: `argv` with `env` added, its output in `log_path`."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                # its own session: a Ctrl-C in our terminal reaches us, and we end its whole group
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env}, start_new_session=True,
                                             preexec_fn=_die_with_parent())
            except OSError as e:
                raise BackendError(f"cannot run vLLM ({self.argv[0]}): {e.strerror or e}") from None

    def exit_message(self) -> str | None:
        """One line once the process has exited (None while it runs)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"vLLM {how}: {last_error(self.log_path)} (its log: {self.log_path})"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to its process group (vLLM's engine processes too), SIGKILL after `timeout`."""
        with self._lock:
            proc = self.proc
            if proc is None or proc.returncode is not None and not _group_alive(proc.pid):
                return
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
                    time.sleep(0.1)
                if proc.poll() is not None and not _group_alive(proc.pid):
                    break
            proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_error(log_path: Path, tail: int = 64 << 10) -> str:
    """The line of vLLM's log that says what went wrong: the last exception or ERROR line, else the
    last line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - tail))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    for ln in reversed(lines):
        if ("Error" in ln or "error" in ln.split(" ", 1)[0]) and not ln.startswith("File "):
            return ln[:400]
    return lines[-1][:400] if lines else "(nothing logged)"


# ---- the backend --------------------------------------------------------------------------------
@dataclass
class BackendInfo:
    """What /api/ps and the logs say about the server behind us."""

    url: str
    model: str  # the name vLLM serves it under
    max_model_len: int
    log: str | None  # our child's log file (None: attached with --engine-url)


class VLLMBackend:
    """The vLLM server a pinned model runs on: our child (`child`) or one at `url` already."""

    def __init__(self, url: str, served_name: str, api_key: str | None = None, child: VLLMChild | None = None,
                 log: Callable[[str], None] = print):
        self.url, self.served_name, self.api_key, self.child, self.log = url.rstrip("/"), served_name, api_key, \
            child, log
        self.info: BackendInfo | None = None
        self._client: httpx.AsyncClient | None = None  # the front's, on the server's event loop

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # -- starting (in the pool's loader thread) --
    def start(self, model_dir: Path, ready_timeout: float = 1800.0) -> ProxyEngine:
        """Start the child (if ours), wait until /health answers 200, read the context it serves and
        load the tokenizer: the ProxyEngine the routes run on. BackendError in one line otherwise."""
        from ..tokenizer import LLMTokenizer

        if self.child is not None:
            self.child.start()
            self.log(f"vLLM starting (pid {self.child.proc.pid}, log {self.child.log_path})")
        t0 = time.monotonic()
        with httpx.Client(base_url=self.url, headers=self.headers(), timeout=5.0) as client:
            while True:
                gone = self.child.exit_message() if self.child is not None else None
                if gone:
                    raise BackendError(gone)
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError as e:
                    if self.child is None and time.monotonic() - t0 > 30:  # attached: it should be up
                        raise BackendError(f"vLLM at {self.url} does not answer: {e}") from None
                if time.monotonic() - t0 > ready_timeout:
                    self.stop()
                    raise BackendError(f"vLLM at {self.url} was not ready after {ready_timeout:.0f} s")
                time.sleep(0.5)
            r = client.get("/v1/models")
            if r.status_code != 200:
                raise BackendError(f"vLLM at {self.url}: /v1/models answered {r.status_code}: {r.text[:200]}")
            cards = r.json().get("data") or []
        card = next((c for c in cards if c.get("id") == self.served_name), cards[0] if cards else None)
        if card is None:
            raise BackendError(f"vLLM at {self.url} serves no model")
        self.served_name = card["id"]
        max_len = int(card.get("max_model_len") or 0)
        tokenizer = LLMTokenizer.from_dir(model_dir)
        config = model_dir / "config.json"
        vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        vocab = int(vocab or tokenizer.vocab_size)
        self.info = BackendInfo(self.url, self.served_name, max_len,
                                str(self.child.log_path) if self.child is not None else None)
        return ProxyEngine(tokenizer, max_len, vocab)

    def serve(self, name: str, engine: ProxyEngine, log: Callable[[str], None]) -> ServedModel:
        """The ServedModel the pool keeps for the pinned model (pool.Pinned.backend)."""
        return ServedModel(name, engine, ProxyLoop(self, log), max_token_bytes(engine.tokenizer), backend=self)

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def describe(self) -> dict:
        out = {"engine": "vllm", "url": self.url, "model": self.served_name}
        if self.child is not None and self.child.proc is not None:
            out.update(pid=self.child.proc.pid, log=str(self.child.log_path))
        return out

    # -- the front's requests (on the server's event loop) --
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def metrics(self) -> str:
        """vLLM's own Prometheus text (its names start with vllm:, so they sit next to ours)."""
        try:
            r = await self.client().get("/metrics", headers=self.headers(), timeout=5.0)
        except httpx.HTTPError as e:
            return f"# vLLM's /metrics did not answer: {type(e).__name__}\n"
        return r.text if r.status_code == 200 else f"# vLLM's /metrics answered {r.status_code}\n"


# ---- what the routes run on ---------------------------------------------------------------------
class _VLLMGrammars:
    """Constraints compile in vLLM (its llguidance backend): nothing to prepare here."""

    def prepare(self, constraint: Constraint) -> None:
        return None


class ProxyEngine:
    """The engine as the routes read it (generation.Generation, ollama.py), for a model vLLM runs."""

    def __init__(self, tokenizer: LLMTokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.grammars = _VLLMGrammars()

    def encode_prompt(self, prompt: str | list[int] | list[dict], **template_kwargs) -> list[int]:
        from ..chat import encode_prompt

        return encode_prompt(self.tokenizer, self.vocab_size, prompt, **template_kwargs)

    def cache_stats(self) -> dict:
        return {}


def structured_outputs(c: Constraint) -> dict:
    """Our Constraint -> vLLM's structured_outputs field."""
    if c.kind == "json":
        return {"json_object": True}
    if c.kind == "json_schema":
        return {"json": json.loads(c.spec) if isinstance(c.spec, str) else c.spec}
    if c.kind == "choice":
        return {"choice": list(c.spec)}
    return {c.kind: c.spec}  # regex, grammar (Lark: what vLLM's guidance backend reads)


def completion_body(model: str, prompt: list[int], p: SamplingParams) -> dict:
    """One engine request as vLLM's /v1/completions body (token ids in, a stream with token ids out)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty, "seed": p.seed,
        "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
        "min_tokens": p.min_tokens, "skip_special_tokens": True}
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.constraint is not None:
        body["structured_outputs"] = structured_outputs(p.constraint)
    return body


def upstream_error(status: int, text: str) -> APIError:
    """vLLM's error answer as ours (its message as it is: it names the field)."""
    try:
        err = json.loads(text).get("error", {})
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = text.strip()[:500]
    message = message or f"vLLM answered {status}"
    if status >= 500:
        return APIError(502, f"vLLM failed: {message}", "upstream_error", code="engine_failed")
    return APIError(status, message, param=err.get("param") if isinstance(err, dict) else None)


class ProxyLoop:
    """EngineLoop's interface (submit, abort, close, run, stats, pending) over vLLM's HTTP API: one
    thread runs an asyncio loop with one httpx client; each engine request is a task streaming
    /v1/completions; abort cancels the task (closing the stream: vLLM aborts the request)."""

    def __init__(self, backend: VLLMBackend, log: Callable[[str], None] = print):
        self.backend, self.log = backend, log
        self.stats: dict = {}
        self.pending = 0
        self._aloop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None

    def submit(self, p: _Pending) -> None:
        if self._closed:
            p.done(ShutdownError("the server is shutting down"))
            return
        self.pending += 1
        self._aloop.call_soon_threadsafe(self._start, p)

    def abort(self, request_id: str) -> None:
        try:
            self._aloop.call_soon_threadsafe(self._cancel, request_id)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (live requests get a ShutdownError) and, unless `timeout` is 0 (the
        signal handler's quick pass), the vLLM child."""
        self._closed = True
        try:
            self._aloop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:
            pass
        t = self._thread
        if timeout and t is not None and t.is_alive() and threading.current_thread() is not t:
            t.join(timeout)
        if timeout:
            self.backend.stop()

    def run(self) -> str | None:
        """The loop, in the calling thread, until close() (None) or vLLM's death (its one line)."""
        self._thread = threading.current_thread()
        asyncio.set_event_loop(self._aloop)
        try:
            return self._aloop.run_until_complete(self._main())
        finally:
            self._aloop.close()

    async def _main(self) -> str | None:
        self._client = httpx.AsyncClient(base_url=self.backend.url, headers=self.backend.headers(),
                                         timeout=httpx.Timeout(None, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        failure = None
        try:
            while not self._stop.is_set():
                child = self.backend.child
                failure = child.exit_message() if child is not None else None
                if failure:
                    self.log(f"Error: {failure}")
                    break
                try:
                    await asyncio.wait_for(self._stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._closed = True
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self._client.aclose()
        return failure

    def _start(self, p: _Pending) -> None:
        if self._closed:
            self.pending -= 1
            p.done(ShutdownError("the server is shutting down"))
            return
        self._tasks[p.request_id] = self._aloop.create_task(self._request(p))

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _request(self, p: _Pending) -> None:
        from ..engine.engine import RequestOutput

        admitted = False
        text, ids, n_prompt, cached, reason = "", [], len(p.prompt), 0, None

        def admit(err: BaseException | None) -> None:
            nonlocal admitted
            if not admitted:
                admitted = True
                self.pending -= 1
                p.done(err)

        def out(delta: str, new: list[int], finished: bool) -> RequestOutput:
            return RequestOutput(p.request_id, delta, text, new, list(ids), finished, reason if finished else None,
                                 n_prompt, cached, prompt_token_ids=p.prompt)
        try:
            body = completion_body(self.backend.served_name, p.prompt, p.params)
            async with self._client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    admit(upstream_error(r.status_code, (await r.aread()).decode("utf-8", "replace")))
                    return
                admit(None)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        e = chunk["error"]
                        p.sink(upstream_error(int(e.get("code") or 500) if isinstance(e, dict) else 500, data))
                        return
                    usage = chunk.get("usage") or {}
                    if usage:
                        n_prompt = usage.get("prompt_tokens", n_prompt)
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for choice in chunk.get("choices") or []:
                        new = list(choice.get("token_ids") or [])
                        ids.extend(new)
                        delta = choice.get("text") or ""
                        text += delta
                        reason = choice.get("finish_reason") or reason
                        if delta or new:
                            p.sink(out(delta, new, False))
                # the end: after the usage chunk, so that the last output has the counts
                p.sink(out("", [], True) if reason else upstream_error(502, "vLLM ended the stream unfinished"))
        except asyncio.CancelledError:  # aborted (client gone) or shutting down
            if not admitted:
                admit(ShutdownError("the server is shutting down"))
            elif self._closed:
                p.sink(ShutdownError("the server is shutting down"))
            raise
        except (httpx.HTTPError, ValueError) as e:
            err = APIError(502, f"vLLM did not answer: {type(e).__name__}: {e}", "upstream_error",
                           code="engine_unreachable")
            if admitted:
                p.sink(err)
            else:
                admit(err)
        finally:
            self._tasks.pop(p.request_id, None)


# ---- /v1 passed through -------------------------------------------------------------------------
def router(state: ServerState) -> APIRouter:
    """vLLM's OpenAI routes, passed through: what vLLM answers is the answer (its /v1/models lists
    the model under our names: --served-model-name)."""
    api = APIRouter()
    backend: VLLMBackend = state.pool.pinned.backend

    async def forward(request: Request, path: str):
        state.require_ready()
        state.metrics.http_requests += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update(backend.headers())
        body = await request.body()
        client = backend.client()
        upstream = client.build_request(request.method, path, params=request.query_params, content=body,
                                        headers=headers)
        try:
            r = await _until_disconnect(request, client.send(upstream, stream=True))
        except httpx.HTTPError as e:
            raise APIError(502, f"vLLM did not answer: {type(e).__name__}: {e}", "upstream_error",
                           code="engine_unreachable") from None
        if r is None:  # the client left before vLLM answered
            return Response(status_code=499)
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_OUT}
        kind = r.headers.get("content-type", "")
        if "text/event-stream" in kind or "ndjson" in kind:
            async def relay():
                try:
                    async for piece in r.aiter_raw():
                        yield piece
                finally:  # the client went away (or the stream ended): vLLM stops generating
                    await r.aclose()
            return StreamingResponse(relay(), status_code=r.status_code, headers=out_headers,
                                     background=BackgroundTask(r.aclose))
        content = await _until_disconnect(request, r.aread())
        await r.aclose()
        if content is None:
            return Response(status_code=499)
        if r.status_code >= 400:
            state.metrics.errors[r.status_code] += 1
        return Response(content, status_code=r.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    @api.api_route("/v1/{path:path}", methods=methods)
    async def v1(path: str, request: Request):
        return await forward(request, "/v1/" + path)

    for route in ("/tokenize", "/detokenize"):
        async def plain(request: Request, _route: str = route):
            return await forward(request, _route)
        api.add_api_route(route, plain, methods=["POST"])
    return api


async def _until_disconnect(request: Request, work):
    """`work`'s result, or None once the client disconnects first (then `work` is cancelled, which
    closes the upstream request)."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, httpx.HTTPError):
        return None
    if isinstance(result, httpx.Response):
        await result.aclose()
    return None
