"""`localllm serve`: an OpenAI-, Anthropic- and Ollama-compatible HTTP server (FastAPI + uvicorn) over the model
pool (pool.py): every local model on demand, or a pool of one pinned model; both run this code.

One thread owns each engine (generation.EngineLoop): between steps it admits the requests HTTP handlers
queued, applies their aborts, then runs engine.step() while there is work and sleeps on a
condition when idle. Each output goes to the asyncio queue of the HTTP request that asked for
it (loop.call_soon_threadsafe). Handlers never call the engine themselves: engine.step() holds
the engine lock for a whole forward pass, which would stall the event loop. Concurrent HTTP
requests meet in the engine and are batched together (continuous batching).

A pinned model loads in a background thread after the server starts listening: /health answers
503 until it is ready, then 200 (on demand: 200 at once, models load when a request names one).

Nothing slow runs on the event loop: request bodies are capped (413 beyond --max-body-mb, read
in chunks), prompts are rendered and tokenized in a worker thread (the tokenizer releases the
GIL) and reach the engine thread as token ids, and a prompt whose byte count alone proves that
it cannot fit the context is refused before it is tokenized at all.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import anthropic, embeddings, infill, ollama, openai_routes, responses
from . import openai_schema as oai
from .metrics import combined_stats
from .openai_schema import APIError
from .pool import ModelPool
from .state import ServerConfig, ServerState


# ---- the app ------------------------------------------------------------------------------------
def _error_body(scope, err: APIError) -> dict:
    """An error as the route's API shapes it: Ollama's {"error": "..."} on /api/, Anthropic's on
    /v1/messages, else OpenAI's."""
    if anthropic.is_anthropic_path(scope["path"]):
        return anthropic.error_body(err)
    return {"error": err.message} if ollama.is_ollama_path(scope["path"]) else err.body()


class _BodyLimitMiddleware:
    """Request bodies larger than `max_bytes` get a 413 in OpenAI's error shape. The body is read
    in chunks (as uvicorn hands them over) and never held beyond the cap; what is over is read and
    dropped (up to _DRAIN bytes) so that the client sees the 413 rather than a reset connection."""

    _DRAIN = 64 << 20

    def __init__(self, app, max_bytes: int, on_reject: Callable[[], None]):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) <= self.max_bytes:  # uvicorn holds the body to its length
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body, more = msg.get("body", b""), msg.get("more_body", False)
            size += len(body)
            if size > self.max_bytes:
                chunks = []
                if size > self.max_bytes + self._DRAIN:
                    break
            else:
                chunks.append(body)
        if size > self.max_bytes:
            self.on_reject()
            told = f"{int(length)} bytes" if length.isdigit() else "larger than that"
            err = APIError(413, f"the request body is {told}; this server accepts at most {self.max_bytes} bytes "
                                f"({self.max_bytes / (1 << 20):g} MiB, serve --max-body-mb)",
                           code="request_too_large")
            return await JSONResponse(_error_body(scope, err), status_code=413, headers={"Connection": "close"})(
                scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)


class _OllamaJSONMiddleware:
    """Ollama reads every /api/ request body as JSON whatever its Content-Type says: its docs'
    `curl -d '{...}'` sends application/x-www-form-urlencoded, litellm (aider's ollama/ and
    ollama_chat/ models) sends none. Those bodies are declared JSON here, as Ollama reads them."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "DELETE") and ollama.is_ollama_path(scope["path"]):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


class _AuthMiddleware:
    """Bearer-key check for everything but /health and CORS preflights (pure ASGI: streams untouched).
    Keys are compared as SHA-256 digests in constant time: neither content nor length leaks."""

    def __init__(self, app, key: str):
        self.app, self.key = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if b"x-api-key" in headers and not auth:  # Anthropic's clients send the key so
            scheme, token = b"bearer", headers[b"x-api-key"]
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key):
            return await self.app(scope, receive, send)
        msg = ("Incorrect API key provided." if auth or b"x-api-key" in headers
               else "Missing API key: send it as 'Authorization: Bearer KEY'.")
        err = APIError(401, msg, code="invalid_api_key")
        await JSONResponse(_error_body(scope, err), status_code=401)(scope, receive, send)


def _service_router(state: ServerState) -> APIRouter:
    """The server's own routes: /health (load balancers, `localllm` clients waiting for the model)
    and /metrics (Prometheus)."""
    api = APIRouter()

    @api.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers and uptime probes use it
    async def health():
        ready, error = state.pool.status()  # on demand: ready at once, models load when asked for
        if error:
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        if not ready or state.admission.closing:
            return JSONResponse({"status": "shutting down" if state.admission.closing else "loading"}, status_code=503)
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics():
        loops = [e.model.loop for e in list(state.pool.loaded.values()) if e.model is not None]
        extra = {"num_requests_in_flight": state.admission.live,
                 "num_requests_pending_admission": sum(lp.pending for lp in loops)}
        backend = state.pool.pinned.backend if state.pool.pinned is not None else None
        if backend is None:
            text = state.metrics.render(combined_stats([lp.stats for lp in loops]), extra)
        else:  # ours (the front's), then the engine's own: vLLM's, named vllm:*
            text = state.metrics.render(None, extra, models_loaded=len(loops)) + await backend.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
    return api


# Each API's routes: a module with `router(state: ServerState) -> APIRouter`; a new API is one more
# line here (its errors are OpenAI-shaped unless _error_body says otherwise).
_ROUTERS: list[Callable[[ServerState], APIRouter]] = [_service_router, openai_routes.router, responses.router,
                                                      anthropic.router, ollama.router, infill.router,
                                                      embeddings.router]


def _backend_routers() -> list[Callable[[ServerState], APIRouter]]:
    """A model another server runs (vLLM): its /v1 answers as it is, Ollama's routes translate onto it."""
    from . import vllm_backend

    return [_service_router, vllm_backend.router, ollama.router]


def create_app(cfg: ServerConfig, pool: ModelPool, log: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app over `pool`: every local model on demand, or the one model pinned in it."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    state = ServerState(cfg, pool, log)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        state.admission.closing = True
        await state.pool.close()
        if pool.pinned is not None and pool.pinned.backend is not None:
            await pool.pinned.backend.aclose()

    app = FastAPI(title="localllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    def count_413() -> None:
        state.metrics.errors[413] += 1
    app.add_middleware(_OllamaJSONMiddleware)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=cfg.max_body_bytes, on_reject=count_413)
    if cfg.api_key:
        app.add_middleware(_AuthMiddleware, key=cfg.api_key)
    if cfg.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    from .host_guard import HostGuardMiddleware, HostPolicy

    def count_403() -> None:
        state.metrics.errors[403] += 1
    # added last: the outermost layer, so a foreign Host or Origin meets nothing else (not even CORS)
    app.add_middleware(HostGuardMiddleware, policy=HostPolicy.make(cfg.bind_host, cfg.allowed_hosts, cfg.cors_origins),
                       error_body=_error_body, on_reject=count_403)

    # ---- errors: each API's shape (_error_body) ----
    def error_response(e: APIError, request: Request) -> JSONResponse:
        state.metrics.errors[e.status] += 1
        return JSONResponse(_error_body(request.scope, e), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(_validation_api_error(e), request)

    def _validation_api_error(e: RequestValidationError) -> APIError:
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") in ("invalid_text", "body_too_deep"):
            return APIError(400, first.get("msg", "invalid text"), param=(first.get("ctx") or {}).get("where"),
                            code=first["type"])
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            return APIError(400, f"invalid JSON in the request body: {ctx.get('error', first.get('msg'))}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if not loc:  # no body, or not an object
            return APIError(400, "the request body must be a JSON object (with Content-Type: application/json)")
        parts = [f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                 for er in errs[:5]]
        return APIError(400, "; ".join(parts), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if isinstance(e.__cause__, RecursionError):  # FastAPI's "error parsing the body" from json.loads
            return error_response(APIError(400, "the request body is nested too deeply to parse (arrays/objects "
                                                f"more than {oai.MAX_BODY_DEPTH} levels inside each other)",
                                           code="body_too_deep"), request)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind), request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log(f"internal error on {request.url.path}: {type(e).__name__}: {e}")
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "internal_error"), request)

    for make in _ROUTERS if pool.pinned is None or pool.pinned.backend is None else _backend_routers():
        app.include_router(make(state))
    return app


# ---- running it ---------------------------------------------------------------------------------
def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> int:
    """Run uvicorn until SIGINT/SIGTERM. Returns the exit code (0 after a signal, 1 if the model
    failed to load)."""
    import signal

    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            state.begin_shutdown()  # end in-flight streams now instead of waiting for them

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                    timeout_graceful_shutdown=5, lifespan="on"))

    def fatal():
        server.should_exit = True
    state.pool.on_fatal = fatal  # a pinned model that cannot load ends the server
    # uvicorn re-raises the signal it caught after a graceful shutdown; with these no-op handlers
    # in place that re-raise is harmless and the process exits 0 instead of dying of SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)
    server.run()
    if not server.started and not state.pool.load_error:
        return 1  # could not bind (uvicorn printed why)
    return 1 if state.pool.load_error else 0
