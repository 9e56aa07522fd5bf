"""`localllm serve`: an OpenAI- and Ollama-compatible HTTP server (FastAPI + uvicorn) over the model
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

import asyncio
import hashlib
import hmac
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_schema as oai
from .generation import Generation
from .metrics import ServerMetrics
from .openai_schema import APIError
from .pool import LoadedModel, ModelPool


# ---- server state ------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_queue: int = 256  # requests beyond the engine's batch (max_num_seqs) that may wait
    max_num_seqs: int = 64
    max_body_bytes: int = 8 << 20  # larger request bodies get a 413
    bind_host: str = "127.0.0.1"  # the --host it listens on (host_guard: loopback-bound servers check Host)
    allowed_hosts: list[str] = field(default_factory=list)  # --allow-host: more Host names ('*': any)


class ServerState:
    """What every route shares: the config, the model pool (every local model on demand, or a pool
    of one pinned model: both modes run the same code), counters and metrics."""

    def __init__(self, cfg: ServerConfig, pool: ModelPool, log: Callable[[str], None]):
        self.cfg = cfg
        self.pool = pool
        self.log = log
        self.created = oai.now()
        self.closing = False
        self.metrics = ServerMetrics()
        self.live = 0  # engine requests admitted or being admitted, not finished (429 check)
        self.aloop: asyncio.AbstractEventLoop | None = None

    def start_loading(self) -> None:
        self.aloop = asyncio.get_running_loop()
        self.pool.start()

    def begin_shutdown(self) -> None:
        """Called from the signal handler: end in-flight requests now so connections close fast."""
        self.closing = True
        if self.aloop is not None:
            self.aloop.call_soon_threadsafe(self.pool.begin_shutdown)

    def require_ready(self) -> None:
        if self.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down")
        if not self.pool.status()[0]:
            raise APIError(503, "the model is still loading; retry shortly", "service_unavailable",
                           code="model_loading", headers={"Retry-After": "1"})

    async def acquire(self, name: str | None, keep_alive: float | None = None, num_ctx: int | None = None,
                      task: str = "generate") -> tuple[LoadedModel, Callable[[], None]]:
        """The model a request names, ready to run (loaded first on demand, with `num_ctx` as its
        context when given; a pinned model keeps the server's --ctx), and the callback that ends
        its use."""
        self.require_ready()
        return await self.pool.acquire(name, keep_alive, num_ctx, task)


# ---- request -> engine requests ------------------------------------------------------------------
def _sampling(body: oai._SamplingRequest, max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
              seed_offset: int = 0, constraint=None, logit_bias: dict[int, float] | None = None):
    from ..sampling import SamplingError, SamplingParams

    def pick(v, default):
        return default if v is None else v

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=pick(body.temperature, 1.0), top_p=pick(body.top_p, 1.0),
            top_k=pick(body.top_k, 0), min_p=pick(body.min_p, 0.0),
            repetition_penalty=pick(body.repetition_penalty, 1.0),
            presence_penalty=pick(body.presence_penalty, 0.0), frequency_penalty=pick(body.frequency_penalty, 0.0),
            seed=None if body.seed is None else body.seed + seed_offset,  # n>1: one per choice
            stop=[] if body.stop is None else body.stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs, min_tokens=body.min_tokens, constraint=constraint, logit_bias=logit_bias)
    except SamplingError as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise APIError(400, str(e).replace("max_tokens", param, 1), param=param) from None


def _structured(body: oai._SamplingRequest) -> tuple[str, Any] | None:
    """(field, Constraint) of the request's structured-output field, if it sets one."""
    from . import output_format

    rf = output_format.response_format(body.response_format)
    vllm = output_format.vllm_fields(body.model_extra or {})
    if rf is not None and vllm is not None:
        raise APIError(400, f"send either response_format or {vllm[0]}, not both", param=vllm[0])
    return (output_format.response_format_field(body.response_format), rf) if rf is not None else vllm


def _check_common(body: oai._SamplingRequest, max_tokens: int | None, max_tokens_param: str, vocab: int) -> None:
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0])
    if not 1 <= body.n <= 16:
        raise APIError(400, f"n must be between 1 and 16, got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if max_tokens is not None and max_tokens >= 1 and body.min_tokens > max_tokens:  # < 1: SamplingParams names it
        raise APIError(400, f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                       param="min_tokens")
    out = [t for t in body.stop_token_ids or [] if not 0 <= t < vocab]
    if out:
        raise APIError(400, f"stop_token_ids must be in 0..{vocab - 1}, got {out[0]}", param="stop_token_ids")


def _params_list(body, max_tokens, max_tokens_param, logprobs, vocab: int,
                 forced: tuple[str, Any] | None = None) -> tuple[list, str | None]:
    """One SamplingParams per choice, and the field the constraint came from (None: no constraint).
    `forced`: (field, constraint) of a tool call the request demands."""
    found = _structured(body)
    if forced is not None and found is not None:
        raise APIError(400, f"{found[0]} cannot be combined with forcing a tool call ({forced[0]})", param=found[0])
    found = found or forced
    field_, constraint = found if found else (None, None)
    bias = body.token_bias(vocab)
    return [_sampling(body, max_tokens, max_tokens_param, logprobs, j, constraint, bias)
            for j in range(body.n)], field_


def _tool_setup(body: oai.ChatCompletionRequest, template: str | None) -> tuple[dict | None, bool, list | None, Any]:
    """(offered tools: name -> parameters, None when no call can come; whether the deprecated
    functions API asked; the tools for the chat template; (field, constraint) forcing a call)."""
    from . import output_format
    from . import tool_calls as tc

    legacy = body.functions is not None or body.function_call is not None
    if legacy and (body.tools is not None or body.tool_choice is not None):
        raise APIError(400, "send tools/tool_choice or the deprecated functions/function_call, not both",
                       param="functions")
    if legacy:
        if not isinstance(body.functions or [], list):
            raise APIError(400, "functions must be a list of function definitions", param="functions")
        raw = [{"type": "function", "function": f} for f in body.functions or []]
        fc = body.function_call
        choice_in, p_tools, p_choice = ({"type": "function", "function": fc} if isinstance(fc, dict) else fc,
                                        "functions", "function_call")
    else:
        raw, choice_in, p_tools, p_choice = body.tools or [], body.tool_choice, "tools", "tool_choice"
    try:
        tools = tc.check_tools(raw, p_tools)
        choice = tc.choice_of(choice_in, tools, p_choice)
    except tc.ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    if choice == "none" or not tools:  # as vLLM: with 'none' the tools are not shown to the model
        return None, legacy, None, None
    if not template or "tools" not in template:
        raise APIError(400, f"{p_tools}: this model's chat template does not take tools (it cannot be told "
                            "about them)", param=p_tools)
    forced = None
    if choice != "auto":
        grammar = tc.forcing_grammar(tools, choice, tc.style_of(template))
        forced = (p_tools, output_format.make(p_tools, "grammar", grammar))  # p_tools: what a compile error names
    return tools, legacy, raw, forced


def _template_kwargs(kwargs: dict | None) -> dict:
    """vLLM's chat_template_kwargs, less the variables the renderer sets itself."""
    taken = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
    clash = sorted(taken & set(kwargs or {}))
    if clash:
        raise APIError(400, f"chat_template_kwargs: {clash[0]!r} is set by the server", param="chat_template_kwargs")
    return dict(kwargs or {})


def _sse(obj: dict | str) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


# ---- the app ------------------------------------------------------------------------------------
def _error_body(scope, err: APIError) -> dict:
    """An error as the route's API shapes it: Ollama's {"error": "..."} on /api/, else OpenAI's."""
    from .ollama import is_ollama_path

    return {"error": err.message} if is_ollama_path(scope["path"]) else err.body()


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
        from .ollama import is_ollama_path

        if scope["type"] == "http" and scope["method"] in ("POST", "DELETE") and is_ollama_path(scope["path"]):
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
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key):
            return await self.app(scope, receive, send)
        msg = "Incorrect API key provided." if auth else "Missing API key: send it as 'Authorization: Bearer KEY'."
        err = APIError(401, msg, code="invalid_api_key")
        await JSONResponse(_error_body(scope, err), status_code=401)(scope, receive, send)


def create_app(cfg: ServerConfig, pool: ModelPool, log: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app over `pool`: every local model on demand, or the one model pinned in it."""
    from . import ollama as ollama_api

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    state = ServerState(cfg, pool, log)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        state.closing = True
        await state.pool.close()

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

    # ---- errors: OpenAI's shape, Ollama's ({"error": "..."}) on Ollama's /api/ routes ----
    def error_response(e: APIError, request: Request | None = None) -> JSONResponse:
        state.metrics.errors[e.status] += 1
        if request is not None and ollama_api.is_ollama_path(request.url.path):
            return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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

    # ---- endpoints ----
    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers and uptime probes use it
    async def health():
        ready, error = state.pool.status()  # on demand: ready at once, models load when asked for
        if error:
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        if not ready or state.closing:
            return JSONResponse({"status": "loading" if not state.closing else "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from .metrics import combined_stats

        loops = [m.loop for m in list(state.pool.loaded.values()) if m.loop is not None]
        extra = {"num_requests_in_flight": state.live,
                 "num_requests_pending_admission": sum(lp.pending for lp in loops)}
        return PlainTextResponse(state.metrics.render(combined_stats([lp.stats for lp in loops]), extra),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        state.require_ready()
        return {"object": "list", "data": [state.pool.model_card(m) for m in await state.pool.catalog()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.require_ready()
        return state.pool.model_card(await state.pool.find(model_id))

    async def _on_model(handler, body, request: Request):
        """Run a /v1 handler on the model the body names; the model stays in use (pool mode)
        until the response ends, or is released here when the handler fails."""
        state.metrics.http_requests += 1
        target, release = await state.acquire(body.model, task="chat" if "chat" in request.url.path else "generate")
        try:
            return await handler(body, request, target, release)
        except BaseException:
            release()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oai.ChatCompletionRequest, request: Request):
        return await _on_model(_chat_completion, body, request)

    async def _chat_completion(body: oai.ChatCompletionRequest, request: Request, target, release):
        mt_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        vocab = target.engine.model_config.vocab_size
        _check_common(body, max_tokens, mt_param, vocab)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be between 0 and 20, got {body.top_logprobs}",
                           param="top_logprobs")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tools, legacy, template_tools, forced = _tool_setup(body, target.engine.tokenizer.chat_template)
        params, constraint_param = _params_list(body, max_tokens, mt_param, logprobs, vocab, forced)
        kwargs = _template_kwargs(body.chat_template_kwargs)
        if template_tools is not None:
            kwargs["tools"] = template_tools
        from .tool_calls import template_messages

        gen = Generation(state, [template_messages(oai.message_dicts(body.messages))], params, body.n, mt_param,
                         "messages", target, release, kwargs, constraint_param)
        await gen.start()
        rid, created, name = oai.new_id("chatcmpl"), oai.now(), target.name
        token_text = _token_text(target.engine)
        thinks, inside = gen.reasoning()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _stream(gen, _chat_events(gen, rid, created, name, include_usage, body.logprobs, token_text,
                                             inside if thinks else None, tools, legacy))
        if not await gen.collect(request):  # the client went away
            return Response(status_code=499)
        choices = [oai.chat_choice(i, o.text, o.finish_reason,
                                   oai.chat_logprobs(o.logprobs, token_text) if body.logprobs else None,
                                   inside if thinks else None, tools, legacy)
                   for i, o in sorted(gen.finals.items())]
        return oai.chat_response(rid, created, name, choices, gen.usage())

    @app.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, request: Request):
        return await _on_model(_completion, body, request)

    async def _completion(body: oai.CompletionRequest, request: Request, target, release):
        _check_common(body, body.max_tokens, "max_tokens", target.engine.model_config.vocab_size)
        for param, bad in (("echo", body.echo), ("suffix", body.suffix), ("best_of", (body.best_of or 1) > 1)):
            if bad:
                raise APIError(400, f"{param} is not supported by this server", param=param)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs must be between 0 and 20, got {body.logprobs}", param="logprobs")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) * body.n > 16:
            raise APIError(400, f"at most 16 choices per request (prompts x n), got {len(prompts) * body.n}",
                           param="prompt")
        vocab = target.engine.model_config.vocab_size
        params, constraint_param = _params_list(body, body.max_tokens, "max_tokens", body.logprobs, vocab)
        gen = Generation(state, prompts, params, body.n, "max_tokens", "prompt", target, release,
                         constraint_param=constraint_param)
        await gen.start()
        rid, created, name = oai.new_id("cmpl"), oai.now(), target.name
        token_text = _token_text(target.engine)
        want_lp = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _stream(gen, _completion_events(gen, rid, created, name, include_usage, want_lp, token_text))
        if not await gen.collect(request):
            return Response(status_code=499)
        choices = [oai.completion_choice(i, o.text, o.finish_reason,
                                         oai.completion_logprobs(o.logprobs, token_text) if want_lp else None)
                   for i, o in sorted(gen.finals.items())]
        return oai.completion_response(rid, created, name, choices, gen.usage())

    @app.post("/tokenize")
    async def tokenize(body: oai.TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        from ..chat import ChatTemplateError

        target, release = await state.acquire(body.model)
        engine = target.engine
        try:  # rendering and encoding off the event loop, as for generation requests
            if body.messages is not None:
                tokens = await asyncio.to_thread(engine.encode_prompt, oai.message_dicts(body.messages))
            else:
                tokens = await asyncio.to_thread(engine.tokenizer.encode, body.prompt,
                                                 add_special_tokens=body.add_special_tokens)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            release()
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: oai.DetokenizeRequest):
        target, release = await state.acquire(body.model)
        try:
            engine = target.engine
            vocab = engine.model_config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids must be in 0..{vocab - 1}, got {bad[0]}", param="tokens")
            return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}
        finally:
            release()

    ollama_api.mount(app, state)
    from .embeddings import router as embeddings_router

    app.include_router(embeddings_router)  # /v1/embeddings, /api/embed(dings), /v1/rerank, /rerank, /score
    return app


def _token_text(engine) -> Callable[[int], str]:
    tok = engine.tokenizer
    return lambda tid: tok.decode([tid], skip_special_tokens=False)


def _stream(gen: Generation, events: AsyncIterator[str]) -> StreamingResponse:
    # background=gen.close: runs however the response ends, even when the client left before the
    # event generator was first iterated (then its own `finally` never runs)
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(gen.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage_null(chunk: dict, include_usage: bool) -> dict:
    """With stream_options.include_usage every chunk before the usage chunk carries "usage": null,
    as OpenAI streams them (clients read the field on every chunk)."""
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _chat_events(gen: Generation, rid: str, created: int, name: str, include_usage: bool, want_lp: bool,
                       token_text, thinking: bool | None = None, tools: dict | None = None,
                       legacy: bool = False) -> AsyncIterator[str]:
    """vLLM's sequence: a role chunk per choice, content deltas, a finish chunk, [usage], [DONE].
    `thinking` not None: a reasoning model (True: its reply starts inside <think>); its reasoning
    goes out as reasoning_content deltas, the answer as content; with `tools`, calls as tool_calls."""
    seen = [0] * len(gen.jobs)  # logprob entries already sent, per choice
    split = thinking is not None or tools is not None
    splitters = [oai.ChatDeltas(thinking, tools, legacy) for _ in gen.jobs] if split else None
    try:
        for i in range(len(gen.jobs)):
            yield _sse(_usage_null(oai.chat_chunk(rid, created, name, i, {"role": "assistant", "content": ""}),
                                   include_usage))
        async for i, out in gen.outputs():
            lp = None
            if want_lp:
                entries = out.logprobs[seen[i]:seen[i] + len(out.new_token_ids)]
                seen[i] += len(entries)
                lp = oai.chat_logprobs(entries, token_text) if entries else None
            if splitters is not None:
                delta = splitters[i].feed(out.delta, out.finished)
            else:
                delta = {"content": out.delta} if out.delta else {}
            if not delta and not out.finished and lp is None:
                continue  # text held back (partial UTF-8, a possible stop string or reasoning tag)
            reason = out.finish_reason if out.finished else None
            if splitters is not None:
                reason = splitters[i].finish_reason(reason)
            yield _sse(_usage_null(oai.chat_chunk(rid, created, name, i, delta, reason, lp), include_usage))
        if include_usage:
            yield _sse(oai.usage_chunk(rid, created, name, "chat.completion.chunk", gen.usage()))
    except APIError as e:  # after the headers: an error event, then [DONE]
        gen.state.metrics.errors[e.status] += 1
        yield _sse(e.body())
    finally:
        gen.close()
    yield _sse("[DONE]")


async def _completion_events(gen: Generation, rid: str, created: int, name: str, include_usage: bool,
                             want_lp: bool, token_text) -> AsyncIterator[str]:
    seen = [0] * len(gen.jobs)
    offsets = [0] * len(gen.jobs)
    try:
        async for i, out in gen.outputs():
            lp = None
            if want_lp:
                entries = out.logprobs[seen[i]:seen[i] + len(out.new_token_ids)]
                seen[i] += len(entries)
                lp = oai.completion_logprobs(entries, token_text, offsets[i]) if entries else None
                if lp:
                    offsets[i] += sum(len(t) for t in lp["tokens"])
            if not out.delta and not out.finished and lp is None:
                continue
            yield _sse(_usage_null(oai.completion_chunk(rid, created, name, i, out.delta,
                                                        out.finish_reason if out.finished else None, lp),
                                   include_usage))
        if include_usage:
            yield _sse(oai.usage_chunk(rid, created, name, "text_completion", gen.usage()))
    except APIError as e:
        gen.state.metrics.errors[e.status] += 1
        yield _sse(e.body())
    finally:
        gen.close()
    yield _sse("[DONE]")


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
