"""Ollama's native API (/api/...) on the same FastAPI app and port as the OpenAI routes.

Front ends that speak only Ollama (VS Code's Ollama provider, Open WebUI, Continue, the `ollama`
clients) probe /api/version, /api/tags and /api/show, then chat through /api/chat or
/api/generate. These routes run on the same engines as /v1 (generation.Generation), so a prompt
answers with the same tokens on either API. Streams are newline-delimited JSON, durations are in
nanoseconds and errors are {"error": "..."}, as Ollama sends them. `format` (JSON mode or a
schema) holds the output to it; `think` reaches the chat template (enable_thinking) and a
reasoning model's <think> text comes back as `thinking`; `tools` reach the template and the calls
the model writes come back as message.tool_calls; `images` (base64) go to a vision model (a
text-only one answers 400). What we cannot honour is a 400 naming the field, never silently dropped;
routes we do not serve (create, push, copy, blobs) are a 501; embeddings are embeddings.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.background import BackgroundTask

from ..fim import FimRequest
from ..reply_stream import ReplyDelta, ReplyStream
from . import openai_schema as oai
from .generation import Generation, ServedModel
from .infill import fim_prompt, ollama_fim
from .openai_schema import APIError
from .pool import EMBED_TWIN, LocalModel, find_model
from .state import ServerState

VERSION = "0.11.0"  # the Ollama API version we answer like (clients check a minimum)
FOREVER = "2318-11-30T00:00:00Z"  # what Ollama reports as expires_at for keep_alive < 0

# Ollama's think levels (gpt-oss: its reasoning effort); true/false for the others
THINK_LEVELS = ("low", "medium", "high")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


# ---- requests ---------------------------------------------------------------------------------
class _Body(oai._Request):
    model_config = ConfigDict(extra="ignore", strict=False)


class Options(BaseModel):
    """The `options` we map onto SamplingParams; runtime ones (num_thread, num_gpu, ...) are ignored.
    Typed as strictly as the /v1 fields (an integer is a JSON integer: top_k 1e30 or "40" is a 400,
    not 10^30 or 40) and range-checked by the same SamplingParams.validate."""

    model_config = ConfigDict(extra="allow", strict=True)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: Union[str, list[str], None] = None
    num_ctx: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None  # a tool turn: the tool that answered


class _GenBody(_Body):
    model: str = ""
    stream: bool = True
    format: Any = None
    options: Options | None = None
    keep_alive: Union[float, str, None] = None
    think: Any = None


class ChatRequest(_GenBody):
    messages: list[Message] = []
    tools: list[Any] | None = None


class GenerateRequest(_GenBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class ModelRequest(_Body):
    model: str = ""
    name: str = ""  # older clients send `name`

    def target(self) -> str:
        if not (self.model or self.name):
            raise APIError(400, "model is required", param="model")
        return self.model or self.name


class PullRequest(ModelRequest):
    stream: bool = True
    insecure: bool = False


# ---- helpers ----------------------------------------------------------------------------------
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# Go's time.Duration range, which Ollama parses keep_alive into (292 years): longer values were
# accepted and then broke /api/ps (an expiry date past year 9999), so they are refused
KEEP_ALIVE_MAX = (2 ** 63 - 1) / 1e9


def parse_keep_alive(value: float | str | None) -> float | None:
    """Ollama's keep_alive (seconds as a number, or a Go duration "5m", "1h30m", "-1") -> seconds;
    negative: forever, 0: unload after this request, None: the server's default. NaN, infinities
    and durations beyond KEEP_ALIVE_MAX are a 400 naming keep_alive."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise APIError(400, f"keep_alive must be a number of seconds or a duration string, got {value!r}",
                       param="keep_alive")
    try:
        seconds = _duration(value) if isinstance(value, str) else float(value)
    except OverflowError:  # an integer past float's range
        seconds = math.inf
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not math.isfinite(seconds):
        raise APIError(400, f"keep_alive: {shown} is not a finite duration (-1 keeps the model loaded forever)",
                       param="keep_alive")
    if seconds > KEEP_ALIVE_MAX:  # any negative value means forever
        raise APIError(400, f"keep_alive: {shown} is too long: at most {KEEP_ALIVE_MAX:.0f} seconds "
                            "(2562047h, 292 years, as in Ollama); -1 keeps the model loaded forever",
                       param="keep_alive")
    return seconds


def _duration(value: str) -> float:
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise APIError(400, f"keep_alive: {value!r} is not a duration (e.g. 300, \"5m\", \"1h30m\", \"-1\")",
                       param="keep_alive")
    return sign * sum(float(n) * _UNIT[u] for n, u in parts)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _now_iso() -> str:
    return iso(time.time())


def _refuse_unsupported(body: _GenBody) -> None:
    if body.think is not None and not isinstance(body.think, bool) and body.think not in THINK_LEVELS:
        raise APIError(400, f"think must be true, false or one of {', '.join(THINK_LEVELS)}, got {body.think!r}",
                       param="think")
    o = body.options
    if o is not None:
        if o.num_ctx is not None and o.num_ctx < 1:
            raise APIError(400, f"options.num_ctx must be >= 1, got {o.num_ctx}", param="options.num_ctx")
        if o.mirostat not in (None, 0):
            raise APIError(400, "options.mirostat is not supported by this server", param="options.mirostat")
        for name in ("typical_p", "tfs_z"):
            if getattr(o, name) not in (None, 1.0):
                raise APIError(400, f"options.{name} is not supported by this server", param=f"options.{name}")


def with_images(text: str, images: list[Any] | None, param: str) -> str | list[dict]:
    """A message's text and Ollama's base64 images -> content parts for the chat template (the
    images first, then the text, as Ollama renders them); the text alone without images."""
    if not images:
        return text
    from ..model.vision import ImageInputError
    from ..model.vision.images import decode_base64

    out = []
    for i, im in enumerate(images):
        if not isinstance(im, str):
            raise APIError(400, f"{param}[{i}] must be a base64 string", param=param)
        try:
            out.append({"type": "image", "image": decode_base64(im.removeprefix("data:").partition(";base64,")[2]
                                                                if im.startswith("data:") else im, f"{param}[{i}]")})
        except ImageInputError as e:
            raise APIError(400, str(e), param=param) from None
    return [*out, {"type": "text", "text": text}]


def sampling_params(options: Options | None, constraint=None):
    """Ollama options -> SamplingParams, with Ollama's defaults (temperature 0.8, top_k 40,
    top_p 0.9). num_predict < 0 means no limit (up to the context), as in Ollama."""
    from ..sampling import SamplingError, SamplingParams

    o = options or Options()

    def pick(v, default):
        return default if v is None else v
    num_predict = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    try:
        return SamplingParams(
            max_tokens=num_predict, temperature=pick(o.temperature, 0.8), top_p=pick(o.top_p, 0.9),
            top_k=pick(o.top_k, 40), min_p=pick(o.min_p, 0.0), repetition_penalty=pick(o.repeat_penalty, 1.0),
            presence_penalty=pick(o.presence_penalty, 0.0), frequency_penalty=pick(o.frequency_penalty, 0.0),
            seed=o.seed, stop=[o.stop] if isinstance(o.stop, str) else list(o.stop or []), constraint=constraint)
    except SamplingError as e:
        name = "num_predict" if e.param == "max_tokens" else {"repetition_penalty": "repeat_penalty"}.get(
            e.param, e.param)
        raise APIError(400, f"options.{name}: {e}", param=f"options.{name}") from None


def _digest(m: LocalModel) -> str:
    return hashlib.sha256(f"{m.name}\0{m.path}\0{m.size}\0{m.modified}".encode()).hexdigest()


def _details(m: LocalModel, info: dict | None = None) -> dict:
    info = info or {}
    arch = _arch(info.get("architecture"))
    fmt = info.get("format") or ("gguf" if (m.path or "").endswith(".gguf") else "safetensors")
    params = info.get("parameters")
    return {"parent_model": "", "format": fmt, "family": arch, "families": [arch] if arch else None,
            "parameter_size": _param_size(params) if params else "",
            "quantization_level": (info.get("quantization") or m.variant or "").split(" ")[0]}


def _arch(name: str | None) -> str:
    """LlamaForCausalLM -> llama (the GGUF-style name Ollama reports)."""
    if not name:
        return ""
    return re.sub(r"For(CausalLM|ConditionalGeneration|SequenceClassification)$|Model$", "", name).lower()


def _param_size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


async def _catalog(state: ServerState) -> list[LocalModel]:
    return await state.pool.catalog()


async def _find(state: ServerState, name: str) -> LocalModel:
    models = await _catalog(state)
    m = find_model(models, name)
    if m is None:
        raise APIError(404, f"model '{name}' not found, try pulling it first", param="model",
                       code="model_not_found")
    return m


class _Timing:
    """Ollama's *_duration fields (nanoseconds) from the moments a request went through."""

    def __init__(self):
        self.start = time.perf_counter()
        self.loaded = self.start
        self.first = None
        self.end = None

    def ns(self, a: float, b: float) -> int:
        return max(0, int((b - a) * 1e9))


def _final(out, timing: _Timing) -> dict:
    end = timing.end or time.perf_counter()
    first = timing.first or end
    return {"done": True, "done_reason": out.finish_reason or "stop",
            "total_duration": timing.ns(timing.start, end), "load_duration": timing.ns(timing.start, timing.loaded),
            "prompt_eval_count": out.num_prompt_tokens, "prompt_eval_duration": timing.ns(timing.loaded, first),
            "eval_count": len(out.token_ids), "eval_duration": timing.ns(first, end)}


# ---- the routes -------------------------------------------------------------------------------
def router(state: ServerState) -> APIRouter:
    """Ollama's routes over `state` (the server's model pool, admission and metrics)."""
    api = APIRouter()

    @api.get("/api/version")
    async def version():
        return {"version": VERSION}

    @api.get("/api/tags")
    async def tags():
        state.require_ready()
        return {"models": [{"name": m.name, "model": m.name, "modified_at": iso(m.modified), "size": m.size,
                            "digest": _digest(m), "details": _details(m),
                            "capabilities": ["completion"] if m.kind == "generate" else [m.kind]}
                           for m in await _catalog(state)]}

    @api.post("/api/show")
    async def show(body: ModelRequest):
        from ..models_cli import describe
        from ..reasoning import reasons

        state.require_ready()
        m = await _find(state, body.target())
        try:
            info = await asyncio.to_thread(describe, m.name)
        except (OSError, ValueError) as e:  # ModelLoadError: a damaged or partial download in the cache
            raise APIError(400, f"cannot read {m.name}: {e} (a damaged download? `localllm rm {m.name}` and pull "
                                "it again)", param="model") from None
        arch = _arch(info.get("architecture")) or "unknown"
        stops = [t["text"] for t in info.get("stop_tokens") or []]
        model_info = {"general.architecture": arch, "general.parameter_count": info.get("parameters"),
                      f"{arch}.context_length": info.get("context_length"),
                      f"{arch}.embedding_length": info.get("embedding_length"),
                      f"{arch}.block_count": info.get("layers"),
                      f"{arch}.attention.head_count": info.get("heads"),
                      f"{arch}.attention.head_count_kv": info.get("kv_heads"),
                      f"{arch}.vocab_size": info.get("vocab_size")}
        template = (info.get("chat_template") or {}).get("template") or ""
        from .generic_tools import takes_tools

        # every model calls tools: through its template's `tools`, or the generic JSON format
        model_info["localllm.tool_calling"] = "template" if takes_tools(template) else "generic"
        return {"license": "", "modelfile": f"# served by localllm\nFROM {m.path}\n",
                "parameters": "\n".join(f'stop "{s}"' for s in stops), "template": template,
                "details": _details(m, info), "model_info": model_info,
                "capabilities": [info["kind"]] if info.get("kind") else [
                    "completion", *(["insert"] if info.get("fill_in_middle") else []), "tools",
                    *(["thinking"] if reasons(template) else []), *(["vision"] if info.get("vision") else [])],
                "modified_at": iso(m.modified)}

    @api.get("/api/ps")
    async def ps():
        state.require_ready()
        rows = []
        models = {m.name: m for m in await state.pool.catalog()}
        for name, e in list(state.pool.loaded.items()):
            name = name.removesuffix(EMBED_TWIN)  # a chat model loaded for embeddings is that model
            if e.model is None or name not in models:
                continue
            expires = (FOREVER if e.keep_alive < 0 else
                       iso(e.expires_at if e.expires_at is not None else time.time() + e.keep_alive))
            rows.append(_ps_row(models[name], e.model, expires, e.need))
        return {"models": rows}

    @api.post("/api/chat")
    async def chat(body: ChatRequest, request: Request):
        state.metrics.http_requests += 1
        _refuse_unsupported(body)
        keep_alive = parse_keep_alive(body.keep_alive)
        if not body.model:
            raise APIError(400, "model is required", param="model")
        if not body.messages:
            return await _load_only(state, body.model, keep_alive, True)
        from .tools import ToolError, check_tools, template_messages

        try:
            tools = check_tools(body.tools or [])
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        messages = template_messages([
            {"role": m.role, "content": with_images(m.content or "", m.images, f"messages[{i}].images"),
             **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
             **({"name": m.tool_name} if m.tool_name else {})} for i, m in enumerate(body.messages)])
        return await _run(state, body.model, messages, body.options, keep_alive, body.stream, request, True,
                          body.format, body.think, (tools, body.tools) if tools else None)

    @api.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request):
        state.metrics.http_requests += 1
        _refuse_unsupported(body)
        if body.images and (body.raw or body.suffix):
            raise APIError(400, "images need a chat prompt: not with raw or suffix", param="images")
        for name in ("template", "context"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        keep_alive = parse_keep_alive(body.keep_alive)
        if not body.model:
            raise APIError(400, "model is required", param="model")
        if not body.prompt and not body.suffix:
            return await _load_only(state, body.model, keep_alive, False)
        if body.suffix:  # fill-in-the-middle, raw or not (the FIM tokens are no chat template)
            prompt: Any = ollama_fim(body.prompt, body.suffix, body.system)
        elif body.raw:
            prompt = body.prompt
        else:
            prompt = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": with_images(body.prompt, body.images, "images")}]
        return await _run(state, body.model, prompt, body.options, keep_alive, body.stream, request, False, body.format,
                          body.think)

    @api.post("/api/pull")
    async def pull(body: PullRequest):
        return await _pull(state, body)

    @api.delete("/api/delete")
    async def delete(body: ModelRequest):
        from ..hub import HubError
        from ..models_cli import remove

        name = body.target()
        _named(name.removesuffix(":latest"))  # a path or unknown name: refused before the disk is looked at
        m = find_model(await state.pool.catalog(), name)
        if m is not None and state.pool.pinned is not None:
            raise APIError(400, f"{name} is the model this server was started with; stop the server to delete it",
                           param="model")
        if m is not None:
            await state.pool.unload(m.name)
        try:
            await asyncio.to_thread(remove, name)
        except (HubError, ValueError) as e:
            raise APIError(404, str(e), param="model") from None
        return Response(status_code=200)

    async def not_served(request: Request):
        raise APIError(501, f"{request.method} {request.url.path} is not supported by localllm (it serves local "
                            "text models: chat, generate, pull, delete)", "not_implemented")

    for path in ("/api/create", "/api/push", "/api/copy", "/api/blobs/{digest}"):
        api.add_api_route(path, not_served, methods=["POST", "HEAD"] if "blobs" in path else ["POST"],
                          include_in_schema=False)
    return api


def _ps_row(m: LocalModel, served: ServedModel, expires: str, size: int) -> dict:
    engine, stats = served.engine, served.loop.stats
    if served.backend is not None:  # another server runs it (vLLM): which one, instead of our KV blocks
        return {"name": m.name, "model": m.name, "size": size, "digest": _digest(m), "details": _details(m),
                "expires_at": expires, "size_vram": 0, "context_length": engine.max_model_len,
                "backend": served.backend.describe()}
    return {"name": m.name, "model": m.name, "size": size, "digest": _digest(m), "details": _details(m),
            "expires_at": expires, "size_vram": 0 if str(engine.loaded.model.device) == "cpu" else size,
            "context_length": engine.max_model_len,
            # ours: KV blocks in use (0 when idle: nothing leaked) and in all
            "kv_blocks_used": stats.get("kv_blocks_used", 0), "kv_blocks_total": stats.get("kv_blocks_total", 0)}


async def _load_only(state: ServerState, name: str, keep_alive: float | None, chat: bool):
    """An empty chat/generate: load the model (or, with keep_alive 0, unload it), as Ollama does."""
    if keep_alive == 0 and state.pool.pinned is None:
        m = await _find(state, name)
        await state.pool.unload(m.name)
        reason = "unload"
    else:
        _, release = await state.acquire(name, keep_alive, task="chat" if chat else "generate")
        release()
        reason = "load"
    body = {"model": name, "created_at": _now_iso(), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return body


async def _run(state: ServerState, name: str, prompt: str | list[dict] | FimRequest, options: Options | None,
               keep_alive: float | None, stream: bool, request: Request, chat: bool, fmt: Any = None,
               think: bool | str | None = None, tools: tuple[dict, list] | None = None):
    """`tools`: (name -> parameters, the tools as sent) of a chat that offers some."""
    from ..generic_calls import GenericTools
    from ..reasoning import reasons
    from . import generic_tools
    from .output_format import make, ollama_format

    constraint = ollama_format(fmt)
    timing = _Timing()
    served, release = await state.acquire(name, keep_alive, options.num_ctx if options is not None else None,
                                          "chat" if chat else "generate")
    timing.loaded = time.perf_counter()
    try:
        template = served.engine.tokenizer.chat_template
        if think and not reasons(template):
            raise APIError(400, f"\"{name}\" does not support thinking (its chat template has no <think> tags)",
                           param="think")
        if isinstance(think, str) and reasons(template) != "harmony":
            raise APIError(400, f"think levels ({', '.join(THINK_LEVELS)}) set a gpt-oss model's reasoning effort; "
                           f"\"{name}\" takes think true or false", param="think")
        constraint_param = "format"
        if chat and not generic_tools.takes_tools(template):  # the tools and tool turns as text turns
            prompt = generic_tools.messages(prompt, tools[1] if tools else None, template)
        if tools and not generic_tools.takes_tools(template):  # an answer is held to `format`, if set
            answer = generic_tools.answer_of(constraint)
            tools = (GenericTools(tools[0], answer), None)
            constraint = make("tools", "json_schema", generic_tools.schema(tools[0], "auto", answer))
            constraint_param = "tools"
        params = sampling_params(options, constraint)
        if isinstance(prompt, FimRequest):
            prompt = await fim_prompt(served, prompt, [params])
        kwargs = {} if think is None else {"enable_thinking": bool(think)}
        if think in THINK_LEVELS:  # gpt-oss's reasoning effort (Ollama's levels); others just think
            kwargs["reasoning_effort"] = think
        if tools and tools[1] is not None:
            kwargs["tools"] = tools[1]
        gen = Generation(served, state.admission, [prompt], [params], max_tokens_param="num_predict",
                         prompt_param="messages" if chat else "prompt", constraint_param=constraint_param,
                         template_kwargs=kwargs, on_close=release)
        await gen.start()
    except BaseException:
        release()
        raise
    # as Ollama: with think unset the reply is passed through as the model wrote it, except a
    # harmony reply (gpt-oss), whose reasoning Ollama always returns as its thinking
    thinks, inside = gen.reasoning() if think is not None or reasons(template) == "harmony" else (False, False)
    reply = ReplyStream(thinks, inside, tools[0] if tools else None)
    shows_thinking = bool(think) or thinks == "harmony"

    def piece(part: ReplyDelta) -> dict:
        extra = {"thinking": part.reasoning} if part.reasoning and shows_thinking else {}
        if part.tool_calls:  # Ollama's shape: arguments as an object, no ids
            extra["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}}
                                   for c in part.tool_calls]
        if chat:
            return {"message": {"role": "assistant", "content": part.content, **extra}}
        return {"response": part.content, **extra}

    if not stream:
        if not await gen.collect(request):
            return Response(status_code=499)
        timing.end = time.perf_counter()
        timing.first = gen.first_token_at or timing.end
        out = gen.finals[0]
        return {"model": name, "created_at": _now_iso(), **piece(reply.whole(out.text)), **_final(out, timing)}

    async def events() -> AsyncIterator[str]:
        try:
            async for _, out in gen.outputs():
                if timing.first is None and out.new_token_ids:
                    timing.first = time.perf_counter()
                part = reply.feed(out.delta, out.finished)
                if part.content or (part.reasoning and shows_thinking) or part.tool_calls:
                    yield _line({"model": name, "created_at": _now_iso(), **piece(part), "done": False})
                if out.finished:
                    timing.end = time.perf_counter()
                    yield _line({"model": name, "created_at": _now_iso(), **piece(ReplyDelta()),
                                 **_final(out, timing)})
        except APIError as e:  # after the headers: an error line, as Ollama sends it
            state.metrics.errors[e.status] += 1
            yield _line({"error": e.message})
        finally:
            gen.close()
    return StreamingResponse(events(), media_type="application/x-ndjson", background=BackgroundTask(gen.close))


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


# ---- pull -------------------------------------------------------------------------------------
class _PullProgress:
    """Stands in for hub's rich progress bars: each file's bytes become Ollama status objects."""

    def __init__(self, emit):
        self.emit, self.tasks = emit, {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, desc: str, total: int | None = None, completed: int = 0) -> int:
        i = len(self.tasks)
        self.tasks[i] = [desc, total or 0, completed, -1]
        self._report(i)
        return i

    def update(self, task: int, advance: float = 0) -> None:
        t = self.tasks[task]
        t[2] += int(advance)
        if t[2] - t[3] >= (1 << 20) or t[2] >= t[1]:  # every MiB and the end: not one object per chunk
            self._report(task)

    def _report(self, task: int) -> None:
        desc, total, done, _ = self.tasks[task]
        self.tasks[task][3] = done
        self.emit({"status": f"pulling {desc}", "digest": desc, "total": total, "completed": min(done, total)})


def _named(name: str, prefix: str = ""):
    """The ModelRef of a model name from a client: a registry name or a hub repo id, never a path
    (registry.resolve_name; the answer must not depend on which files exist on the server):
    400 for a path or other non-name, 404 for an unknown name."""
    from ..registry import InvalidModelName, UnknownModelError, resolve_name

    try:
        return resolve_name(name)
    except InvalidModelName as e:
        raise APIError(400, f"{prefix}{e}", param="model") from None
    except UnknownModelError as e:
        hint = f"; did you mean: {', '.join(e.suggestions)}?" if e.suggestions else ""
        raise APIError(404, f"{prefix}model {name!r} not found{hint} (a registry name, see `localllm list`, or a "
                            "hub repo id 'org/name')", param="model", code="model_not_found") from None


async def _pull(state: ServerState, body: PullRequest):
    from ..hub import HubError, variant_for
    from ..hub import pull as hub_pull
    from ..models_cli import local_path

    name = body.target()
    ref = _named(name.removesuffix(":latest"), "pull model manifest: ")
    here = await asyncio.to_thread(local_path, ref)
    aloop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def emit(obj: dict) -> None:
        aloop.call_soon_threadsafe(queue.put_nowait, obj)

    def work() -> None:
        try:
            if here is None:
                v = variant_for(ref, "auto")
                hub_pull(v.repo, v.revision, v.filename, progress=False, bars=_PullProgress(emit), mmproj=v.mmproj)
            emit({"status": "verifying sha256 digest"})
            emit({"status": "writing manifest"})
            emit({"status": "success"})
        except HubError as e:
            emit({"error": str(e)})
        except Exception as e:  # noqa: BLE001 - reported to the client, never a dropped stream
            emit({"error": f"pull failed: {type(e).__name__}: {e}"})
        emit(None)

    task = asyncio.create_task(asyncio.to_thread(work))

    async def events() -> AsyncIterator[dict]:
        yield {"status": "pulling manifest"}
        while (obj := await queue.get()) is not None:
            yield obj
        await task

    if not body.stream:
        last: dict = {}
        async for obj in events():
            last = obj
        if "error" in last:
            raise APIError(404 if "not found" in last["error"] else 502, last["error"], param="model")
        return last

    async def lines() -> AsyncIterator[str]:
        async for obj in events():
            yield _line(obj)
    return StreamingResponse(lines(), media_type="application/x-ndjson")
